"""The trust-region trainers (SPEC §3): one model kind per class, over the loss objects of
:mod:`dllm_trl.losses.trust_region_loss`.

* :class:`CausalDPPOMaskTrainer` (a ``GRPOTrainer``): causal LMs, the paper's setting. Generation is TRL's own with a
  :class:`~dllm_trl.generation.BehaviourCapture` appended last to the logits processors ``generate()`` builds, so it
  sees exactly the distribution each token is drawn from; or, with ``use_vllm``, vLLM's (colocate or server) with μ
  the engine's top-K log-probs as sampled (:mod:`dllm_trl.generation.vllm_rollouts`). The loss is
  :class:`CausalTrustRegionLoss`.
* :class:`DiffusionDPPOMaskTrainer` (an :class:`RLDFTrainer`): masked diffusion LMs; RLDF's rollouts, states, targets,
  normalisation and per-step backward with :class:`DiffusionTrustRegionLoss` as the loss object.
* :func:`DPPOMaskTrainer`: the name users know, a factory function; it builds the trainer of the model's kind
  (``args.model_kind``, ``"auto"``: the kind of the model's family).
"""

from __future__ import annotations

import contextlib

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.trainer import grpo_trainer
from trl.trainer.utils import add_fused_lm_head, create_model_from_path

from ..generation.behaviour import BehaviourCapture, appended_logits_processor
from ..generation.vllm_rollouts import engine_behaviour, engine_rollouts_class, import_checked_vllm, replaced_attribute
from ..losses.rollout_mismatch import mismatch_metrics
from ..losses.trust_region_loss import CausalTrustRegionLoss
from ..models.bidirectional import is_bidirectional
from ..models.engines import unwrap_model
from ..models.engines import vocab_size as model_vocab_size
from ..families import family_for_checkpoint, family_of, load_diffusion_model
from ..families.masked import check_top_k
from ..models.loading import hub_kwargs, read_raw_config
from .common import (
    init_with_reference,
    log_metric_extremes,
    log_metric_sums,
    old_checkpointing_names_quiet,
    prepare_reference,
    refuse_unsupported_kwargs,
    SafeRunMixin,
)
from .dppo_mask_config import CausalDPPOMaskConfig, DPPOMaskConfig
from .rldf_trainer import RLDFTrainer

BEHAVIOUR_KEYS = ("behaviour_topk_ids", "behaviour_topk_logps", "behaviour_logps")
"""Batch keys of the causal path: μ top-K ids / log-probs (B, C, K) and μ(a) (B, C), aligned with completion_ids."""
OLD_BEHAVIOUR_KEYS = ("old_topk_ids", "old_topk_logps", "old_behaviour_logps")
"""Batch keys of the diffusion path: π_old's top-K (B, k, G, K) and π_old(a) (B, k, G) at the sampled states."""


def detect_model_kind(model) -> str:
    """``"diffusion"`` or ``"causal"``: the kind of the model's family (:func:`~dllm_trl.families.family_of`)."""
    return family_of(model).kind


def _attends_bidirectionally(model) -> bool:
    try:
        return is_bidirectional(model)
    except TypeError:  # no attention modules it knows: not a masked-diffusion LM it made bidirectional
        return False


def _load_model(name_or_path: str, args: DPPOMaskConfig):
    """A checkpoint as the trainer of ``args.model_kind`` needs it (``"auto"``: its family's kind)."""
    init_kwargs = dict(args.model_init_kwargs or {})
    kind = args.model_kind
    if kind == "auto":
        kind = family_for_checkpoint(read_raw_config(name_or_path, **hub_kwargs(init_kwargs))).kind
    if kind == "diffusion":
        return load_diffusion_model(name_or_path, **init_kwargs)
    return create_model_from_path(name_or_path, **init_kwargs)


