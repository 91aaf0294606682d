"""RLDFTrainer: TRL's GRPOTrainer with diffusion rollouts and the RLDF loss (paper 1, SPEC §2).

What changes against ``GRPOTrainer`` (everything else — datasets, rewards, advantages, batching,
logging, PEFT, distributed — is TRL's own):

* ``_generate_single_turn``: block-wise diffusion decoding that records the trajectory; the loss's timesteps
  are sampled right after the rollout (Alg. 2).
* ``_get_per_token_logps_and_entropies``: log-probs at the sampled noisy states ``o_t`` (B, k, G), so TRL's
  own reference / old-policy passes (reference model, or PEFT adapter disabled) score the right states.
* ``_generate_and_score_completions``: attaches the trajectory tensors to the batch, so TRL's splitting and
  shuffling keep each row aligned with its trajectory.
* ``_compute_loss``: the RLDF loss (Alg. 3, Eq. 7–10), one sampled step at a time.

``args.policy_estimator`` swaps the states / targets / weights for the baselines of paper 1 App. A (SPEC §2.4,
:mod:`dllm_trl.losses.estimators`); ``sampled_steps`` then holds state ids, and every random mask derives from the
row's ``mask_seed`` carried in the batch.

Block-diffusion models (``config.diffusion_block_size``, SPEC §7): the targets of a state are its block's, and every
scoring pass scores the sampled states of a completion in one packed forward (:mod:`dllm_trl.losses.packed_states`;
``_loss_chunks`` / ``_chunk_loss`` / ``_packed_state_logps``), with one backward per chunk of states.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings

import torch
from transformers import PreTrainedModel
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.utils import disable_dropout_in_model, pad

from ..generation.sampler import check_block_decoding, diffusion_generate
from ..losses.estimators import (
    TRAJECTORY_ESTIMATORS,
    estimator_candidates,
    estimator_state,
    estimator_steps,
    estimator_targets,
)
from ..losses.packed_states import pack_sampled_states, packed_read_positions, states_per_forward
from ..losses.rldf import (
    INVALID_STEP,
    clean_target_mask,
    k3_kl,
    policy_token_terms,
    sample_timesteps,
    step_uncertainty,
)
from ..models.bidirectional import (
    attention_mask_dtype,
    diffusion_block_size,
    diffusion_config,
    eos_token_ids,
    make_bidirectional,
)
from ..models.engines import (
    backward_syncs_every_call,
    backward_without_step,
    broadcast_from_main,
    check_launch,
    check_weights_pass_gradients,
    gradients_accessible,
    is_partitioned,
    keep_buffers_out_of_ddp,
    paused_gradient_sync,
    unwrap_model,
)
from ..models.loading import load_diffusion_model
from ..models.scoring import chunked_token_logps_at, completion_token_logps
from .rldf_config import RLDFConfig

TRAJECTORY_KEYS = ("rollout_prompt_ids", "rollout_prompt_mask", "rollout_ids", "commit_step", "valid_mask", "sampled_steps")
MASK_SEED_OFFSET = 7919
"""The generator of the rows' ``mask_seed`` is seeded ``args.seed + MASK_SEED_OFFSET`` (+ a per-process offset)."""


def _state_inputs(batch, rows, j, mask_token_id, args):
    """``(prompt_ids, prompt_mask, completion state)`` of state ``j`` of the given rows under ``args.policy_estimator``
    (the sampled ``o_t`` for RLDF, see :func:`~dllm_trl.losses.estimators.estimator_state`)."""
    seed = batch.get("mask_seed")
    prompt_ids, state = estimator_state(
        args.policy_estimator,
        rollout_ids=batch["rollout_ids"][rows],
        commit_step=batch["commit_step"][rows],
        valid_mask=batch["valid_mask"][rows],
        step=batch["sampled_steps"][rows, j],
        prompt_ids=batch["rollout_prompt_ids"][rows],
        prompt_mask=batch["rollout_prompt_mask"][rows],
        mask_token_id=mask_token_id,
        mask_seed=None if seed is None else seed[rows],
        prompt_mask_prob=args.prompt_mask_prob,
    )
    return prompt_ids, batch["rollout_prompt_mask"][rows], state


def reference_copy(model, load=None):
    """A frozen copy of the policy as it is now, before PEFT wraps it.

    A deep copy, except when DeepSpeed ZeRO-3 partitioned the weights at load (``zero3_init_flag``): no process holds
    them whole, so the reference is loaded again from the policy's checkpoint (partitioned the same way) by
    ``load(path, **from_pretrained_kwargs)`` — :func:`~dllm_trl.load_diffusion_model` by default.
    """
    if not is_partitioned(model):
        return copy.deepcopy(model)
    base = unwrap_model(model)
    path = getattr(base, "name_or_path", "") or ""
    if not path:
        raise ValueError(
            "DeepSpeed ZeRO-3 partitioned the policy's weights at load (zero3_init_flag: true) and the model has no "
            "checkpoint path to load the KL reference from. Pass `model=` as a checkpoint path (or a model loaded with "
            "`load_diffusion_model(path)`), set `beta=0.0`, or set `zero3_init_flag: false` in the accelerate config."
        )
    config = base.config
    from_pretrained_kwargs = dict(dtype=base.dtype, attn_implementation=config._attn_implementation)
    if load is None:
        return load_diffusion_model(
            path, mask_token_id=config.mask_token_id, logit_shift=getattr(config, "diffusion_logit_shift", False),
            sampling=getattr(config, "diffusion_sampling", None), block_size=diffusion_block_size(config),
            **from_pretrained_kwargs,
        )
    return load(path, **from_pretrained_kwargs)


