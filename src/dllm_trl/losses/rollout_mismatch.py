"""The rollout–training mismatch of a diffusion rollout's record, and TRL's importance-sampling corrections of it
(issue 24), as tensor functions.

The sampler records ``μ(a) = commit_prob``: the probability of each committed token under the distribution it was
drawn from (SPEC §1.3). A sampled state ``o_t`` of RLDF (or its ``sequential`` variant) is exactly the canvas the
sampler saw before step ``t`` (the replay check), so at the *recorded targets* — the tokens committed at ``t``,
``I_t`` — the training forward computes the same decision: ``π_old(a | q, o_t)`` under the sampler's processing
(temperature, the mask token excluded, top-k / top-p / min-p) equals ``μ(a)`` when the rollout is exact (no cache; a
block-diffusion model's cache of finished blocks) and differs by the Fast-dLLM approximation with a prefix or dual
cache on a bidirectional model.

The metrics are TRL's vLLM mismatch metrics over the recorded targets (``sampling/sampling_logp_difference/*``:
``|log π_old − log μ|``; ``sampling/importance_sampling_ratio/*``: ``π_old / μ``, as the correction applies it
when one is on) plus a per-token KL: ``sampling/kl_k3/*`` = ``r − 1 − log r`` with ``r = π_old(a)/μ(a)``, the k3
estimate of ``KL(μ ‖ π_old)`` from the token ``a ~ μ`` the rollout drew.

The corrections are TRL's (``GRPOTrainer``'s ``vllm_importance_sampling_*``): the policy term of every token is
multiplied by a detached ratio ``ρ``; ``token_*`` modes use each recorded target's own ``π_old/μ`` (targets that were
not drawn at ``o_t`` — RLDF's clean targets — have no record there: ``ρ = 1``); ``sequence_*`` modes use the
product over the row's recorded targets at its sampled states (the part of the trajectory the loss replays) for every
target of the row. ``*_truncate`` clamps ``ρ`` to ``[clip_min, clip_max]``; ``*_mask`` sets it to 0 outside.
"""

from __future__ import annotations

import torch

from ..generation.masked_diffusion import sampling_log_probs
from .rldf_terms import INVALID_STEP

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL's ``vllm_importance_sampling_mode`` values, with TRL's meaning."""

REPLAYING_ESTIMATORS = ("rldf", "sequential")
"""Estimators whose sampled states are the rollout's own canvases, so that the record applies to them."""


def recorded_targets(commit_step: torch.Tensor, valid_mask: torch.Tensor, sampled_steps: torch.Tensor) -> torch.Tensor:
    """(B, k, G) bool: the valid tokens committed at each sampled step ``t`` (``I_t``; none for padding steps)."""
    steps = sampled_steps.unsqueeze(-1)
    return (commit_step.unsqueeze(1) == steps) & (steps != INVALID_STEP) & valid_mask.bool().unsqueeze(1)


def record_logps(commit_prob: torch.Tensor) -> torch.Tensor:
    """``log μ(a)`` (B, G) from the recorded ``commit_prob``."""
    return commit_prob.float().clamp_min(1e-30).log()


def sampling_logps_view(at: torch.Tensor, targets: torch.Tensor, mask_token_id: int, temperature: float,
                        top_p: float | None, top_k: int | None, min_p: float | None):
    """An ``extra_view`` for :func:`~dllm_trl.models.scoring.chunked_token_logps_at`: the sampler's log-probability
    (:func:`~dllm_trl.generation.masked_diffusion.sampling_log_probs`) of ``targets`` (N,) at the read positions where ``at``
    (N,) is set, 0 elsewhere, without gradient. The head runs on those positions only (on none, it still runs once,
    so that every process calls it alike)."""

    def view(hidden, head):
        with torch.no_grad():
            index = at.nonzero().squeeze(1)
            log_probs = sampling_log_probs(head(hidden[index]), mask_token_id, temperature, top_p, top_k, min_p)
            picked = log_probs.gather(-1, targets[index].long().unsqueeze(-1)).squeeze(-1)
            return torch.zeros(at.shape, dtype=torch.float32, device=hidden.device).index_put((index,), picked)

    return view


def importance_sampling_ratio(train_logps: torch.Tensor, rollout_logps: torch.Tensor, recorded: torch.Tensor,
                              mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's corrected ratio ``ρ`` (B, k, G), detached (module docstring).

    ``train_logps`` (B, k, G): ``log π_old(a | q, o_t)`` under the sampler's processing, read at ``recorded``;
    ``rollout_logps`` (B, G): ``log μ(a)``; ``recorded`` (B, k, G): the recorded targets.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}: expected one of {IMPORTANCE_SAMPLING_MODES}.")
    diff = torch.where(recorded, train_logps.detach().float() - rollout_logps.unsqueeze(1), 0.0)
    sequence = mode.startswith("sequence")
    if sequence:
        diff = diff.sum(dim=(1, 2), keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        if clip_min is not None or clip_max is not None:
            ratio = ratio.clamp(min=clip_min, max=clip_max)
    else:
        low = -float("inf") if clip_min is None else clip_min
        high = float("inf") if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    if sequence:
        return ratio.expand(recorded.shape)
    return torch.where(recorded, ratio, 1.0)


def mismatch_metrics(train_logps: torch.Tensor, rollout_logps: torch.Tensor, scored: torch.Tensor,
                     applied_ratio: torch.Tensor | None = None, sequence: bool = False) -> tuple[dict, dict]:
    """The ``sampling/*`` metrics over the recorded targets ``scored`` (B, k, G) whose ``train_logps`` are known.

    Returns ``(sums, extremes)``: ``name -> (numerator, denominator, skip_when_empty)`` for the means and
    ``name -> (value or None when empty, "max" | "min")`` for the extremes. The ratio statistics are those of
    ``applied_ratio`` (B, k, G) when a correction is on (one value per row with ``sequence``), else of ``π_old/μ``.
    """
    diff = (train_logps.detach().float() - rollout_logps.unsqueeze(1))[scored]
    ratio = diff.exp()
    kl = ratio - 1 - diff
    if applied_ratio is not None:
        rows = scored.flatten(1).any(1)
        ratio = applied_ratio[:, 0, 0][rows] if sequence else applied_ratio[scored]
    count = torch.tensor(float(diff.numel()), device=diff.device)
    sums = {
        "sampling/sampling_logp_difference/mean": (diff.abs().sum(), count, True),
        "sampling/kl_k3/mean": (kl.sum(), count, True),
        "sampling/importance_sampling_ratio/mean": (ratio.sum(), torch.tensor(float(ratio.numel())), True),
    }

    def extreme(values, how):
        return (None if values.numel() == 0 else getattr(values, how)(), how)

    extremes = {
        "sampling/sampling_logp_difference/max": extreme(diff.abs(), "max"),
        "sampling/kl_k3/max": extreme(kl, "max"),
        "sampling/importance_sampling_ratio/min": extreme(ratio, "min"),
        "sampling/importance_sampling_ratio/max": extreme(ratio, "max"),
    }
    return sums, extremes
