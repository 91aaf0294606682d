"""RLDFTrainer: TRL's GRPOTrainer with diffusion rollouts and the RLDF loss (paper 1, SPEC §2).

Hook glue: the rollout is a sampler object's (:class:`~dllm_trl.generation.MaskedDiffusionSampler` by default), the
states, targets, per-token terms and metrics are a loss object's (:class:`~dllm_trl.losses.RLDFLoss` by default, or
any object with its interface, e.g. :class:`~dllm_trl.losses.DiffusionTrustRegionLoss`). What changes against
``GRPOTrainer`` (everything else — datasets, rewards, advantages, batching, logging, PEFT, distributed — is TRL's):

* ``_generate_single_turn``: the sampler's rollout, then the loss's state draws (Alg. 2);
* ``_get_per_token_logps_and_entropies``: log-probs at the sampled states ``o_t`` (B, k, G), so TRL's own
  reference / old-policy passes score the right states;
* ``_generate_and_score_completions``: attaches the trajectory to the batch (TRL's splitting and shuffling keep each
  row aligned with it) and fixes the targets;
* ``_compute_loss``: the loss object's terms, one sampled step (or one packed chunk of steps) at a time, each
  backpropagated as it comes when the engine allows (activations of one step alive at a time, SPEC §2.3);
* ``training_step``: ``token`` normalisation of targets fixed by the loss forward itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from ..losses.rldf_terms import INVALID_STEP
from ..losses.rldf_loss import zero_variance_rows
from ..models.bidirectional import diffusion_block_size, eos_token_ids
from ..models.engines import (
    LockStep,
    backward_syncs_every_call,
    backward_without_step,
    check_weights_pass_gradients,
    gradients_accessible,
    model_config,
    paused_gradient_sync,
    prepare_model_buffers,
)
from ..families import load_diffusion_model
from .common import (
    check_lengths_fit,
    check_prompt_positions,
    diffusion_family,
    resolve_block_length,
    with_family_lora_targets,
    check_sampler_length,
    check_training_inputs,
    init_with_reference,
    log_metric_extremes,
    log_metric_sums,
    old_checkpointing_names_quiet,
    prepare_reference,
    SafeRunMixin,
    refuse_unsupported_kwargs,
)
from .rldf_config import RLDFConfig

MASK_SEED_OFFSET = 7919
"""The generator of the rows' ``mask_seed`` is seeded ``args.seed + MASK_SEED_OFFSET`` (+ a per-process offset)."""