def check_training_inputs(model, train_dataset, tokenizer) -> None:
    """Clear errors, up front, for inputs TRL would fail on deep inside (or silently train nothing with)."""
    if train_dataset is not None and hasattr(train_dataset, "__len__"):
        if len(train_dataset) == 0:
            raise ValueError("train_dataset is empty: there is nothing to train on.")
        columns = getattr(train_dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(
                f"train_dataset has no 'prompt' column (it has {columns}): rename the column that holds the prompts, "
                "e.g. dataset.rename_column('question', 'prompt'), or load it with dllm_trl.data.load_task_dataset."
            )
    tokenizer_mask = getattr(tokenizer, "mask_token_id", None)
    model_mask = getattr(getattr(model, "config", None), "mask_token_id", None)
    if tokenizer_mask is not None and model_mask is not None and tokenizer_mask != model_mask:
        raise ValueError(
            f"The tokenizer's mask token (id {tokenizer_mask}) is not the model's (config.mask_token_id={model_mask}): "
            "the model would be trained on a token it was never pre-trained to fill. Pass the checkpoint's tokenizer, or "
            "load the model with load_diffusion_model(..., mask_token_id=...)."
        )


def init_with_reference(trainer, parent_init, model, args, load=None, **kwargs):
    """Run ``parent_init`` (a ``GRPOTrainer.__init__``) and return the KL reference it left for us to prepare.

    With PEFT, TRL's own semantics hold: the reference is the base model with adapters disabled, or — for a model
    that already carries an adapter (SFT then RL) — TRL's frozen copy ``"ref"`` of that adapter. Otherwise TRL would
    rebuild the reference with ``AutoModelForCausalLM`` from the policy's path, which cannot read LLaDA/Dream (nor
    an in-memory model): :func:`reference_copy` builds it instead, and ``beta`` is hidden from TRL meanwhile.
    """
    beta = args.beta
    peft = kwargs.get("peft_config") is not None or hasattr(model, "peft_config")
    reference = reference_copy(model, load) if beta != 0.0 and not peft else None
    if reference is not None:
        args.beta = 0.0
    try:
        with _old_checkpointing_names_quiet():  # PEFT's PeftModel reads is_gradient_checkpointing
            parent_init(model=model, args=args, **kwargs)
    finally:
        args.beta = beta
    trainer.beta = beta
    check_launch(trainer.accelerator)
    return reference


def _state_candidates(batch, rows, j, args, block_size=None):
    """(rows, G) bool: the positions of state ``j`` whose log-prob a loss term may read (a superset of its targets,
    which for RLDF are only known once π_old is scored), so that scoring passes run the LM head there only."""
    seed = batch.get("mask_seed")
    return estimator_candidates(
        args.policy_estimator,
        commit_step=batch["commit_step"][rows],
        valid_mask=batch["valid_mask"][rows],
        step=batch["sampled_steps"][rows, j],
        mask_seed=None if seed is None else seed[rows],
        block_size=block_size,
    )


@contextlib.contextmanager
def _old_checkpointing_names_quiet():
    """TRL (``unwrap_model_for_generation``, ``disable_gradient_checkpointing``: the rollout and the π_old pass) and
    PEFT (``PeftModel``) read and toggle gradient checkpointing through transformers' old names
    (``is_gradient_checkpointing``, ``gradient_checkpointing_disable/enable``), which transformers ≥ 5.24 deprecates
    with a FutureWarning on every step. What they do is right; only those warnings, raised inside TRL and PEFT, are
    dropped here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                                category=FutureWarning)
        yield


class RLDFTrainer(GRPOTrainer):
    """GRPO-style trainer for masked diffusion LMs with the RLDF policy loss.

    Args mirror [`~trl.GRPOTrainer`]; ``model`` is a diffusion LM object (see
    [`~dllm_trl.load_diffusion_model`]) or a name/path loaded through it with ``args.model_init_kwargs``.
    """

    _tag_names = ["trl", "rldf", "diffusion"]
    config_class = RLDFConfig

    def __init__(self, model, reward_funcs=None, args: RLDFConfig | None = None, **kwargs):
        if args is None:
            args = RLDFConfig("rldf-output")
        if not isinstance(args, RLDFConfig):
            raise TypeError(f"args must be an RLDFConfig, got {type(args).__name__}.")
        for unsupported in ("tools", "rollout_func", "environment_factory"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"{unsupported}= is not supported by diffusion trainers.")
        if args.policy_estimator not in TRAJECTORY_ESTIMATORS and type(self)._step_loss is not RLDFTrainer._step_loss:
            raise ValueError(
                f"policy_estimator={args.policy_estimator!r} is not supported by {type(self).__name__}: it builds "
                f"its own states at the sampled denoising steps; use one of {TRAJECTORY_ESTIMATORS}."
            )
        if isinstance(model, str):
            model = load_diffusion_model(model, **dict(args.model_init_kwargs or {}))
        make_bidirectional(model)
        if diffusion_block_size(model) is not None and args.policy_estimator not in TRAJECTORY_ESTIMATORS:
            raise ValueError(
                f"policy_estimator={args.policy_estimator!r} has no block-diffusion form (its states mask every block "
                f"at once, which a block-diffusion model never decodes from); use one of {TRAJECTORY_ESTIMATORS}."
            )
        check_training_inputs(model, kwargs.get("train_dataset"), kwargs.get("processing_class"))
        reference = init_with_reference(self, super().__init__, model, args, reward_funcs=reward_funcs, **kwargs)
        keep_buffers_out_of_ddp(self.model)
        if reference is not None:
            self.ref_model = self._prepare_reference(reference)

        self.diffusion_generation_config = args.diffusion_generation_config()
        check_block_decoding(self.diffusion_generation_config, diffusion_block_size(model))
        device = self.accelerator.device
        self._rollout_generator = torch.Generator(device=device)
        self._rollout_generator.manual_seed(args.seed + 1000003 * self.accelerator.process_index)
        # A generator of its own, so that drawing the rows' mask seeds leaves the rollouts' random stream untouched.
        self._mask_seed_generator = torch.Generator()
        self._mask_seed_generator.manual_seed(args.seed + MASK_SEED_OFFSET + 1000003 * self.accelerator.process_index)
        self._rollout = None
        # Targets fixed by the loss forward, awaiting their batch normaliser (see _finish_pending_normalization).
        self._pending_loss = self._pending_target_count = torch.zeros((), device=device)

    def _prepare_reference(self, reference: PreTrainedModel) -> PreTrainedModel:
        reference.requires_grad_(False)
        reference.eval()
        if self.args.disable_dropout:
            disable_dropout_in_model(reference)
        if not is_partitioned(reference):  # a partitioned reference was loaded shard by shard from the checkpoint
            broadcast_from_main(reference, self.accelerator)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(reference, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(reference, self.accelerator)
        return self.accelerator.prepare_model(reference, evaluation_mode=True)

    # ------------------------------------------------------------------------------------------------ rollout
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("Diffusion trainers take text prompts only.")
        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        prompt_tensor = pad(prompts, padding_value=pad_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)

        start = time.perf_counter()
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            # The mode stays as it is, as in TRL's own generation (dropout is off by `disable_dropout`): bitsandbytes
            # repacks 4-bit weights on CPU for inference at the first eval-mode forward, after which they pass no
            # gradient, so an eval() here would silently stop QLoRA from learning.
            output = diffusion_generate(
                unwrapped, prompt_tensor, prompt_mask, self.diffusion_generation_config, self._rollout_generator
            )
        rollout_seconds = time.perf_counter() - start

        num_steps = int(output.num_steps.max().item()) if output.num_steps.numel() else 0
        uncertainty, has_tokens = step_uncertainty(
            output.commit_step, output.commit_prob, output.completion_mask, max(num_steps, 1)
        )
        sampled = sample_timesteps(
            uncertainty, has_tokens, self.args.num_sampled_timesteps, self.args.timestep_temperature,
            self._rollout_generator,
        )
        picked = sampled.clamp_min(0)
        sampled_weight = uncertainty.gather(1, picked)[sampled != INVALID_STEP]
        rows = output.completion_ids.shape[0]
        mask_seed = torch.randint(0, 2**62, (rows,), generator=self._mask_seed_generator).to(device)
        self._rollout = {
            "rollout_prompt_ids": prompt_tensor,
            "rollout_prompt_mask": prompt_mask,
            "rollout_ids": output.completion_ids,
            "commit_step": output.commit_step,
            "valid_mask": output.completion_mask,
            "sampled_steps": estimator_steps(
                self.args.policy_estimator, sampled, output.completion_mask, mask_seed, self.args.complementary_masking
            ),
            "mask_seed": mask_seed,
        }
        if output.topk_ids is not None:
            # Only when the sampler records the behaviour distribution (record_topk > 0, e.g. DPPOMaskTrainer): the
            # top-K the committed tokens were drawn from and their probabilities travel with the batch too.
            self._rollout.update(
                rollout_topk_ids=output.topk_ids, rollout_topk_logps=output.topk_logps, rollout_commit_prob=output.commit_prob
            )
        mode = "train" if self.model.training else "eval"
        gathered_nfe = self.accelerator.gather(torch.tensor([float(output.nfe)], device=device)).mean()
        self._metrics[mode]["rldf/nfe_per_completion"].append(gathered_nfe.item())
        self._metrics[mode]["rldf/rollout_time"].append(rollout_seconds)
        self._metrics[mode]["rldf/steps_per_completion"].append(
            self.accelerator.gather(output.num_steps.float()).mean().item()
        )
        weight_stats = torch.stack([sampled_weight.sum(), torch.tensor(float(sampled_weight.numel()), device=device)])
        weight_stats = self.accelerator.reduce(weight_stats, reduction="sum")
        self._metrics[mode]["rldf/sampled_step_uncertainty"].append((weight_stats[0] / weight_stats[1].clamp_min(1)).item())

        completion_ids = [
            ids[mask.bool()].tolist() for ids, mask in zip(output.completion_ids.cpu(), output.completion_mask.cpu())
        ]
        return completion_ids, None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        """Log-probs of the rollout tokens at the sampled states of the current rollout, (B, k, G).

        TRL calls this for the reference and old-policy passes; the states come from the rollout just made,
        not from ``input_ids`` (which hold the completion only up to its first EOS).
        """
        if self._rollout is None:
            raise RuntimeError("No rollout to score: _generate_single_turn must run first.")
        with torch.no_grad():
            logps = self._logps_at_sampled_states(model, self._rollout, batch_size=batch_size)
        return logps, None, None

    def _logps_at_sampled_states(self, model, batch, step_index=None, batch_size=None):
        """(B, k, G) log-probs of ``rollout_ids`` at each sampled ``o_t`` (zeros where the step is padding)."""
        if step_index is None and self._packs_states(model):
            return self._packed_logps_at_sampled_states(model, batch, batch_size)
        sampled = batch["sampled_steps"]
        rows, k = sampled.shape
        gen = batch["rollout_ids"].shape[1]
        out = torch.zeros(rows, k, gen, device=sampled.device)
        mask_id = diffusion_config(model).mask_token_id
        chunk = batch_size or rows
        for j in range(k) if step_index is None else [step_index]:
            active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
            for part in active.split(chunk) if active.numel() else ():
                prompt_ids, prompt_mask, state = _state_inputs(batch, part, j, mask_id, self.args)
                read = _state_candidates(batch, part, j, self.args, diffusion_block_size(model))
                out[part, j] = completion_token_logps(
                    model, prompt_ids, prompt_mask, state, batch["rollout_ids"][part], read_mask=read
                )
        return out

    def _generate_and_score_completions(self, inputs):
        with _old_checkpointing_names_quiet():  # TRL's rollout and π_old passes toggle checkpointing by the old names
            output = super()._generate_and_score_completions(inputs)
        rollout, self._rollout = self._rollout, None
        output.update(rollout)
        if self.args.mask_truncated_completions:  # as TRL: a completion that never reached EOS is not learnt from
            eos = torch.tensor(eos_token_ids(diffusion_config(self.model)), device=output["rollout_ids"].device)
            truncated = ~torch.isin(output["rollout_ids"], eos).any(1)
            output["valid_mask"] = output["valid_mask"] * (~truncated).unsqueeze(1)
            output["sampled_steps"] = output["sampled_steps"].masked_fill(truncated.unsqueeze(1), INVALID_STEP)
        if self.args.drop_zero_variance_groups and self.model.training:
            rows = output["advantages"].shape[0]
            start = self.accelerator.process_index * rows
            drop = self._zero_variance_rows()[start : start + rows]
            output["sampled_steps"] = output["sampled_steps"].masked_fill(drop.unsqueeze(1), INVALID_STEP)

        # Clean targets (Alg. 3) read π_old, the policy that produced the batch. On-policy, π_old is the policy of
        # the loss forward itself, so that forward fixes them (k forwards per micro-batch); otherwise (or when the
        # batch normaliser must be known before any backward) a no-grad pass over the sampled states fixes them now.
        old_logps = output.get("old_per_token_logps")
        if old_logps is None and self.args.policy_estimator == "rldf":  # the other estimators' targets ignore π_old
            if self._clean_targets_from_loss():
                output["target_mask"] = self._candidate_mask(output)
                output["targets_pending"] = torch.ones(output["sampled_steps"].shape[0], dtype=torch.bool,
                                                       device=output["sampled_steps"].device)
                return output
            with torch.no_grad():
                old_logps = self._logps_at_sampled_states(
                    self.model, output, batch_size=self.args.per_device_train_batch_size
                )
        output["target_mask"] = self._target_mask(output, old_logps)
        if "target_weight" in output:  # per-token weights (random masking): counts are weighted counts
            output["num_target_tokens"] = self.accelerator.gather(output["target_weight"].sum()).sum()
        else:
            output["num_target_tokens"] = self.accelerator.gather(output["target_mask"].sum()).sum()
        return output

    _entropy_all = None
    """(B, k, G) entropies of the states' target distributions in the current loss call (None: not computed)."""

    _pending_token_norm = False
    """Whether the micro-batch just computed awaits its batch normaliser (see :meth:`_finish_pending_normalization`)."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards = rewards  # (every process's completions, reward functions): see _zero_variance_rows
        return rewards

    def _zero_variance_rows(self) -> torch.Tensor:
        """(all processes' rows,) bool: the rows of groups whose advantages carry no signal (paper App. C.3).

        Read from the gathered rewards as TRL's own ``frac_reward_zero_std`` is (a std within float rounding of 0),
        not from ``advantages == 0``, which the rounding of the group mean defeats: with ``sum_then_normalize`` the
        weighted sum is constant in the group; with ``normalize_then_sum`` every reward function is.
        """
        rewards = self._gathered_rewards
        groups = rewards.view(-1, self.num_generations, rewards.shape[-1])
        if self.args.multi_objective_aggregation == "sum_then_normalize":
            total = (groups * self.reward_weights.to(rewards.device)).nansum(-1)
            zero = torch.nan_to_num(total.std(1), nan=0.0) <= 1e-6 * (1 + total.abs().mean(1))
        else:
            spread = torch.nan_to_num(groups.std(1), nan=0.0)
            zero = (spread <= 1e-6 * (1 + groups.abs().mean(1))).all(-1)
        return zero.repeat_interleave(self.num_generations)

    defer_clean_targets = True
    """On-policy batches fix their clean targets in the loss forward (see :meth:`_clean_targets_from_loss`); set it
    to ``False`` on an instance to run the separate no-grad π_old pass instead (the same targets and gradients)."""

    def _clean_targets_from_loss(self) -> bool:
        """Whether this on-policy batch's clean targets can come from the loss forward itself.

        ``sample`` normalisation needs only each state's own target count. ``token`` normalisation needs the target
        count of the whole generation batch: the steps are backpropagated unnormalised and the gradients divided by
        that count after the last micro-batch, before clipping (:meth:`training_step`) — which needs the generation
        batch to be exactly one optimizer step and the gradients at hand (DeepSpeed keeps them in its own buffers).
        """
        if not (self.defer_clean_targets and self.model.training) or type(self)._step_loss is not RLDFTrainer._step_loss:
            return False
        if self.args.loss_normalization == "sample":
            return True
        return self.args.steps_per_generation == self.args.gradient_accumulation_steps and gradients_accessible(
            self.accelerator
        )

    def _candidate_mask(self, batch):
        """(B, k, G): every position that can be a target of each sampled state (:func:`estimator_candidates`)."""
        rows = torch.arange(batch["sampled_steps"].shape[0], device=batch["sampled_steps"].device)
        block_size = diffusion_block_size(self.model)
        return torch.stack([_state_candidates(batch, rows, j, self.args, block_size)
                            for j in range(batch["sampled_steps"].shape[1])], dim=1)

    def _target_mask(self, batch, old_logps):
        """Ô_t (B, k, G) for every sampled step (the estimator's targets of every state); empty for padding steps.

        Estimators with per-token weights (random masking) also store ``batch["target_weight"]`` (B, k, G).
        """
        sampled = batch["sampled_steps"]
        masks, weights = [], []
        for j in range(sampled.shape[1]):
            targets, weight = estimator_targets(
                self.args.policy_estimator,
                commit_step=batch["commit_step"],
                valid_mask=batch["valid_mask"],
                step=sampled[:, j],
                mask_seed=batch.get("mask_seed"),
                clean_prob=None if old_logps is None else old_logps[:, j].exp(),
                clean_threshold=self.args.clean_target_threshold,
                block_size=diffusion_block_size(self.model),
            )
            masks.append(targets)
            weights.append(weight)
        if weights and weights[0] is not None:
            batch["target_weight"] = torch.stack(weights, dim=1)
        return torch.stack(masks, dim=1)

    # --------------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        """RLDF loss (Eq. 7–10): one forward per sampled step; in training, one backward per step or one in all.

        The returned tensor carries the whole micro-batch loss as its value. With per-step backward (see
        ``backward_mode``) it carries only the last step's graph: earlier steps were already backpropagated here
        (activations of one step alive at a time, SPEC §2.3), and the trainer backpropagates the rest.
        """
        mode = "train" if self.model.training else "eval"
        start = time.perf_counter()
        sampled, targets = inputs["sampled_steps"], inputs["target_mask"]
        normalizer = self._loss_normalizer(inputs, mode)
        kl = torch.zeros(targets.shape, device=targets.device)
        ratio_all = torch.ones_like(kl)
        own_terms = type(self)._step_loss is RLDFTrainer._step_loss  # a subclass's terms may have no entropy / clip
        self._entropy_all = torch.zeros_like(kl) if own_terms else None
        step_valid = sampled != INVALID_STEP
        active_steps = step_valid.any(0).nonzero().squeeze(1).tolist()
        training = mode == "train" and torch.is_grad_enabled()
        # Targets from this forward under "token" normalisation: the batch's count is applied to the gradients after
        # the last micro-batch (training_step), or, without a backward, to the value below.
        pending_count = "targets_pending" in inputs and self.args.loss_normalization == "token"
        self._pending_token_norm = pending_count and training
        if training:
            check_weights_pass_gradients(model)
        chunks = self._loss_chunks(model, inputs, active_steps)
        backward_each_step = training and len(chunks) > 1 and self._per_step_backward
        total = torch.zeros((), device=targets.device)
        graph = None  # what the Trainer backpropagates: the last step (per-step backward) or all of them
        for n, chunk in enumerate(chunks):
            early = backward_each_step and n < len(chunks) - 1
            # DDP decides at forward time whether the backward synchronises: only the last step may.
            with paused_gradient_sync(self.accelerator, model) if early else contextlib.nullcontext():
                step_loss = self._chunk_loss(model, inputs, chunk, normalizer, kl, ratio_all)
                if early:
                    backward_without_step(self.accelerator, step_loss)
            total = total + step_loss.detach()
            if not early:
                graph = step_loss if graph is None else graph + step_loss
        if graph is None:  # nothing to learn from: a zero that still flows through the model (DDP needs a graph)
            graph = self._zero_loss(model, inputs)
        if pending_count and not training:
            count = self.accelerator.reduce(targets.sum().float().reshape(1), reduction="sum").clamp(min=1.0).squeeze()
            total, graph = total / count, graph / count
        loss = graph + (total - graph.detach())
        clipped = "old_per_token_logps" in inputs and own_terms  # PPO clipping happened
        self._log_rldf_metrics(mode, targets, step_valid, inputs["valid_mask"].bool(), kl, ratio_all,
                               inputs["advantages"], clipped)
        self._metrics[mode]["rldf/loss_time"].append(time.perf_counter() - start)
        return loss

    def _step_loss(self, model, inputs, j, normalizer, kl, ratio_all, scored=None):
        """Weighted sum of the per-token terms of sampled step ``j`` over the rows that have one (``scored``: their
        ``(log-probs, entropies)`` at the state's read positions when already computed, by a packed forward)."""
        sampled = inputs["sampled_steps"]
        active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
        read = inputs["target_mask"][active, j]
        if scored is None:
            mask_id = diffusion_config(model).mask_token_id
            prompt_ids, prompt_mask, state = _state_inputs(inputs, active, j, mask_id, self.args)
            scored = completion_token_logps(model, prompt_ids, prompt_mask, state, inputs["rollout_ids"][active],
                                            read_mask=read, with_entropy=True,
                                            entropy_grad=self.args.entropy_coef != 0.0)
        logps, entropy = scored
        targets = read
        if "targets_pending" in inputs:  # on-policy: Ô_t from this very forward (π_θ = π_old, detached)
            targets = read & clean_target_mask(inputs["commit_step"][active], inputs["valid_mask"][active],
                                               sampled[active, j], logps.detach().exp(), self.args.clean_target_threshold)
            inputs["target_mask"][active, j] = targets
            if self._pending_token_norm:  # (training only: without a backward the count is applied in _compute_loss)
                self._pending_target_count = self._pending_target_count + targets.sum()
        old_all, ref_all = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
        old = None if old_all is None else old_all[active, j]
        terms, ratio = policy_token_terms(logps, inputs["advantages"][active], old, self.epsilon_low, self.epsilon_high,
                                          delta=self.args.delta)
        if self.beta != 0.0:
            step_kl = k3_kl(logps, ref_all[active, j])
            if self.args.use_bias_correction_kl:  # as TRL: k3 weighted by π_θ/π_old, with gradient
                step_kl = step_kl * torch.exp(logps - (logps.detach() if old is None else old))
            terms = terms + self.beta * step_kl
            kl[active, j] = step_kl.detach()
        if self.args.entropy_coef != 0.0:  # as TRL: an entropy bonus per target token
            terms = terms - self.args.entropy_coef * entropy
        self._entropy_all[active, j] = entropy.detach()
        if ratio is not None:
            ratio_all[active, j] = ratio.detach()
        weights = normalizer[active, j].unsqueeze(-1)
        if "target_weight" in inputs:
            weights = weights * inputs["target_weight"][active, j]
        if "targets_pending" in inputs and self.args.loss_normalization == "sample":
            weights = weights / targets.sum(-1, keepdim=True).clamp(min=1)  # the 1/|Ô_t| of Eq. 10
        return (terms * targets * weights).sum()

    # ------------------------------------------------------------------ block-diffusion models: packed states
    def _packs_states(self, model) -> bool:
        """Whether the sampled states are scored in packed forwards: a block-diffusion model, and this class's loss
        term is RLDF's own (a subclass with its own :meth:`_step_loss` scores one state per forward)."""
        return diffusion_block_size(model) is not None and type(self)._step_loss is RLDFTrainer._step_loss

    def _loss_chunks(self, model, inputs, steps: list[int]) -> list[list[int]]:
        """The sampled-step indices ``steps`` grouped into forwards (each followed by its backward under per-step
        backward): one per step, or for a block-diffusion model as many per packed forward as
        :func:`~dllm_trl.losses.packed_states.states_per_forward` allows."""
        if not self._packs_states(model):
            return [[j] for j in steps]
        width = states_per_forward(
            inputs["rollout_prompt_ids"].shape[1], inputs["rollout_ids"].shape[1], diffusion_block_size(model)
        )
        return [steps[i : i + width] for i in range(0, len(steps), width)]

    def _chunk_loss(self, model, inputs, steps, normalizer, kl, ratio_all):
        """:meth:`_step_loss` summed over ``steps``; their log-probs come from one packed forward when packing."""
        if not self._packs_states(model):
            (j,) = steps  # one state per forward
            return self._step_loss(model, inputs, j, normalizer, kl, ratio_all)
        sampled = inputs["sampled_steps"]
        rows = (sampled[:, steps] != INVALID_STEP).any(1).nonzero().squeeze(1)
        logps, entropy = self._packed_state_logps(model, inputs, rows, steps, inputs["target_mask"][rows][:, steps],
                                                  with_entropy=True, entropy_grad=self.args.entropy_coef != 0.0)
        where = torch.full((sampled.shape[0],), -1, dtype=torch.long, device=rows.device)
        where[rows] = torch.arange(rows.numel(), device=rows.device)
        loss = 0.0
        for n, j in enumerate(steps):
            active = (sampled[:, j] != INVALID_STEP).nonzero().squeeze(1)
            scored = (logps[where[active], n], entropy[where[active], n])
            loss = loss + self._step_loss(model, inputs, j, normalizer, kl, ratio_all, scored=scored)
        return loss

    def _packed_state_logps(self, model, batch, rows, steps, read, with_entropy=False, entropy_grad=True):
        """``log π(o_i | q, o_t)`` (len(rows), len(steps), G) at ``read`` for the sampled steps ``steps`` (indices
        into ``sampled_steps``) of ``rows``: one forward over the prompt, the clean completion and each state's
        noisy block (SPEC §7). ``with_entropy``: also the entropy of ``π(· | q, o_t)`` there (same shape; without
        gradient unless ``entropy_grad``)."""
        config = diffusion_config(model)
        shift = 1 if getattr(config, "diffusion_logit_shift", False) else 0
        rollout_ids = batch["rollout_ids"][rows]
        packed = pack_sampled_states(
            batch["rollout_prompt_ids"][rows], batch["rollout_prompt_mask"][rows], rollout_ids,
            batch["commit_step"][rows], batch["sampled_steps"][rows][:, steps], diffusion_block_size(config),
            config.mask_token_id, attention_mask_dtype(model),
        )
        read_rows, read_columns, index = packed_read_positions(packed, read, shift)
        values = chunked_token_logps_at(
            model, read_rows, read_columns, rollout_ids[index[0], index[2]], with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids,
        )
        scatter = lambda v: torch.zeros(read.shape, dtype=v.dtype, device=v.device).index_put(index, v)  # noqa: E731
        return tuple(scatter(v) for v in values) if with_entropy else scatter(values)

    def _packed_logps_at_sampled_states(self, model, batch, batch_size=None):
        """:meth:`_logps_at_sampled_states` of a block-diffusion model: every state's candidates, rows in chunks of
        ``batch_size``, states packed as :meth:`_loss_chunks` groups them."""
        sampled = batch["sampled_steps"]
        rows, k = sampled.shape
        out = torch.zeros(rows, k, batch["rollout_ids"].shape[1], device=sampled.device)
        every = torch.arange(rows, device=sampled.device)
        block_size = diffusion_block_size(model)
        read = torch.stack([_state_candidates(batch, every, j, self.args, block_size) for j in range(k)], dim=1)
        live = (sampled != INVALID_STEP).any(1).nonzero().squeeze(1)
        for part in live.split(batch_size or rows) if live.numel() else ():
            for steps in self._loss_chunks(model, batch, list(range(k))):
                logps = self._packed_state_logps(model, batch, part, steps, read[part][:, steps])
                out[part.unsqueeze(1), torch.tensor(steps, device=part.device)] = logps
        return out

    def _loss_normalizer(self, inputs, mode) -> torch.Tensor:
        """Per-(row, step) weight of a target token's term, so that summing gives Eq. 10 / Eq. 13.

        ``token``: every target token of the generation batch weighs the same (TRL's ``dapo`` convention:
        global count, split over processes and accumulation steps). ``sample``: ``1/(|Ô_t| |S_b|)`` per
        token, averaged over the micro-batch's completions and accumulation steps (TRL's ``grpo``).
        """
        targets, sampled = inputs["target_mask"], inputs["sampled_steps"]
        pending = "targets_pending" in inputs  # targets fixed in the loss forward: counts applied later
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.args.loss_normalization == "token":
            share = self.accelerator.num_processes * (self.args.steps_per_generation / accumulation if mode == "train" else 1)
            count = 1.0 if pending else inputs["num_target_tokens"].clamp(min=1.0)  # pending: see training_step
            return torch.full(sampled.shape, share, device=sampled.device) / count
        if pending:  # the 1/|Ô_t| factor is applied by _step_loss
            per_step = torch.ones(sampled.shape, device=sampled.device)
        else:
            weighted = targets.sum(-1) if "target_weight" not in inputs else inputs["target_weight"].sum(-1)
            per_step = weighted.clamp(min=1)
        steps = (sampled != INVALID_STEP).sum(-1, keepdim=True).clamp(min=1)
        return 1.0 / (per_step * steps * sampled.shape[0] * accumulation)

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        return self._finish_pending_normalization(model, loss) if self._pending_token_norm else loss

    def _finish_pending_normalization(self, model, loss):
        """``token`` normalisation of a batch whose targets came from the loss forward (:meth:`_clean_targets_from_loss`).

        Its micro-batches were backpropagated without the ``1/count`` of Eq. 13: after the last one, the gradients
        are divided by the generation batch's target count (all processes), before the Trainer clips them. The loss
        the Trainer logs is returned in full by the last micro-batch (0 by the others).
        """
        self._pending_loss = self._pending_loss + loss
        if not self.accelerator.sync_gradients:
            return torch.zeros_like(loss)
        count = self.accelerator.reduce(self._pending_target_count.float().reshape(1), reduction="sum").clamp(min=1.0)
        for param in model.parameters():
            if param.grad is not None:
                param.grad.div_(count.to(param.grad.dtype))
        total = self._pending_loss / count.to(loss.dtype).squeeze()
        self._pending_loss = self._pending_target_count = torch.zeros((), device=loss.device)
        return total

    @property
    def _per_step_backward(self) -> bool:
        """``args.backward_mode`` resolved for this engine (``"auto"``: see :class:`RLDFConfig`)."""
        if self.args.backward_mode == "auto":
            return not backward_syncs_every_call(self.accelerator)
        return self.args.backward_mode == "per_step"

    def _zero_loss(self, model, inputs):
        state = inputs["rollout_ids"][:1]
        logps = completion_token_logps(
            model, inputs["rollout_prompt_ids"][:1], inputs["rollout_prompt_mask"][:1], state, state
        )
        return logps.sum() * 0.0

    def _log_rldf_metrics(self, mode, targets, step_valid, valid, kl, ratio, advantages, ppo):
        reduce = lambda x: self.accelerator.reduce(x, reduction="sum")  # noqa: E731
        steps = step_valid.sum().float()
        target_count = targets.sum().float()
        lengths = valid.sum(-1, keepdim=True).float().clamp_min(1).expand_as(step_valid)
        utility = (targets.sum(-1).float() / lengths * step_valid).sum()
        rows = torch.tensor(float(step_valid.shape[0]), device=steps.device)
        entropy = (self._entropy_all * targets).sum() if self._entropy_all is not None else torch.zeros_like(steps)
        stats = reduce(torch.stack([target_count, steps, utility, (kl * targets).sum(), rows, entropy]))
        self._metrics[mode]["rldf/target_tokens_per_step"].append((stats[0] / stats[1].clamp_min(1)).item())
        self._metrics[mode]["rldf/token_utility"].append((stats[2] / stats[1].clamp_min(1)).item())
        self._metrics[mode]["rldf/sampled_steps"].append((stats[1] / stats[4].clamp_min(1)).item())
        scored = stats[0].item() > 0  # no token scored (every group dropped): entropy and KL have no value, not 0
        if self._entropy_all is not None and scored:  # TRL's metric: mean entropy of the tokens the loss reads
            self._metrics[mode]["entropy"].append((stats[5] / stats[0]).item())
        if self.beta != 0.0 and scored:
            self._metrics[mode]["kl"].append((stats[3] / stats[0]).item())
        if ppo:
            adv = advantages.view(-1, 1, 1)
            low = ((ratio < 1 - self.epsilon_low) & (adv < 0) & targets).sum().float()
            high = ((ratio > 1 + self.epsilon_high) & (adv > 0) & targets).sum().float()
            clip = reduce(torch.stack([low, high]))
            self._metrics[mode]["clip_ratio/low_mean"].append((clip[0] / stats[0].clamp_min(1)).item())
            self._metrics[mode]["clip_ratio/high_mean"].append((clip[1] / stats[0].clamp_min(1)).item())
            self._metrics[mode]["clip_ratio/region_mean"].append((clip.sum() / stats[0].clamp_min(1)).item())

    # ------------------------------------------------------------------------------------------ checkpoints
    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        path = os.path.join(output_dir, f"rldf_generator_{self.accelerator.process_index}.pt")
        torch.save(self._rollout_generator.get_state(), path)
        path = os.path.join(output_dir, f"rldf_mask_seed_generator_{self.accelerator.process_index}.pt")
        torch.save(self._mask_seed_generator.get_state(), path)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, f"rldf_generator_{self.accelerator.process_index}.pt")
        if os.path.isfile(path):
            self._rollout_generator.set_state(torch.load(path, weights_only=True))
        path = os.path.join(checkpoint, f"rldf_mask_seed_generator_{self.accelerator.process_index}.pt")
        if os.path.isfile(path):
            self._mask_seed_generator.set_state(torch.load(path, weights_only=True))