def _fit_width(x: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Crop or right-pad dim 1 of ``x`` to ``width``."""
    if x.shape[1] >= width:
        return x[:, :width]
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, pad], dim=1)


class DiffusionDPPOMaskTrainer(RLDFTrainer):
    """RLDF's diffusion rollouts, states and targets with the (predictive) divergence trust-region mask per target
    token (:class:`~dllm_trl.losses.DiffusionTrustRegionLoss`). Args mirror [`RLDFTrainer`]."""

    _tag_names = ["trl", "dppo", "divergence-mask", "diffusion"]
    config_class = DPPOMaskConfig
    model_kind = "diffusion"

    def __init__(self, model, reward_funcs=None, args: DPPOMaskConfig | None = None, **kwargs):
        if args is None:
            args = DPPOMaskConfig("dppo-mask-output")
        if isinstance(args, DPPOMaskConfig) and args.loss_type != "dapo":
            raise ValueError(
                f"loss_type={args.loss_type!r} applies to causal LMs; on a diffusion LM the terms are aggregated "
                "with loss_normalization ('token' ≈ 'dapo', 'sample' ≈ 'grpo'): set that instead."
            )
        super().__init__(model, reward_funcs=reward_funcs, args=args, **kwargs)

    def make_loss(self, args, model):
        """The trust-region loss of the model's family."""
        return self.family.trust_region_loss(args, model)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if "rollout_topk_ids" not in output:
            raise RuntimeError("The batch lacks the rollout's top-K record: the sampler must record the behaviour "
                               "top-K (its config's record_topk) that the loss asks for.")
        if ("old_per_token_logps" in output) != ("old_topk_ids" in output):
            raise RuntimeError(
                "TRL's old-policy pass did not happen where DiffusionDPPOMaskTrainer expected it (see _old_logps_needed)."
            )
        return output


class CausalDPPOMaskTrainer(SafeRunMixin, GRPOTrainer):
    """GRPO with the (predictive) divergence trust-region mask for causal LMs, the paper's setting.

    Args mirror [`~trl.GRPOTrainer`]; ``args`` is a [`CausalDPPOMaskConfig`] (a [`DPPOMaskConfig`] is read for its
    GRPO and trust-region fields only).
    """

    _tag_names = ["trl", "dppo", "divergence-mask"]
    config_class = CausalDPPOMaskConfig
    model_kind = "causal"

    def __init__(self, model, reward_funcs=None, args: CausalDPPOMaskConfig | DPPOMaskConfig | None = None, **kwargs):
        if args is None:
            args = CausalDPPOMaskConfig("dppo-mask-output")
        if not isinstance(args, (CausalDPPOMaskConfig, DPPOMaskConfig)):
            raise TypeError(f"args must be a CausalDPPOMaskConfig, got {type(args).__name__}.")
        refuse_unsupported_kwargs("DPPOMaskTrainer", kwargs)
        if not args.temperature > 0:
            raise ValueError(f"temperature={args.temperature}: causal LMs sample, so it must be > 0.")
        if getattr(args, "rollout_importance_sampling_correction", False):
            raise ValueError("rollout_importance_sampling_correction=True corrects a diffusion rollout's approximate "
                             "KV cache; a causal LM's generate() records μ under an exact cache: leave it False.")
        if isinstance(model, str):
            model = create_model_from_path(model, **dict(args.model_init_kwargs or {}))
        use_vllm = getattr(args, "use_vllm", False)
        if use_vllm:
            import_checked_vllm()
        family = family_of(model)
        if family.kind != "causal" and (not family.trains_as_causal_lm or _attends_bidirectionally(model)):
            vllm_hint = " vLLM rolls out causal LMs only (use_vllm=True is not supported for it)." if use_vllm else ""
            raise ValueError(f"model_kind='causal' but the model is a diffusion LM (family {family.name!r}).{vllm_hint} "
                             "Train it with DPPOMaskTrainer(args=DPPOMaskConfig(...)) (model_kind='auto' or "
                             "'diffusion'), which builds DiffusionDPPOMaskTrainer with the family's sampler and loss.")
        vocab_size = model_vocab_size(model)
        check_top_k(args, vocab_size)
        self.loss = CausalTrustRegionLoss(args, vocab_size, args.temperature)
        with self._engine_rollouts(args) if use_vllm else contextlib.nullcontext():
            reference = init_with_reference(self, super().__init__, model, args, load=create_model_from_path,
                                            reward_funcs=reward_funcs, **kwargs)
        if reference is not None:
            add_fused_lm_head(reference, temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
            self.ref_model = prepare_reference(reference, self.accelerator, self.args.disable_dropout)
        if not use_vllm:
            config = self.generation_config
            if not config.do_sample or (config.num_beams or 1) > 1:
                raise ValueError("DPPOMaskTrainer needs multinomial sampling (do_sample=True, num_beams=1).")
            if getattr(config, "watermarking_config", None) is not None:
                raise ValueError("A watermarking processor would change the sampled distribution after the capture.")
        self._behaviour = None

    @staticmethod
    def _engine_rollouts(args):
        """While TRL's ``__init__`` runs, its vLLM backend is :func:`engine_rollouts_class`'s, asking for the top-K."""
        base = engine_rollouts_class()

        def build(*build_args, **build_kwargs):
            return base(*build_args, behaviour_top_k=args.divergence_top_k,
                        engine_kwargs=getattr(args, "vllm_engine_kwargs", None), **build_kwargs)

        return replaced_attribute(grpo_trainer, "VLLMGeneration", build)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("DPPOMaskTrainer takes text prompts only.")
        if self.use_vllm:
            return self._generate_with_engine(prompt_ids, num_generations)
        capture = BehaviourCapture(self.args.divergence_top_k)
        with appended_logits_processor(unwrap_model(self.model), capture) as hook:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        steps = capture.num_steps
        longest = max((len(ids) for ids in completion_ids), default=0)
        if hook["calls"] != 1 or steps != longest:
            raise RuntimeError(
                f"The behaviour capture saw {hook['calls']} generate() call(s) and {steps} steps for completions of "
                f"up to {longest} tokens; TRL's generation path no longer matches what DPPOMaskTrainer expects."
            )
        device = self.accelerator.device
        last = torch.tensor([ids[steps - 1] if len(ids) == steps else 0 for ids in completion_ids], device=device)
        behaviour = capture.finish(last)
        lengths = torch.tensor([len(ids) for ids in completion_ids], device=device)
        in_completion = torch.arange(steps, device=device)[None, :] < lengths[:, None]
        if torch.isinf(behaviour["behaviour_logps"][in_completion]).any():
            raise RuntimeError("A sampled token has zero probability under the captured distribution: a processor "
                               "changed the scores after the capture.")
        self._behaviour = behaviour
        return completion_ids, logprobs

    def _generate_with_engine(self, prompt_ids, num_generations):
        """TRL's vLLM rollout (weights synced once per step), keeping the engine's top-K as μ. Returns the completions
        and the sampled tokens' log-probs, which TRL stores as ``sampling_per_token_logps``."""
        if self.state.global_step != self._last_loaded_step:
            with profiling_context(self, "sync_weights"):
                self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        _, completion_ids, logprobs, token_ids = self.vllm_generation.generate(
            prompts=prompt_ids, images=None, num_generations=num_generations,
            profiler=profiling_context(self, "vLLM.generate"),
        )
        completion_ids = [list(ids) for ids in completion_ids]
        self._behaviour = engine_behaviour(completion_ids, logprobs, token_ids, self.args.divergence_top_k,
                                           self.accelerator.device)
        sampled = self._behaviour["behaviour_logps"].tolist()
        return completion_ids, [row[:len(ids)] for row, ids in zip(sampled, completion_ids)]

    def _generate_and_score_completions(self, inputs):
        with old_checkpointing_names_quiet():
            output = super()._generate_and_score_completions(inputs)
        behaviour, self._behaviour = self._behaviour, None
        width = output["completion_ids"].shape[1]  # TRL right-pads (and may pad to a multiple): follow it
        for key, fill in zip(BEHAVIOUR_KEYS, (-1, 0.0, 0.0)):
            output[key] = _fit_width(behaviour[key], width, fill)
        if self.use_vllm:
            self._log_engine_mismatch(output)
        return output

    def _log_engine_mismatch(self, output):
        """``sampling/*`` (:func:`~dllm_trl.losses.rollout_mismatch.mismatch_metrics`): the engine's log μ(a) against
        the trainer's log π_old(a) of the same tokens (TRL's old-policy scoring, logits / T)."""
        old_logps = output.get("old_per_token_logps")
        if old_logps is None:
            prompt_completion = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            with torch.no_grad(), old_checkpointing_names_quiet():
                old_logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, prompt_completion, attention_mask, output["completion_ids"].shape[1],
                    batch_size=self.args.per_device_train_batch_size,
                )
        scored = output["completion_mask"].bool().unsqueeze(1)
        sums, extremes = mismatch_metrics(old_logps.unsqueeze(1), output["behaviour_logps"], scored)
        mode = "train" if self.model.training else "eval"
        log_metric_sums(self, mode, sums)
        log_metric_extremes(self, mode, extremes)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        loss, sums = self.loss.compute(
            model, inputs, beta=self.beta, loss_type=self.loss_type,
            accumulation=self.current_gradient_accumulation_steps if mode == "train" else 1.0,
            num_processes=self.accelerator.num_processes, steps_per_generation=self.args.steps_per_generation,
            max_completion_length=self.max_completion_length, training=mode == "train",
            autocast=self.accelerator.autocast,
        )
        log_metric_sums(self, mode, sums)
        return loss


def DPPOMaskTrainer(model, reward_funcs=None, args: DPPOMaskConfig | CausalDPPOMaskConfig | None = None, **kwargs):
    """GRPO-style training with the (predictive) divergence trust-region mask of SPEC §3, for either model kind: builds
    and returns the trainer of the model's kind — :class:`DiffusionDPPOMaskTrainer` or :class:`CausalDPPOMaskTrainer`
    (``trainer.model_kind`` says which). A factory function, as ``AutoModel`` is a factory of models.

    Args mirror [`~trl.GRPOTrainer`]. ``model`` is a causal LM or a diffusion LM (see
    [`~dllm_trl.load_diffusion_model`]), an object or a name/path; ``args.model_kind`` says which (``"auto"``: the kind
    of the model's family, :mod:`dllm_trl.families`). A [`CausalDPPOMaskConfig`] always builds the causal trainer.
    """
    if args is None:
        args = DPPOMaskConfig("dppo-mask-output")
    if isinstance(args, CausalDPPOMaskConfig):
        return CausalDPPOMaskTrainer(model, reward_funcs=reward_funcs, args=args, **kwargs)
    if not isinstance(args, DPPOMaskConfig):
        raise TypeError(f"args must be a DPPOMaskConfig or CausalDPPOMaskConfig, got {type(args).__name__}.")
    if isinstance(model, str):
        model = _load_model(model, args)
    kind = detect_model_kind(model) if args.model_kind == "auto" else args.model_kind
    trainer_class = DiffusionDPPOMaskTrainer if kind == "diffusion" else CausalDPPOMaskTrainer
    return trainer_class(model, reward_funcs=reward_funcs, args=args, **kwargs)


DPPO_MASK_TRAINERS = (DiffusionDPPOMaskTrainer, CausalDPPOMaskTrainer)
"""The classes :func:`DPPOMaskTrainer` builds: ``isinstance(trainer, DPPO_MASK_TRAINERS)``."""