class RLDFTrainer(SafeRunMixin, GRPOTrainer):
    """GRPO-style trainer for masked diffusion LMs with the RLDF policy loss.

    Args mirror [`~trl.GRPOTrainer`]; ``model`` is a diffusion LM object (see [`~dllm_trl.load_diffusion_model`]) or a
    name/path loaded through it with ``args.model_init_kwargs``. The model's family (:mod:`dllm_trl.families`) gives
    the defaults: ``sampler``, the rollout (block-wise masked diffusion decoding set by ``args`` for masked-diffusion
    LMs, DiffusionGemma's canvases for DiffusionGemma); ``loss``, the loss object (:class:`~dllm_trl.losses.RLDFLoss`,
    with routing-drift metrics on a mixture-of-experts block-diffusion LM, DiffusionGemma's own); ``args.block_length``
    (``None``: the family's).
    """

    _tag_names = ["trl", "rldf", "diffusion"]
    config_class = RLDFConfig

    def __init__(self, model, reward_funcs=None, args: RLDFConfig | None = None, *, sampler=None, loss=None, **kwargs):
        if args is None:
            args = self.config_class("rldf-output")
        if not isinstance(args, self.config_class):
            raise TypeError(f"args must be a {self.config_class.__name__}, got {type(args).__name__}.")
        refuse_unsupported_kwargs("diffusion trainers", kwargs)
        if isinstance(model, str):
            model = load_diffusion_model(model, **dict(args.model_init_kwargs or {}))
        self.family = diffusion_family(model, type(self).__name__)
        self.block_length = resolve_block_length(args, self.family, model)
        kwargs = with_family_lora_targets(kwargs, self.family)
        self.loss = self.make_loss(args, model) if loss is None else loss
        self.loss.check_model(model)
        self.family.check_peft_config(kwargs.get("peft_config"))
        self.family.prepare_model(model)
        self.sampler = self.family.sampler(args, model, self.block_length) if sampler is None else sampler
        requests = self.loss.sampler_requests()  # what the loss reads from the rollout's record
        if requests:  # into a copy: the caller's config stays as they built it
            if not dataclasses.is_dataclass(self.sampler.config):
                raise TypeError(f"sampler.config must be a dataclass (the loss asks for {requests} on a copy of it); "
                                f"got {type(self.sampler.config).__name__}.")
            self.sampler.config = dataclasses.replace(self.sampler.config, **requests)
        self.loss.bind_sampler(self.sampler.config)  # the loss scores π_old as this sampler draws
        self.sampler.check_model(model)
        check_sampler_length(self.sampler.config, args)
        check_training_inputs(model, kwargs.get("train_dataset"), kwargs.get("processing_class"))
        check_lengths_fit(model, args.max_completion_length, kwargs.get("train_dataset"), kwargs.get("processing_class"))
        reference = init_with_reference(self, super().__init__, model, args, reward_funcs=reward_funcs, **kwargs)
        self.family.prepare_wrapped_model(self.model)
        prepare_model_buffers(self.model, self.accelerator)
        if reference is not None:
            self.ref_model = prepare_reference(reference, self.accelerator, self.args.disable_dropout)

        device = self.accelerator.device
        self._rollout_generator = torch.Generator(device=device)
        self._rollout_generator.manual_seed(args.seed + 1000003 * self.accelerator.process_index)
        # A generator of its own, so that drawing the rows' mask seeds leaves the rollouts' random stream untouched.
        self._mask_seed_generator = torch.Generator()
        self._mask_seed_generator.manual_seed(args.seed + MASK_SEED_OFFSET + 1000003 * self.accelerator.process_index)
        self._rollout = None  # the trajectory of the rollout just made, until TRL's batch takes it
        # Targets fixed by the loss forward, awaiting their batch normaliser (see _finish_pending_normalization).
        self._pending_loss = self._pending_target_count = torch.zeros((), device=device)
        self._pending_token_norm = False

    def make_loss(self, args, model):
        """The default loss object of this trainer for ``args`` and ``model``: its family's RLDF loss."""
        return self.family.rldf_loss(args, model)

    @property
    def diffusion_generation_config(self):
        return self.sampler.config

    # ------------------------------------------------------------------------------------------------ rollout
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("Diffusion trainers take text prompts only.")
        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        prompt_tensor = pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
        # The longest prompt of every process, so that all of them refuse the batch together.
        width = self.accelerator.gather(torch.tensor([prompt_tensor.shape[1]], device=device)).max().item()
        check_prompt_positions(self.model, width, self.args.max_completion_length)
        start = time.perf_counter()
        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            # The mode stays as it is, as in TRL's own generation (dropout is off by `disable_dropout`): bitsandbytes
            # repacks 4-bit weights on CPU for inference at the first eval-mode forward, after which they pass no
            # gradient, so an eval() here would silently stop QLoRA from learning.
            output = self.sampler(unwrapped, prompt_tensor, prompt_mask, self._rollout_generator)
        rollout_seconds = time.perf_counter() - start
        self._rollout, uncertainty = self.loss.sample_states(
            prompt_tensor, prompt_mask, output, self._rollout_generator, self._mask_seed_generator
        )
        mode = "train" if self.model.training else "eval"
        gather = lambda x: self.accelerator.gather(x).mean().item()  # noqa: E731
        self._metrics[mode]["rldf/nfe_per_completion"].append(gather(torch.tensor([float(output.nfe)], device=device)))
        self._metrics[mode]["rldf/rollout_time"].append(rollout_seconds)
        self._metrics[mode]["rldf/steps_per_completion"].append(gather(output.num_steps.float()))
        log_metric_sums(self, mode, {"rldf/sampled_step_uncertainty": (*uncertainty, False)})
        completion_ids = [
            ids[mask.bool()].tolist() for ids, mask in zip(output.completion_ids.cpu(), output.completion_mask.cpu())
        ]
        return completion_ids, None

    def _old_logps_needed(self) -> bool:
        """Whether TRL's ``_generate_and_score_completions`` runs an old-policy pass (TRL's own test)."""
        return self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations) != 0

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        """Log-probs of the rollout tokens at the sampled states of the current rollout, (B, k, G).

        TRL calls this for the old-policy pass (first, when it runs) and the reference pass; the states come from the
        rollout just made, not from ``input_ids`` (which hold the completion only up to its first EOS).
        """
        if self._rollout is None:
            raise RuntimeError("No rollout to score: _generate_single_turn must run first.")
        old_pass = self._old_pass_pending
        self._old_pass_pending = False
        def scoring(batch):
            return self.loss.score_for_policy_pass(model, batch, batch_size=batch_size, old_pass=old_pass)

        with self._forwards_matched(model, self._rollout, scoring):
            logps, extra = scoring(self._rollout)
        self._rollout.update(extra)
        return logps, None, None

    _old_pass_pending = False
    """Set before TRL's passes when an old-policy pass will run: TRL makes it before the reference pass."""

    def _generate_and_score_completions(self, inputs):
        self._old_pass_pending = self._old_logps_needed()
        with old_checkpointing_names_quiet():  # TRL's rollout and π_old passes toggle checkpointing by the old names
            output = super()._generate_and_score_completions(inputs)
        self._old_pass_pending = False
        rollout, self._rollout = self._rollout, None
        output.update(rollout)
        if self.args.mask_truncated_completions:  # as TRL: a completion that never reached EOS is not learnt from
            eos = torch.tensor(eos_token_ids(model_config(self.model).get_text_config()),
                               device=output["rollout_ids"].device)
            truncated = ~torch.isin(output["rollout_ids"], eos).any(1)
            output["valid_mask"] = output["valid_mask"] * (~truncated).unsqueeze(1)
            self.loss.drop_rows(output, truncated)
        if self.args.drop_zero_variance_groups and self.model.training:
            rows = output["advantages"].shape[0]
            start = self.accelerator.process_index * rows
            self.loss.drop_rows(output, self._zero_variance_rows()[start : start + rows])
        if self.args.rollout_importance_sampling_correction:  # after the drops: no pass over rows without a state
            def correcting(batch):
                self.loss.correct_rollout_mismatch(self.model, batch, batch_size=self.args.per_device_train_batch_size)

            with self._forwards_matched(self.model, output, correcting):
                correcting(output)

        # Clean targets (Alg. 3) read π_old, the policy that produced the batch. On-policy, π_old is the policy of
        # the loss forward itself, so that forward may fix them (k forwards per micro-batch); otherwise (or when the
        # batch normaliser must be known before any backward) a no-grad pass over the sampled states fixes them now.
        block_size = diffusion_block_size(self.model)
        old_logps = output.get("old_per_token_logps")
        if old_logps is None and self.loss.targets_need_old_policy:
            if self._clean_targets_from_loss():
                output["target_mask"] = self.loss.candidate_mask(output, block_size)
                output["targets_pending"] = torch.ones(output["sampled_steps"].shape[0], dtype=torch.bool,
                                                       device=output["sampled_steps"].device)
                return output

            def scoring(batch):
                return self.loss.score_states(self.model, batch, batch_size=self.args.per_device_train_batch_size)

            with torch.no_grad(), self._forwards_matched(self.model, output, scoring):
                old_logps = scoring(output)
        output["target_mask"] = self.loss.target_mask(output, old_logps, block_size)
        counted = output["target_weight"] if "target_weight" in output else output["target_mask"]
        output["num_target_tokens"] = self.accelerator.gather(counted.sum()).sum()
        return output

    def _forwards_matched(self, model, batch, scoring):
        """Around a no-grad scoring pass ``scoring(batch)``, whose forwards a process runs per sampled state it has
        (dropped rows have none): every process runs as many as the busiest under engines whose forwards are
        collectives (SPEC §9). The partner of each forward is the same pass on the loss's one-state stand-in of
        ``batch`` (one forward, the same module calls in the same order: the sampler's view, a trust region's
        support), its results dropped. The stand-in is taken before the pass, which may add to ``batch``."""
        lock = LockStep(model)
        before = self.loss.stand_in(batch) if lock.active else None

        def idle():
            with torch.no_grad():
                scoring(self.loss.stand_in(before))  # a fresh copy each time: a pass may write to its batch

        return lock.matched_forwards(model, idle)

    def _zero_variance_rows(self) -> torch.Tensor:
        """(all processes' rows,) bool: the rows of groups whose rewards do not vary (:func:`zero_variance_rows`)."""
        return zero_variance_rows(self._gathered_rewards, self.num_generations, self.reward_weights,
                                  self.args.multi_objective_aggregation)

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
        if not (self.defer_clean_targets and self.model.training and self.loss.targets_from_loss_forward):
            return False
        if self.args.loss_normalization == "sample":
            return True
        return self.args.steps_per_generation == self.args.gradient_accumulation_steps and gradients_accessible(
            self.accelerator
        )

    # --------------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        """The loss object's terms, one forward per sampled step (or packed chunk of steps); in training, one backward
        per chunk or one in all.

        The returned tensor carries the whole micro-batch loss as its value. With per-step backward (see
        ``backward_mode``) it carries only the last chunk's graph: earlier chunks were already backpropagated here,
        and the trainer backpropagates the rest.
        """
        mode = "train" if self.model.training else "eval"
        start = time.perf_counter()
        targets = inputs["target_mask"]
        training = mode == "train" and torch.is_grad_enabled()
        # Targets from this forward under "token" normalisation: the batch's count is applied to the gradients after
        # the last micro-batch (training_step), or, without a backward, to the value below.
        pending_count = "targets_pending" in inputs and self.args.loss_normalization == "token"
        self._pending_token_norm = pending_count and training
        call = self.loss.begin(inputs, self._loss_normalizer(inputs, mode), self.beta, self.epsilon_low,
                               self.epsilon_high, count_targets=self._pending_token_norm)
        if training:
            check_weights_pass_gradients(model)
        active_steps = (inputs["sampled_steps"] != INVALID_STEP).any(0).nonzero().squeeze(1).tolist()
        # A chunk of None is a zero that still flows through the model: DDP needs a graph when nothing has a target,
        # and under engines whose forwards (or, with DeepSpeed, backward calls) are collectives, every process runs
        # as many chunks as the busiest one (its dropped rows or fewer sampled steps give it fewer; SPEC §9).
        chunks = self.loss.loss_chunks(model, inputs, active_steps) or [None]
        lock = LockStep(model, also=training and self._per_step_backward and backward_syncs_every_call(self.accelerator))
        chunks = [None] * (lock.most(len(chunks)) - len(chunks)) + chunks
        backward_each_step = training and len(chunks) > 1 and self._per_step_backward
        total = torch.zeros((), device=targets.device)
        graph = None  # what the Trainer backpropagates: the last chunk (per-step backward) or all of them
        for n, chunk in enumerate(chunks):
            early = backward_each_step and n < len(chunks) - 1
            # DDP decides at forward time whether the backward synchronises: only the last step may.
            with paused_gradient_sync(self.accelerator, model) if early else contextlib.nullcontext():
                if chunk is None:
                    step_loss = self.loss.zero_loss(model, inputs, call)
                else:
                    step_loss = self.loss.chunk_loss(model, inputs, chunk, call)
                if early:
                    backward_without_step(self.accelerator, step_loss)
            total = total + step_loss.detach()
            if not early:
                graph = step_loss if graph is None else graph + step_loss
        self._pending_target_count = self._pending_target_count + call.new_target_count
        if pending_count and not training:
            count = self.accelerator.reduce(targets.sum().float().reshape(1), reduction="sum").clamp(min=1.0).squeeze()
            total, graph = total / count, graph / count
        loss = graph + (total - graph.detach())
        log_metric_sums(self, mode, self.loss.metric_sums(inputs, call))
        log_metric_extremes(self, mode, self.loss.metric_extremes(inputs, call))
        self._metrics[mode]["rldf/loss_time"].append(time.perf_counter() - start)
        return loss

    def _loss_normalizer(self, inputs, mode):
        """The loss object's per-(row, step) normaliser for this engine's processes and accumulation steps."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        share = self.accelerator.num_processes * (self.args.steps_per_generation / accumulation if mode == "train" else 1)
        return self.loss.normalizer(inputs, accumulation, share)

    @property
    def _per_step_backward(self) -> bool:
        """``args.backward_mode`` resolved for this engine (``"auto"``: see :class:`RLDFConfig`)."""
        if self.args.backward_mode == "auto":
            return not backward_syncs_every_call(self.accelerator)
        return self.args.backward_mode == "per_step"

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

    # ------------------------------------------------------------------------------------------ checkpoints
    def _generator_files(self, directory):
        index = self.accelerator.process_index
        return ((os.path.join(directory, f"rldf_generator_{index}.pt"), self._rollout_generator),
                (os.path.join(directory, f"rldf_mask_seed_generator_{index}.pt"), self._mask_seed_generator))

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        for path, generator in self._generator_files(output_dir):
            torch.save(generator.get_state(), path)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        for path, generator in self._generator_files(checkpoint):
            if os.path.isfile(path):
                generator.set_state(torch.load(path, weights_only=True))
