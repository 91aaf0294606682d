"""RLDF: Reinforcement Learning from Denoising Feedback (paper 1, SPEC §2) as tensor functions.

Shapes: ``B`` completions, ``G`` completion positions (the whole decoded region of the rollout), ``k``
sampled steps per completion, ``T`` decoding steps. ``commit_step`` (B, G) holds the row's step at which
each position was committed; ``valid_mask`` (B, G) marks the completion proper (up to the first EOS).
"""

from __future__ import annotations

import math

import torch

INVALID_STEP = -1
"""Padding value of ``sampled_steps`` for rows with fewer than ``k`` steps."""


def step_uncertainty(
    commit_step: torch.Tensor, commit_prob: torch.Tensor, valid_mask: torch.Tensor, num_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step uncertainty ``P_t = -(1/|I_t|) Σ_{i∈I_t} log prob[i]`` (Eq. 5) over valid tokens.

    Returns ``(P, has_tokens)``, both (B, num_steps); ``P`` is 0 where the step committed no valid token.
    """
    valid = valid_mask.bool() & (commit_step >= 0) & (commit_step < num_steps)
    index = torch.where(valid, commit_step, 0)
    neg_log = torch.where(valid, -torch.log(commit_prob.double().clamp_min(1e-30)), 0.0)
    total = torch.zeros(commit_step.shape[0], num_steps, dtype=torch.float64, device=commit_step.device)
    count = torch.zeros_like(total)
    total.scatter_add_(1, index, neg_log)
    count.scatter_add_(1, index, valid.double())
    has_tokens = count > 0
    return (total / count.clamp_min(1)).float(), has_tokens


def sample_timesteps(
    uncertainty: torch.Tensor,
    has_tokens: torch.Tensor,
    k: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw ``k`` steps per row without replacement from ``softmax(P / τ)`` (Eq. 6, Alg. 2).

    Gumbel-top-k: the top-k of ``P/τ + Gumbel`` is a draw without replacement from ``softmax(P/τ)``.
    ``τ = 0`` gives top-k by ``P``; ``τ = inf`` uniform. Rows with fewer than ``k`` steps get all of them.
    Returns (B, k) sorted ascending, padded with ``INVALID_STEP``.
    """
    if k < 1:
        raise ValueError(f"k={k} must be ≥ 1.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be ≥ 0.")
    rows, steps = uncertainty.shape
    if temperature == 0:
        scores = uncertainty.double()
    else:
        uniform = torch.rand(rows, steps, dtype=torch.float64, device=uncertainty.device, generator=generator)
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-300, 1 - 1e-16)))
        scores = gumbel if math.isinf(temperature) else uncertainty.double() / temperature + gumbel
    scores = scores.masked_fill(~has_tokens, float("-inf"))
    if steps < k:
        scores = torch.cat([scores, scores.new_full((rows, k - steps), float("-inf"))], dim=1)
    top = torch.topk(scores, k, dim=1)
    chosen = top.indices.masked_fill(torch.isinf(top.values), INVALID_STEP)
    # Sort so that valid steps come first in ascending order, padding last.
    key = torch.where(chosen == INVALID_STEP, torch.iinfo(torch.long).max, chosen)
    return chosen.gather(1, key.argsort(dim=1))


def noisy_state(rollout_ids: torch.Tensor, commit_step: torch.Tensor, t: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """``o_t``: every position with ``commit_step ≥ t`` masked — the canvas the sampler saw before step ``t``."""
    return torch.where(commit_step >= t.view(-1, 1), torch.full_like(rollout_ids, mask_token_id), rollout_ids)


def clean_target_mask(
    commit_step: torch.Tensor,
    valid_mask: torch.Tensor,
    t: torch.Tensor,
    clean_prob: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Clipped clean target ``Ô_t = I_t ∪ {i : step[i] > t, π(o_i | q, o_t) ≥ c}`` over valid tokens (Alg. 3)."""
    t = t.view(-1, 1)
    committed_now = commit_step == t
    predicted = (commit_step > t) & (clean_prob.detach() >= threshold)
    return (committed_now | predicted) & valid_mask.bool()


def sequential_target_mask(commit_step: torch.Tensor, valid_mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The ``x_{t-1}`` variant: only the tokens committed at ``t`` (``I_t``)."""
    return (commit_step == t.view(-1, 1)) & valid_mask.bool()


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token: ``exp(ref − cur) − (ref − cur) − 1``."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def corrected_k3_kl(
    logps: torch.Tensor, ref_logps: torch.Tensor, old_logps: torch.Tensor | None = None, bias_correction: bool = False
) -> torch.Tensor:
    """:func:`k3_kl`, with ``bias_correction`` weighted by ``π_θ/π_old`` with gradient as TRL's
    ``use_bias_correction_kl`` does (``π_old = π_θ`` detached when ``old_logps`` is ``None``: on-policy)."""
    kl = k3_kl(logps, ref_logps)
    if bias_correction:
        kl = kl * torch.exp(logps - (logps.detach() if old_logps is None else old_logps))
    return kl


def policy_token_terms(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token policy loss: REINFORCE ``−A log π`` (Eq. 8) without ``old_logps``, else PPO (Eq. 7).

    ``delta`` (TRL's two-sided clipping) caps the unclipped ratio as well. Returns ``(terms, ratio)``; ``ratio`` is
    ``None`` for REINFORCE.
    """
    advantages = advantages.view(-1, *([1] * (logps.dim() - 1)))
    if old_logps is None:
        return -advantages * logps, None
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.min(unclipped * advantages, clipped * advantages), ratio
