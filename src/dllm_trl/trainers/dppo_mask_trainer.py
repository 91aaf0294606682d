"""DPPOMaskTrainer: the (predictive) divergence trust-region mask of SPEC §3 for causal and diffusion LMs.

Loss (SPEC §3, paper Eq. 13): ``−Σ M · w · A · log π_θ(a)`` with the truncated importance weight
``w = stopgrad(min(π_θ(a)/μ(a), C))`` and the keep-mask ``M = NOT(D(μ‖π_θ) > δ AND direction)``, plus
``β`` · k3-KL to the reference. ``μ`` is the behaviour distribution, kept as its top-K plus ``μ(a)``; the mask
math is :mod:`dllm_trl.losses.divergence_masks`. What this module adds is where ``μ`` and ``π_θ`` come from:

* **causal LMs** (the paper's setting). Generation is TRL's own (``GRPOTrainer._generate_single_turn``); a
  :class:`BehaviourCapture` logits processor is appended *last* to the list ``generate()`` builds — after
  temperature / top-k / top-p — so it sees exactly the distribution the token is drawn from. It keeps its
  top-K per step and reads ``μ(a)`` of the sampled token at the next step (one ``(B, V)`` tensor alive). The
  tensors travel in TRL's batch dict aligned with ``completion_ids``. The loss runs the model once, takes
  ``log_softmax(logits / T)`` at the completion positions and gathers it at ``S = topK(μ) ∪ {a}``.
* **masked diffusion LMs**. RLDF rollouts (``record_topk = K``), sampled states ``o_t`` and clean targets
  ``Ô_t`` (:class:`RLDFTrainer`). Tokens committed at the sampled step take ``μ`` from the rollout record (what
  the sampler drew them from, KV-cache approximation included), the other targets from ``π_old(· | q, o_t)``
  (top-K stored by the no-grad old-policy pass TRL runs after generation, or the current policy itself when the
  batch is on-policy). ``behaviour_source="old"`` takes every ``μ`` from ``π_old``. ``π_θ`` in the mask, the
  importance weight and the policy gradient is the sampler's distribution (logits / temperature, mask token
  excluded), so that it compares like with like against ``μ``; targets ``Ô_t``, their normalisation, the
  per-step backward and the k3-KL to the reference are RLDF's own (:meth:`RLDFTrainer._compute_loss`, whose
  per-step term :meth:`_step_loss` is overridden here).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from transformers import LogitsProcessor
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, create_model_from_path

from ..losses.divergence_masks import (
    directional_derivative,
    divergence,
    masked_policy_gradient_terms,
    support_log_probs,
    trust_region_mask,
    truncated_view,
)
from ..losses.rldf import INVALID_STEP, k3_kl, noisy_state
from ..models.bidirectional import diffusion_block_size, diffusion_config, is_bidirectional
from ..models.engines import vocab_size as model_vocab_size
from ..models.loading import checkpoint_family, load_diffusion_model, read_raw_config
from ..models.engines import apply_at
from ..models.scoring import state_canvas
from .dppo_mask_config import DPPOMaskConfig
from .rldf_trainer import RLDFTrainer, _old_checkpointing_names_quiet, _state_candidates, init_with_reference

BEHAVIOUR_KEYS = ("behaviour_topk_ids", "behaviour_topk_logps", "behaviour_logps")
"""Batch keys of the causal path: μ top-K ids / log-probs (B, C, K) and μ(a) (B, C), aligned with completion_ids."""
OLD_BEHAVIOUR_KEYS = ("old_topk_ids", "old_topk_logps", "old_behaviour_logps")
"""Batch keys of the diffusion path: π_old's top-K (B, k, G, K) and π_old(a) (B, k, G) at the sampled states."""


# ------------------------------------------------------------------------------------------------ model kind
def detect_model_kind(model) -> str:
    """``"diffusion"`` for a model carrying the diffusion properties (``config.mask_token_id`` plus the marks
    :func:`~dllm_trl.models.set_diffusion_properties` leaves), ``"causal"`` otherwise."""
    config = getattr(model, "config", None)
    if getattr(config, "mask_token_id", None) is None:
        return "causal"
    if hasattr(config, "diffusion_logit_shift"):
        return "diffusion"
    try:
        return "diffusion" if is_bidirectional(model) else "causal"
    except TypeError:
        return "causal"


