"""The loss-object interface of the diffusion trainers, written down: the members :class:`~dllm_trl.RLDFTrainer` (and
:class:`~dllm_trl.DiffusionDPPOMaskTrainer`) call, in the order a training step calls them. Every loss object of the
package satisfies it (``tests/test_interfaces.py`` checks the members and their parameters against the trainers'
calls); a family's own loss implements it, most simply by subclassing :class:`~dllm_trl.losses.RLDFLoss`.

Batches are TRL's dicts of tensors; ``call`` is the :class:`~dllm_trl.losses.LossCall` of one micro-batch.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DiffusionLoss(Protocol):
    """What a diffusion trainer asks of its loss object."""

    targets_from_loss_forward: bool
    """Whether an on-policy batch's clean targets may be fixed by the loss forward itself (no π_old pass)."""

    # ---------------------------------------------------------------------------------------------- at init
    # (The model is set up by its family: dllm_trl.families.ModelFamily.prepare_model / check_peft_config /
    # prepare_wrapped_model, whatever loss scores it.)
    def check_model(self, model) -> None:
        """Refuse, naming the field and the fix, a model or setting this loss cannot train."""

    def sampler_requests(self) -> dict:
        """Sampler-config fields this loss needs set (on a copy of the sampler's config)."""

    def bind_sampler(self, config) -> None:
        """The config of the sampler that makes the rollouts: π_old is scored with its sampling settings."""

    # ---------------------------------------------------------------------------------------- per rollout
    def sample_states(self, prompt_ids, prompt_mask, output, generator, mask_seed_generator) -> tuple[dict, tuple]:
        """The trajectory the batch carries, and ``(sum, count)`` of the sampled steps' uncertainty."""

    def score_for_policy_pass(self, model, batch, batch_size=None, old_pass=False) -> tuple[torch.Tensor, dict]:
        """TRL's old-policy / reference passes: log-probs (B, k, G) and extra batch entries."""

    def drop_rows(self, batch, rows: torch.Tensor) -> None:
        """Rows that teach nothing keep their shape but lose every sampled state."""

    def correct_rollout_mismatch(self, model, batch, batch_size=None) -> None:
        """``rollout_importance_sampling_correction``: per-token weights against the rollout's record."""

    @property
    def targets_need_old_policy(self) -> bool:
        """Whether the targets read π_old (clean targets)."""

    def candidate_mask(self, batch, block_size) -> torch.Tensor:
        """Positions that may become targets, when the loss forward fixes them."""

    def score_states(self, model, batch, step_index=None, batch_size=None) -> torch.Tensor:
        """No-grad π_old pass over the sampled states (the clean targets' probabilities)."""

    def target_mask(self, batch, old_logps, block_size) -> torch.Tensor:
        """The targets of each sampled state, (B, k, G) bool."""

    # ------------------------------------------------------------------------------------- per micro-batch
    def normalizer(self, inputs, accumulation: int, share: float) -> torch.Tensor:
        """Per-(row, step) normaliser for this engine's processes and accumulation steps."""

    def begin(self, inputs, normalizer, beta, epsilon_low, epsilon_high, count_targets=False):
        """A :class:`~dllm_trl.losses.LossCall` for one micro-batch."""

    def loss_chunks(self, model, inputs, steps: list[int]) -> list[list[int]]:
        """The sampled steps grouped into forwards."""

    def chunk_loss(self, model, inputs, steps, call) -> torch.Tensor:
        """The loss of one chunk of sampled steps (one forward)."""

    def stand_in(self, inputs) -> dict:
        """A one-row, one-state copy of a batch on which any pass of the loss makes exactly one forward's module
        calls (the lock-step partner of another process's pass: the same pass on it)."""

    def zero_loss(self, model, inputs, call=None) -> torch.Tensor:
        """A zero that still flows through the model: :meth:`chunk_loss` on :meth:`stand_in` with zero weight
        (lock-step padding, and DDP's graph when nothing has a target)."""

    def metric_sums(self, inputs, call) -> dict:
        """``name -> (sum, count, reduce)`` of the micro-batch's metrics."""

    def metric_extremes(self, inputs, call) -> dict:
        """``name -> (value, "max" | "min")`` of the micro-batch's metrics."""
