"""Per-token policy estimators of a masked diffusion LM (SPEC §2.2–2.4, paper 1 App. A) as tensor functions.

The exact log-likelihood of a completion is intractable for a diffusion LM, so the policy gradient reads
``log π(o_i | c)`` at some context ``c``: a *state* (the prompt, possibly partly masked, and the completion with
some positions replaced by ``M``), a *target set* (the positions whose log-probability enters the loss) and a
per-token *weight*. The four estimators differ only in these three things:

=================  ===================================================  ==========================  ============
estimator          states of a completion                               targets of a state          weight
=================  ===================================================  ==========================  ============
``rldf``           ``k`` sampled trajectory states ``o_t`` (§2.1–2.2)    ``Ô_t = I_t ∪ {π_old ≥ c}``  1
``sequential``     the same ``o_t``                                     ``I_t`` (the x_{t−1} view)  1
``all_masking``    one: the whole completion masked (= ``o_0``),        every valid token           1
                   prompt tokens masked with prob. ``p`` (d1)
``random_masking`` one (two with the complementary pair): each          the masked valid tokens     ``1/π_i``
                   completion position masked with prob. ``t``
=================  ===================================================  ==========================  ============

How the batch carries a completion's states: ``sampled_steps`` (B, k) holds one entry per state, ``INVALID_STEP``
for padding. For the trajectory estimators the entry is the decoding step ``t``; for the other two it is a
*state id* (``all_masking``: 0; ``random_masking``: 0 = the drawn mask, 1 = its complement), and
:func:`estimator_steps` builds those entries at rollout time (marking states without any target as padding, so
they cost no forward pass).

Randomness: every random choice of a row (its mask ratio, which positions are masked, which prompt tokens are
masked) is a function of the row's ``mask_seed`` only (an int64 drawn at rollout time and carried in the batch),
through :func:`row_draws`. The old-policy, reference and current passes, every PPO iteration and every
gradient-accumulation micro-batch therefore see exactly the same states. The draws of one row, from a CPU
``torch.Generator`` seeded with its ``mask_seed``, in this order:

1. ``r`` (one float64): the mask ratio ``t = ε + (1 − ε)(1 − r) ∈ (ε, 1]``;
2. ``u`` (``G`` float64): completion position ``i`` is masked iff ``u_i < t``;
3. ``v`` (``P`` float64): prompt token ``P − 1 − n`` (counted from the right end, prompts are left-padded) is
   masked iff ``v_n < p``; padding is never masked.

``random_masking`` guarantees at least one masked *valid* token: when no valid ``u_i < t``, the valid position
with the smallest ``u_i`` is masked. Positions after the completion (after the first EOS) are masked with the same
rule (the model sees the decoded region as it was pre-trained: answer and EOS padding, each masked with prob.
``t``) but are never targets. The weight is the inverse of the exact probability that a valid token is a target,
``π(t, L) = t + (1 − t)^L / L`` for the drawn mask (``L`` valid tokens; ``= t`` but for the at-least-one rule,
so this is the ELBO's ``1/t`` corrected for that rule and bounded by ``L``), and ``1 − π`` for its complement.
Then ``Σ_{i∈targets} w_i ℓ_i`` is an unbiased estimate of ``Σ_{i valid} ℓ_i`` (``E`` over ``u`` at fixed ``t``).
The trainer normalises by the weighted target count (``Σ w``), so with unit weights its conventions are
unchanged; under "sample" normalisation the weights of a state cancel (paper 1 Eq. 16's ``1/|M|``), under
"token" normalisation every completion counts as ``≈ L`` tokens whatever its mask ratio.

Block-diffusion models (``block_size``, SPEC §7): a state ``o_t`` is decoded inside one attention block, and its
targets and candidates are that block's positions only (:func:`~dllm_trl.losses.packed_states.in_state_block`):
the later blocks are masked in ``o_t`` but the rollout step never read them, and the packed forward that scores all
states at once has no copy of them. Only the trajectory estimators have a block form.
"""

from __future__ import annotations

import torch

from .packed_states import in_state_block
from .rldf_terms import INVALID_STEP, clean_target_mask, noisy_state, sequential_target_mask

ESTIMATORS = ("rldf", "sequential", "all_masking", "random_masking")
"""Values of ``RLDFConfig.policy_estimator``."""
TRAJECTORY_ESTIMATORS = ("rldf", "sequential")
"""Estimators whose states are the rollout's sampled denoising states ``o_t``."""
RANDOM_MASK_EPS = 1e-3
"""``ε``: the smallest mask ratio of ``random_masking`` (as in the toy model's pre-training)."""


def num_states(estimator: str, k: int, complementary: bool = False) -> int:
    """States per completion: ``k`` (trajectory estimators), 1 (``all_masking``), 1 or 2 (``random_masking``)."""
    _check(estimator)
    if estimator in TRAJECTORY_ESTIMATORS:
        return k
    if estimator == "all_masking":
        return 1
    return 2 if complementary else 1