def _load_model(name_or_path: str, args: DPPOMaskConfig):
    init_kwargs = dict(args.model_init_kwargs or {})
    kind = args.model_kind
    if kind == "auto":
        hub = {k: init_kwargs[k] for k in ("revision", "token", "cache_dir") if k in init_kwargs}
        raw = read_raw_config(name_or_path, **hub)
        marked = raw.get("mask_token_id") is not None and "diffusion_logit_shift" in raw
        kind = "diffusion" if checkpoint_family(raw) != "causal" or marked else "causal"
    if kind == "diffusion":
        return load_diffusion_model(name_or_path, **init_kwargs)
    return create_model_from_path(name_or_path, **init_kwargs)


# ---------------------------------------------------------------------------------------- behaviour capture
class BehaviourCapture(LogitsProcessor):
    """Record the distribution each generated token is drawn from: its top-K and ``μ(a)`` of the sampled token.

    Must run *last* in the processor list (see :func:`appended_logits_processor`) so that the scores it sees are
    the ones ``generate()`` samples from. It returns the scores unchanged. ``μ(a)`` of step ``s`` is read at step
    ``s + 1`` from ``input_ids[:, -1]`` (and from ``last_tokens`` in :meth:`finish`), so only one ``(B, V)``
    log-softmax is kept alive.
    """

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.reset()

    def reset(self):
        self._previous = None
        self._topk_ids, self._topk_logps, self._action_logps = [], [], []

    @property
    def num_steps(self) -> int:
        return len(self._topk_logps)

    def _read_action(self, tokens: torch.Tensor):
        if self._previous is not None:
            tokens = tokens.to(self._previous.device).long().view(-1, 1)
            self._action_logps.append(self._previous.gather(-1, tokens).squeeze(-1))
            self._previous = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logps = torch.log_softmax(scores.float(), dim=-1)
        self._read_action(input_ids[:, -1])
        values, ids = logps.topk(self.top_k, dim=-1)
        self._topk_ids.append(ids)
        self._topk_logps.append(values)
        self._previous = logps
        return scores

    def finish(self, last_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flush the last step with the tokens sampled there; ``(B, T, K)`` ids / log-probs and ``(B, T)`` μ(a)."""
        self._read_action(last_tokens)
        if not self._topk_logps:
            raise RuntimeError("BehaviourCapture saw no generation step.")
        out = {
            "behaviour_topk_ids": torch.stack(self._topk_ids, dim=1),
            "behaviour_topk_logps": torch.stack(self._topk_logps, dim=1),
            "behaviour_logps": torch.stack(self._action_logps, dim=1),
        }
        self.reset()
        return out


@contextlib.contextmanager
def appended_logits_processor(model, processor: LogitsProcessor):
    """Within the context, every ``model.generate()`` call appends ``processor`` at the very end of the logits
    processor list it builds — after the sampling warpers (temperature, top-k, top-p, min-p …), which
    ``generate()`` puts *after* any user-supplied ``logits_processor``. Yields a dict counting the calls.

    ``model`` may be a PEFT model (the hook goes on its base transformers model).
    """
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = vars(target).get("_get_logits_processor")
    original = target._get_logits_processor
    state = {"calls": 0}

    def build(*args, **kwargs):
        processors = original(*args, **kwargs)
        processors.append(processor)
        state["calls"] += 1
        return processors

    target._get_logits_processor = build
    try:
        yield state
    finally:
        if own is None:
            del target._get_logits_processor
        else:
            target._get_logits_processor = own


def _fit_width(x: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Crop or right-pad dim 1 of ``x`` to ``width``."""
    if x.shape[1] >= width:
        return x[:, :width]
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, pad], dim=1)


class DPPOMaskTrainer(RLDFTrainer):
    """GRPO-style trainer with the (predictive) divergence trust-region mask of SPEC §3.

    Args mirror [`~trl.GRPOTrainer`]. ``model`` is a causal LM or a diffusion LM (see
    [`~dllm_trl.load_diffusion_model`]), an object or a name/path; ``args.model_kind`` says which ("auto"
    detects it, see :func:`detect_model_kind`). ``self.model_kind`` holds the result.
    """

    _tag_names = ["trl", "dppo", "divergence-mask"]
    config_class = DPPOMaskConfig

    def __init__(self, model, reward_funcs=None, args: DPPOMaskConfig | None = None, **kwargs):
        if args is None:
            args = DPPOMaskConfig("dppo-mask-output")
        if not isinstance(args, DPPOMaskConfig):
            raise TypeError(f"args must be a DPPOMaskConfig, got {type(args).__name__}.")
        if isinstance(model, str):
            model = _load_model(model, args)
        kind = detect_model_kind(model) if args.model_kind == "auto" else args.model_kind
        if kind == "causal" and getattr(getattr(model, "config", None), "mask_token_id", None) is not None:
            try:
                if is_bidirectional(model):
                    raise ValueError("model_kind='causal' but the model attends bidirectionally (a diffusion LM).")
            except TypeError:
                pass
        vocab_size = model_vocab_size(model)
        usable = vocab_size - (1 if kind == "diffusion" else 0)  # diffusion samplers never draw the mask token
        if args.divergence_top_k > usable:
            raise ValueError(
                f"divergence_top_k={args.divergence_top_k} exceeds the {usable} tokens the policy can sample; "
                "lower it."
            )
        self.model_kind = kind
        self._dppo_records = None  # set to a list to keep the per-token mask tensors of every loss call
        self._behaviour = None
        self._old_pass_pending = False
        self._step_buffers = None
        if kind == "diffusion":
            if args.loss_type != "dapo":
                raise ValueError(
                    f"loss_type={args.loss_type!r} applies to causal LMs; on a diffusion LM the terms are aggregated "
                    "with loss_normalization ('token' ≈ 'dapo', 'sample' ≈ 'grpo'): set that instead."
                )
            super().__init__(model, reward_funcs=reward_funcs, args=args, **kwargs)
            config = diffusion_config(model)
            self._mask_token_id = config.mask_token_id
            self._logit_shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
        else:
            self._init_causal(model, reward_funcs, args, **kwargs)
        self.model_kind = kind
        self._vocab_size = usable  # sampleable tokens: the uniform-tail estimator spreads the tail over them
        # The sampler draws from softmax(logits / T) (plain softmax at T = 0): score π_θ the same way.
        self._score_temperature = self.temperature if self.temperature > 0 else 1.0

    def _init_causal(self, model, reward_funcs, args, **kwargs):
        for unsupported in ("tools", "rollout_func", "environment_factory"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"{unsupported}= is not supported by DPPOMaskTrainer.")
        if not args.temperature > 0:
            raise ValueError(f"temperature={args.temperature}: causal LMs sample, so it must be > 0.")
        reference = init_with_reference(
            self, partial(GRPOTrainer.__init__, self), model, args, load=create_model_from_path,
            reward_funcs=reward_funcs, **kwargs,
        )
        if reference is not None:
            add_fused_lm_head(reference, temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
            self.ref_model = self._prepare_reference(reference)
        config = self.generation_config
        if not config.do_sample or (config.num_beams or 1) > 1:
            raise ValueError("DPPOMaskTrainer needs multinomial sampling (do_sample=True, num_beams=1).")
        if getattr(config, "watermarking_config", None) is not None:
            raise ValueError("A watermarking processor would change the sampled distribution after the capture.")
        # Unused on this path (TRL generates), but RLDFTrainer's checkpoint methods save and restore them.
        self._rollout_generator = torch.Generator(device=self.accelerator.device)
        self._rollout_generator.manual_seed(args.seed + 1000003 * self.accelerator.process_index)
        self._mask_seed_generator = torch.Generator()
        self._mask_seed_generator.manual_seed(args.seed + 1000003 * self.accelerator.process_index)
        self._rollout = None

    # ------------------------------------------------------------------------------------------------ rollout
    def _old_logps_needed(self) -> bool:
        """Whether TRL's ``_generate_and_score_completions`` runs an old-policy pass (same test as TRL's)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.model_kind == "diffusion":
            self._old_pass_pending = self._old_logps_needed()
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if images is not None or multimodal_fields:
            raise ValueError("DPPOMaskTrainer takes text prompts only.")
        capture = BehaviourCapture(self.args.divergence_top_k)
        policy = self.accelerator.unwrap_model(self.model)
        with appended_logits_processor(policy, capture) as hook:
            completion_ids, logprobs = GRPOTrainer._generate_single_turn(
                self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images
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

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        """Causal LMs: TRL's own. Diffusion LMs: RLDF's (B, k, G) log-probs at the sampled states; the old-policy
        pass also stores π_old's sampler-consistent top-K and μ(a) there, from the same forward (SPEC §3.3)."""
        if self.model_kind != "diffusion":
            return GRPOTrainer._get_per_token_logps_and_entropies(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs
            )
        old_pass, self._old_pass_pending = self._old_pass_pending, False
        if not old_pass:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size)
        if self._rollout is None:
            raise RuntimeError("No rollout to score: _generate_single_turn must run first.")
        with torch.no_grad():
            scores = self._score_sampled_states(model, self._rollout, batch_size=batch_size)
        logps = scores.pop("logps")
        self._rollout.update(scores)
        return logps, None, None

    def _support_at(self, model, batch, rows, j, positions, support_ids, own_topk=0, use_own=None):
        """:func:`~dllm_trl.losses.divergence_masks.support_log_probs` of ``π(· | q, o_t)`` (state ``j`` of the batch's
        ``rows``) at completion ``positions = (row index into rows, column)``: the sampler's distribution (logits / T,
        mask token never drawn) at ``[support_ids..., a]``, computed only there and chunk by chunk."""
        state = noisy_state(batch["rollout_ids"][rows], batch["commit_step"][rows], batch["sampled_steps"][rows, j],
                            self._mask_token_id)
        input_ids, attention_mask, prompt_width = state_canvas(
            diffusion_config(model), batch["rollout_prompt_ids"][rows], batch["rollout_prompt_mask"][rows], state,
            self._logit_shift,
        )
        index, columns = positions
        action = batch["rollout_ids"][rows][index, columns]

        def view(hidden, head):
            return support_log_probs(hidden, head, support_ids, action, temperature=self._score_temperature,
                                     excluded_id=self._mask_token_id, own_topk=own_topk, use_own=use_own)

        offset = prompt_width - self._logit_shift
        return apply_at(model, index, columns + offset, view, input_ids=input_ids, attention_mask=attention_mask,
                        use_cache=False)

    def _score_sampled_states(self, model, batch, batch_size=None):
        """No-grad old-policy pass over every sampled ``o_t``, at the positions a loss term can read: RLDF's
        ``logps`` (B, k, G) and, sampler-consistent, the top-K (``old_topk_ids`` int32 / ``old_topk_logps``,
        (B, k, G, K)) and ``old_behaviour_logps`` (B, k, G). Zeros (ids −1) elsewhere."""
        sampled = batch["sampled_steps"]
        rows, k = sampled.shape
        gen, device = batch["rollout_ids"].shape[1], sampled.device
        top_k = self.args.divergence_top_k
        out = {
            "logps": torch.zeros(rows, k, gen, device=device),
            "old_topk_ids": torch.full((rows, k, gen, top_k), -1, dtype=torch.int32, device=device),
            "old_topk_logps": torch.zeros(rows, k, gen, top_k, device=device),
            "old_behaviour_logps": torch.zeros(rows, k, gen, device=device),
        }
        chunk = batch_size or rows
        for j in range(k):
            active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
            for part in active.split(chunk) if active.numel() else ():
                index, columns = _state_candidates(batch, part, j, self.args, diffusion_block_size(model)).nonzero(as_tuple=True)
                n = index.numel()
                view = self._support_at(
                    model, batch, part, j, (index, columns), torch.zeros(n, top_k, dtype=torch.long, device=device),
                    own_topk=top_k, use_own=torch.ones(n, dtype=torch.bool, device=device),
                )
                at = (part[index], j, columns)
                out["logps"][at] = view.raw_action
                out["old_topk_ids"][at] = view.own_ids.to(torch.int32)
                out["old_topk_logps"][at] = view.own_logps
                out["old_behaviour_logps"][at] = view.support[:, -1]
        return out

    def _generate_and_score_completions(self, inputs):
        if self.model_kind == "diffusion":
            output = super()._generate_and_score_completions(inputs)
            self._old_pass_pending = False
            if "rollout_topk_ids" not in output:
                raise RuntimeError("The batch lacks the rollout's top-K record: RLDFTrainer._generate_single_turn must "
                                   "store output.topk_ids / topk_logps / commit_prob when record_topk > 0.")
            if ("old_per_token_logps" in output) != ("old_topk_ids" in output):
                raise RuntimeError(
                    "TRL's old-policy pass did not happen where DPPOMaskTrainer expected it (see _old_logps_needed)."
                )
            return output
        with _old_checkpointing_names_quiet():
            output = GRPOTrainer._generate_and_score_completions(self, inputs)
        behaviour, self._behaviour = self._behaviour, None
        width = output["completion_ids"].shape[1]  # TRL right-pads (and may pad to a multiple): follow it
        for key, fill in zip(BEHAVIOUR_KEYS, (-1, 0.0, 0.0)):
            output[key] = _fit_width(behaviour[key], width, fill)
        return output

    # --------------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        if self.model_kind == "diffusion":
            return self._compute_diffusion_loss(model, inputs)
        return self._compute_causal_loss(model, inputs)

    def _masked_terms(self, pi_support, mu_ids, mu_logps, action, mu_action_logps, advantages, vocab_size):
        """Per-token ``−M · w · A · log π_θ(a)`` and the detached mask quantities (SPEC §3).

        ``pi_support`` (…, K+1): log π_θ at ``[topK(μ) ids, a]`` (with gradient; slot K is log π_θ(a)).
        """
        args = self.args
        mu_action_logps = mu_action_logps.detach().float()
        view = truncated_view(
            mu_ids, mu_logps.detach(), action, mu_action_logps, pi_support.detach(),
            vocab_size=vocab_size, binary=mu_ids.shape[-1] == 0,
        )
        div = divergence(view, args.divergence)
        direction = directional_derivative(view, args.divergence, args.tail_estimator)
        log_ratio = pi_support[..., -1].detach().float() - mu_action_logps
        keep = trust_region_mask(
            args.mask_rule,
            advantages=advantages,
            log_ratio=log_ratio,
            div=div,
            direction=direction,
            delta=args.divergence_threshold,
            delta_low=args.divergence_threshold_low,
            delta_high=args.divergence_threshold_high,
        )
        terms, weights = masked_policy_gradient_terms(pi_support[..., -1], mu_action_logps, advantages, keep, args.is_cap)
        parts = {"keep": keep, "div": div, "direction": direction, "log_ratio": log_ratio, "weights": weights}
        return terms, parts

    def _record(self, loss_mask, **tensors):
        if self._dppo_records is None:
            return
        m = loss_mask.bool()
        self._dppo_records.append({name: value.detach()[m].cpu() for name, value in tensors.items()})

    def _log_mask_metrics(self, mode, loss_mask, advantages, keep, div, direction, log_ratio, weights, from_rollout):
        m = loss_mask.bool()
        masked = ~keep & m
        pos, neg = m & (advantages > 0), m & (advantages < 0)
        disagree = (torch.sign(direction) != torch.sign(log_ratio)) & m
        # Where the choice of direction changes the decision: outside the trust region, and the two disagree.
        args = self.args
        low = args.divergence_threshold if args.divergence_threshold_low is None else args.divergence_threshold_low
        high = args.divergence_threshold if args.divergence_threshold_high is None else args.divergence_threshold_high
        outside = div > torch.where(advantages > 0, high, low)
        decisions_differ = outside & ((advantages * direction > 0) != (advantages * torch.sign(log_ratio) > 0)) & m
        zero = torch.zeros((), device=m.device)
        stats = torch.stack([
            m.sum().float(),
            masked.sum().float(),
            pos.sum().float(),
            (masked & pos).sum().float(),
            neg.sum().float(),
            (masked & neg).sum().float(),
            torch.where(m, div.float(), zero).sum(),
            disagree.sum().float(),
            torch.where(m, weights.float(), zero).sum(),
            (from_rollout & m).sum().float(),
            decisions_differ.sum().float(),
        ])
        stats = self.accelerator.reduce(stats, reduction="sum")
        n = stats[0].clamp_min(1)
        metrics = self._metrics[mode]
        metrics["dppo/masked_frac"].append((stats[1] / n).item())
        metrics["dppo/masked_frac_pos"].append((stats[3] / stats[2].clamp_min(1)).item())
        metrics["dppo/masked_frac_neg"].append((stats[5] / stats[4].clamp_min(1)).item())
        metrics["dppo/divergence_mean"].append((stats[6] / n).item())
        metrics["dppo/direction_disagree_frac"].append((stats[7] / n).item())
        metrics["dppo/is_weight_mean"].append((stats[8] / n).item())
        metrics["dppo/mu_from_rollout"].append((stats[9] / n).item())
        metrics["dppo/mu_from_old"].append(((stats[0] - stats[9]) / n).item())
        metrics["dppo/mask_disagree_frac"].append((stats[10] / n).item())

    # ------------------------------------------------------------------------------------------ causal LMs
    def _compute_causal_loss(self, model, inputs):
        args = self.args
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        loss_mask = mask.bool()
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        top_k = args.divergence_top_k
        mu_ids = inputs["behaviour_topk_ids"][..., :top_k].long()
        mu_logps = inputs["behaviour_topk_logps"][..., :top_k]
        mu_action = inputs["behaviour_logps"]
        # π_θ at the sampling temperature (TRL's convention, also of the ref/old passes), at the completion's tokens
        # only and chunk by chunk: memory grows with tokens × K, not tokens × V.
        rows, columns = loss_mask.nonzero(as_tuple=True)

        def view(hidden, head):
            return support_log_probs(hidden, head, mu_ids[rows, columns], completion_ids[rows, columns],
                                     temperature=self._score_temperature)

        with self.accelerator.autocast():
            support = apply_at(model, rows, columns + prompt_ids.shape[1] - 1, view, input_ids=input_ids,
                               attention_mask=attention_mask, use_cache=False).support
        pi_support = support.new_zeros(*mu_ids.shape[:-1], top_k + 1).index_put((rows, columns), support)
        vocab_size = self._vocab_size
        advantages = inputs["advantages"]
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(mu_action)
        terms, parts = self._masked_terms(pi_support, mu_ids, mu_logps, completion_ids, mu_action, advantages, vocab_size)
        logps = pi_support[..., -1]
        if self.beta != 0.0:
            per_token_kl = k3_kl(logps, inputs["ref_per_token_logps"])
            if args.use_bias_correction_kl:  # as TRL: k3 weighted by π_θ/π_old (with gradient)
                old = inputs.get("old_per_token_logps")
                per_token_kl = per_token_kl * torch.exp(logps - (logps.detach() if old is None else old))
            terms = terms + self.beta * per_token_kl
        terms = torch.where(loss_mask, terms, 0.0)
        loss = self._aggregate_causal(terms, mask, inputs, mode)

        if self.beta != 0.0:
            kl_stats = torch.stack([torch.where(loss_mask, per_token_kl.detach(), 0.0).sum(), mask.sum().float()])
            kl_stats = self.accelerator.reduce(kl_stats, reduction="sum")
            self._metrics[mode]["kl"].append((kl_stats[0] / kl_stats[1].clamp_min(1)).item())
        from_rollout = torch.ones_like(loss_mask)
        self._log_mask_metrics(mode, loss_mask, advantages, from_rollout=from_rollout, **parts)
        self._record(
            loss_mask, mu_ids=mu_ids, mu_logps=mu_logps, mu_action_logps=mu_action, pi_support=pi_support,
            action=completion_ids, advantages=advantages, from_rollout=from_rollout, **parts,
        )
        return loss

    def _aggregate_causal(self, per_token_loss, mask, inputs, mode):
        """TRL's ``loss_type`` normalisers (grpo / bnpo / dr_grpo / dapo), gradient accumulation included."""
        mask = mask.float()
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":
            return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if self.loss_type == "bnpo":
            return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.loss_type == "dr_grpo":
            return (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length) / accumulation
        if self.loss_type == "dapo":
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return (per_token_loss * mask).sum() / normalizer
        raise ValueError(f"Unknown loss type: {self.loss_type}")

    # ---------------------------------------------------------------------------------------- diffusion LMs
    def _compute_diffusion_loss(self, model, inputs):
        """RLDF's loop (one forward and backward per sampled step, its targets Ô_t and normalisation) with the
        masked policy gradient of :meth:`_step_loss`."""
        shape = inputs["target_mask"].shape
        device = inputs["target_mask"].device
        self._step_buffers = {
            "keep": torch.ones(shape, dtype=torch.bool, device=device),
            "div": torch.zeros(shape, device=device),
            "direction": torch.zeros(shape, device=device),
            "log_ratio": torch.zeros(shape, device=device),
            "weights": torch.ones(shape, device=device),
            "from_rollout": torch.zeros(shape, dtype=torch.bool, device=device),
        }
        try:
            loss = super()._compute_loss(model, inputs)
            mode = "train" if self.model.training else "eval"
            advantages = inputs["advantages"].view(-1, 1, 1).expand(shape)
            self._log_mask_metrics(mode, inputs["target_mask"], advantages, **self._step_buffers)
        finally:
            self._step_buffers = None
        return loss

    def _step_loss(self, model, inputs, j, normalizer, kl, ratio_all):
        """Weighted sum over the rows that have sampled step ``j`` of the masked terms at its targets Ô_t.

        μ of a target committed at ``t`` is the rollout record (``behaviour_source="rollout"``), else π_old's top-K
        at ``o_t``: from the old-policy pass, or — on-policy batches, where π_old is the current policy — from this
        very forward (detached). Only the targets go through the LM head.
        """
        if self.model_kind != "diffusion":
            raise RuntimeError("_step_loss is the diffusion path's.")
        args = self.args
        top_k = args.divergence_top_k
        sampled = inputs["sampled_steps"]
        active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
        index, columns = inputs["target_mask"][active, j].nonzero(as_tuple=True)
        rows = active[index]
        t = sampled[rows, j]
        action = inputs["rollout_ids"][rows, columns]
        from_rollout = (inputs["commit_step"][rows, columns] == t) & (args.behaviour_source == "rollout")
        roll_ids = inputs["rollout_topk_ids"][rows, columns, :top_k]
        roll_logps = inputs["rollout_topk_logps"][rows, columns, :top_k]
        roll_action = inputs["rollout_commit_prob"][rows, columns].float().clamp_min(1e-30).log()
        has_old = "old_topk_ids" in inputs
        if has_old:
            other_ids = inputs["old_topk_ids"][rows, j, columns].long()
            other_logps = inputs["old_topk_logps"][rows, j, columns]
        else:  # on-policy: π_old's top-K is this forward's own
            other_ids = torch.zeros_like(roll_ids)
        view = self._support_at(
            model, inputs, active, j, (index, columns), torch.where(from_rollout.unsqueeze(-1), roll_ids, other_ids),
            own_topk=0 if has_old else top_k, use_own=None if has_old else ~from_rollout,
        )
        pi_support = view.support
        logps = pi_support[..., -1]
        if not has_old:
            other_ids, other_logps = view.own_ids, view.own_logps
        keep_rollout = from_rollout.unsqueeze(-1)
        mu_ids = torch.where(keep_rollout, roll_ids, other_ids)
        mu_logps = torch.where(keep_rollout, roll_logps, other_logps)
        other_action = inputs["old_behaviour_logps"][rows, j, columns] if has_old else logps.detach()
        mu_action = torch.where(from_rollout, roll_action, other_action)
        advantages = inputs["advantages"][rows]
        terms, parts = self._masked_terms(pi_support, mu_ids, mu_logps, action, mu_action, advantages, self._vocab_size)
        if self.beta != 0.0:
            step_kl = k3_kl(view.raw_action, inputs["ref_per_token_logps"][rows, j, columns])
            if args.use_bias_correction_kl:  # as TRL: k3 weighted by π_θ/π_old (with gradient)
                old = inputs["old_per_token_logps"][rows, j, columns] if has_old else view.raw_action.detach()
                step_kl = step_kl * torch.exp(view.raw_action - old)
            terms = terms + self.beta * step_kl
            kl[rows, j, columns] = step_kl.detach()
        parts["from_rollout"] = from_rollout
        if self._step_buffers is not None:
            for name, value in parts.items():
                self._step_buffers[name][rows, j, columns] = value.detach().to(self._step_buffers[name].dtype)
        self._record(
            torch.ones_like(from_rollout), mu_ids=mu_ids, mu_logps=mu_logps, mu_action_logps=mu_action,
            pi_support=pi_support, action=action, advantages=advantages, **parts,
        )
        return (terms * normalizer[rows, j]).sum()