def _check(estimator: str):
    if estimator not in ESTIMATORS:
        raise ValueError(f"policy_estimator={estimator!r}: expected one of {ESTIMATORS}.")


def row_draws(
    mask_seed: torch.Tensor, gen_length: int, prompt_length: int = 0, eps: float = RANDOM_MASK_EPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The random numbers of each row, a function of its ``mask_seed`` only (see the module docstring).

    Returns ``(ratio (B,), u (B, G), v (B, P))`` in float64 on ``mask_seed``'s device; ``v[:, n]`` belongs to
    prompt column ``P − 1 − n``.
    """
    if not 0.0 < eps <= 1.0:
        raise ValueError(f"eps={eps} must lie in (0, 1].")
    rows = mask_seed.shape[0]
    ratio = torch.empty(rows, dtype=torch.float64)
    u = torch.empty(rows, gen_length, dtype=torch.float64)
    v = torch.empty(rows, prompt_length, dtype=torch.float64)
    generator = torch.Generator()
    for b, seed in enumerate(mask_seed.tolist()):
        generator.manual_seed(int(seed))
        r = torch.rand(1, dtype=torch.float64, generator=generator)
        ratio[b] = eps + (1.0 - eps) * (1.0 - r)
        u[b] = torch.rand(gen_length, dtype=torch.float64, generator=generator)
        v[b] = torch.rand(prompt_length, dtype=torch.float64, generator=generator)
    device = mask_seed.device
    return ratio.to(device), u.to(device), v.to(device)


def random_completion_mask(u: torch.Tensor, ratio: torch.Tensor, valid_mask: torch.Tensor) -> torch.Tensor:
    """(B, G) bool: ``u_i < t`` at every completion position, plus — where that masks no valid token — the valid
    position with the smallest ``u`` (rows without any valid token are left as drawn)."""
    valid = valid_mask.bool()
    masked = u < ratio.view(-1, 1)
    none = ~(masked & valid).any(1) & valid.any(1)
    first = torch.where(valid, u, float("inf")).argmin(1)
    forced = torch.zeros_like(masked)
    forced[none, first[none]] = True
    return masked | forced


def inclusion_probability(ratio: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
    """``π(t, L) = t + (1 − t)^L / L``: probability that a given valid token is masked by
    :func:`random_completion_mask` (``L ≥ 1`` valid tokens; 1 where ``L ≤ 1``). Float64, shape of ``ratio``."""
    ratio = ratio.double()
    n = num_valid.double().clamp_min(1)
    return torch.where(num_valid <= 1, torch.ones_like(ratio), ratio + (1 - ratio) ** n / n)


def masked_prompt(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, v: torch.Tensor, prob: float, mask_token_id: int
) -> torch.Tensor:
    """Prompt tokens (``prompt_mask = 1``) replaced by ``M`` where their draw ``v < prob`` (``v`` right-aligned)."""
    if prob <= 0:
        return prompt_ids
    drop = (v.flip(1) < prob) & prompt_mask.bool()
    return torch.where(drop, torch.full_like(prompt_ids, mask_token_id), prompt_ids)


def estimator_steps(
    estimator: str,
    sampled_steps: torch.Tensor,
    valid_mask: torch.Tensor,
    mask_seed: torch.Tensor | None = None,
    complementary: bool = False,
    eps: float = RANDOM_MASK_EPS,
) -> torch.Tensor:
    """The ``sampled_steps`` entries (B, k) the batch carries for ``estimator``.

    Trajectory estimators: the sampled decoding steps unchanged. ``all_masking``: (B, 1) state 0, padding for rows
    without a valid token. ``random_masking``: (B, 1) state 0, or (B, 2) states 0 and 1 (complement), each padding
    where it has no target.
    """
    _check(estimator)
    if estimator in TRAJECTORY_ESTIMATORS:
        return sampled_steps
    valid = valid_mask.bool()
    rows, device = valid.shape[0], sampled_steps.device
    has_valid = valid.any(1)
    if estimator == "all_masking":
        state = torch.zeros(rows, 1, dtype=torch.long, device=device)
        return state.masked_fill(~has_valid.unsqueeze(1).to(device), INVALID_STEP)
    ratio, u, _ = row_draws(mask_seed, valid.shape[1], 0, eps)
    masked = random_completion_mask(u, ratio, valid)
    has = [(masked & valid).any(1)]
    if complementary:
        has.append((~masked & valid).any(1))
    states = torch.arange(len(has), device=device).expand(rows, -1)
    return states.masked_fill(~torch.stack(has, 1).to(device), INVALID_STEP).clone()


def estimator_state(
    estimator: str,
    *,
    rollout_ids: torch.Tensor,
    commit_step: torch.Tensor,
    valid_mask: torch.Tensor,
    step: torch.Tensor,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    mask_token_id: int,
    mask_seed: torch.Tensor | None = None,
    prompt_mask_prob: float = 0.0,
    eps: float = RANDOM_MASK_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids, completion state)`` of one state per row: ``step`` (B,) is the row's ``sampled_steps`` entry.

    ``rldf`` / ``sequential``: the prompt and ``o_t`` (:func:`~dllm_trl.losses.rldf_terms.noisy_state`). ``all_masking``:
    every completion position masked (``o_0``), prompt tokens masked with prob. ``prompt_mask_prob``.
    ``random_masking``: state 0 masks :func:`random_completion_mask`, state 1 exactly the other positions.
    Rows whose entry is padding get some state (the callers skip them).
    """
    _check(estimator)
    if estimator in TRAJECTORY_ESTIMATORS:
        return prompt_ids, noisy_state(rollout_ids, commit_step, step, mask_token_id)
    mask = torch.full_like(rollout_ids, mask_token_id)
    if estimator == "all_masking":
        if prompt_mask_prob > 0:
            _, _, v = row_draws(mask_seed, rollout_ids.shape[1], prompt_ids.shape[1], eps)
            prompt_ids = masked_prompt(prompt_ids, prompt_mask, v, prompt_mask_prob, mask_token_id)
        return prompt_ids, mask
    masked = _random_state_mask(rollout_ids.shape[1], valid_mask, step, mask_seed, eps)[0]
    return prompt_ids, torch.where(masked, mask, rollout_ids)


def _random_state_mask(gen_length, valid_mask, step, mask_seed, eps):
    ratio, u, _ = row_draws(mask_seed, gen_length, 0, eps)
    masked = random_completion_mask(u, ratio, valid_mask)
    complement = (step == 1).view(-1, 1).to(masked.device)
    prob = inclusion_probability(ratio, valid_mask.bool().sum(1).to(ratio.device))
    prob = torch.where(complement.squeeze(1), 1 - prob, prob)
    return torch.where(complement, ~masked, masked), prob


def _check_block(estimator: str, block_size: int | None) -> None:
    if block_size is not None and estimator not in TRAJECTORY_ESTIMATORS:
        raise ValueError(
            f"policy_estimator={estimator!r} has no block-diffusion form: its states mask every block at once, which a "
            f"block-diffusion model never decodes from; use one of {TRAJECTORY_ESTIMATORS}."
        )


def estimator_targets(
    estimator: str,
    *,
    commit_step: torch.Tensor,
    valid_mask: torch.Tensor,
    step: torch.Tensor,
    mask_seed: torch.Tensor | None = None,
    clean_prob: torch.Tensor | None = None,
    clean_threshold: float = 0.2,
    eps: float = RANDOM_MASK_EPS,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(targets (B, G) bool, weights (B, G) float32 or None)`` of one state per row (``step`` as in
    :func:`estimator_state`); targets are empty where ``step`` is padding. ``clean_prob`` (detached ``π_old`` of
    the rollout tokens at the state) is read by ``rldf`` only. ``weights`` is ``None`` (all ones) but for
    ``random_masking``: ``1/π`` on its targets, 0 elsewhere (see the module docstring). ``block_size``: a
    block-diffusion model's, restricting the targets to the state's block.
    """
    _check(estimator)
    _check_block(estimator, block_size)
    live = (step != INVALID_STEP).view(-1, 1)
    if block_size is not None:
        live = live & in_state_block(commit_step, step, block_size)
    valid = valid_mask.bool()
    if estimator == "rldf":
        return clean_target_mask(commit_step, valid_mask, step, clean_prob, clean_threshold) & live, None
    if estimator == "sequential":
        return sequential_target_mask(commit_step, valid_mask, step) & live, None
    if estimator == "all_masking":
        return valid & live, None
    masked, prob = _random_state_mask(valid.shape[1], valid_mask, step, mask_seed, eps)
    targets = masked.to(valid.device) & valid & live
    weights = torch.where(targets, (1.0 / prob.clamp_min(1e-12)).float().view(-1, 1).to(valid.device), 0.0)
    return targets, weights


def estimator_candidates(
    estimator: str,
    *,
    commit_step: torch.Tensor,
    valid_mask: torch.Tensor,
    step: torch.Tensor,
    mask_seed: torch.Tensor | None = None,
    eps: float = RANDOM_MASK_EPS,
    block_size: int | None = None,
) -> torch.Tensor:
    """(B, G) bool: every position that can be a target of the state (``step`` as in :func:`estimator_state`).

    ``rldf``: ``I_t`` and every still-masked valid token (``Ô_t`` picks among them by ``π_old ≥ c``) — of the
    state's block with a ``block_size``. The other estimators' targets do not depend on ``π_old``: their candidates
    are their targets.
    """
    if estimator != "rldf":
        return estimator_targets(
            estimator, commit_step=commit_step, valid_mask=valid_mask, step=step, mask_seed=mask_seed, eps=eps,
            block_size=block_size,
        )[0]
    live = (step != INVALID_STEP).view(-1, 1)
    if block_size is not None:
        live = live & in_state_block(commit_step, step, block_size)
    return (commit_step >= step.view(-1, 1)) & valid_mask.bool() & live
