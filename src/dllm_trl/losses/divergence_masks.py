"""Pure tensor math for divergence trust-region masks (SPEC §3, "Predictive Divergence Masks for LLM RL").

Everything here is a stateless function of tensors, batched over tokens of any leading shape ``(...)``.
Only :func:`gather_policy_view` touches the vocabulary axis; the rest works on the truncated support
``S = topK(μ) ∪ {a}`` of size ``K + 1`` slots, so the cost at V = 126k-152k is one ``gather`` on the single
full-vocabulary log-softmax the trainer already computes for ``log π_θ(a)``. The full-vocabulary references the
tests compare against live in the repository's ``tests/oracles.py``.

Notation (SPEC §3): ``μ`` behaviour (rollout) distribution, ``π`` current policy, ``a`` sampled token,
``r = π(a)/μ(a)``, ``A`` advantage. The masked policy gradient is

    loss = −Σ_tokens M · w · A · log π_θ(a),   w = stopgrad(min(r, C)),

with ``M = 0`` iff (proximity AND direction):

* ``ppo``:        proximity ``r < 1 − ε_low or r > 1 + ε_high``, direction ``A·(r − 1) > 0``;
* ``dppo``:       proximity ``D(μ‖π) > δ``, direction ``A·(r − 1) > 0``;
* ``predictive``: proximity ``D(μ‖π) > δ``, direction ``A·g > 0`` with ``g`` the directional
  derivative of ``D`` when the logits move along ``e_a − π`` (paper Eq. 7 / SPEC §3.2).

Support layout used throughout: slots ``0..K−1`` hold the behaviour top-K ids, slot ``K`` holds the
sampled token ``a``. Slot ``K`` is *valid* (part of ``S``) only when ``a`` is not among the top-K, so a
sampled token inside the top-K is never counted twice. Top-K ids ``< 0`` are padding (invalid slots).
Slot ``K`` always carries ``π(a)`` regardless of validity.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

from ..models.scoring import head_in_chunks

__all__ = [
    "EPS",
    "TruncatedView",
    "SupportLogProbs",
    "gather_policy_view",
    "support_log_probs",
    "support_mask",
    "truncated_view",
    "truncated_view_from_full",
    "topk_kl",
    "topk_tv",
    "binary_kl",
    "binary_tv",
    "divergence",
    "kl_direction",
    "tv_direction",
    "directional_derivative",
    "ratio_direction",
    "ppo_proximity",
    "divergence_proximity",
    "ppo_mask",
    "dppo_mask",
    "predictive_mask",
    "trust_region_mask",
    "masked_policy_gradient_terms",
]

EPS = 1e-12
_LOG_EPS = math.log(EPS)

DivergenceKind = Literal["kl", "tv"]
TailModel = Literal["aggregated", "uniform"]
MaskRule = Literal["ppo", "dppo", "predictive"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 inputs are upcast)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


# --------------------------------------------------------------------------------------------------
# Truncated view (SPEC §3.1)
# --------------------------------------------------------------------------------------------------
class TruncatedView(NamedTuple):
    """Behaviour / policy distributions restricted to ``S`` plus one tail bucket (SPEC §3.1).

    Shapes: slot tensors ``(..., K+1)``, the rest ``(...)``. Invalid slots hold 0 in every slot tensor.
    """

    mu: torch.Tensor  # μ_v on S (0 on invalid slots)
    pi: torch.Tensor  # π_v on S (0 on invalid slots)
    log_mu: torch.Tensor  # log μ_v, clamped to [log 1e-12, 0] (0 on invalid slots)
    log_pi: torch.Tensor  # log π_v, clamped to [log 1e-12, 0] (0 on invalid slots)
    valid: torch.Tensor  # bool, slot belongs to S
    mu_tail: torch.Tensor  # 1 − Σ_S μ, clamped ≥ 1e-12
    pi_tail: torch.Tensor  # 1 − Σ_S π, clamped ≥ 1e-12
    mu_a: torch.Tensor  # μ(a)
    pi_a: torch.Tensor  # π(a)
    support_size: torch.Tensor  # |S| (long)
    vocab_size: int | None  # V (needed by the uniform-tail estimator only)


def gather_policy_view(
    policy_logps: torch.Tensor, topk_ids: torch.Tensor, action: torch.Tensor
) -> torch.Tensor:
    """Gather ``log π`` at the support slots ``[topk_ids..., a]`` → ``(..., K+1)``.

    ``policy_logps (..., V)`` is the one full-vocabulary log-softmax of the forward pass (computed with
    the same temperature as the rollout); this is the only vocabulary-sized read. Padding ids (< 0)
    are gathered at id 0 and later marked invalid by :func:`support_mask`. The result is upcast to
    float32 (float64 if ``policy_logps`` is float64); gradients flow through unless the caller detaches.
    """
    dtype = _compute_dtype(policy_logps)
    ids = torch.cat([topk_ids.long(), action.long().unsqueeze(-1)], dim=-1).clamp(min=0)
    return policy_logps.gather(-1, ids).to(dtype)


class SupportLogProbs(NamedTuple):
    """What :func:`support_log_probs` reads of the sampling distribution at ``N`` positions."""

    support: torch.Tensor  # (N, K+1): log π at [ids..., a] of the sampling distribution (logits / T, excluded id -inf)
    raw_action: torch.Tensor  # (N,): plain log-softmax of the logits at a (no temperature, nothing excluded)
    own_logps: torch.Tensor | None  # (N, own_topk): the sampling distribution's own top-K log-probs (detached)
    own_ids: torch.Tensor | None  # (N, own_topk)


def support_log_probs(
    hidden: torch.Tensor,
    head,
    support_ids: torch.Tensor,
    action: torch.Tensor,
    *,
    temperature: float = 1.0,
    excluded_id: int | None = None,
    own_topk: int = 0,
    use_own: torch.Tensor | None = None,
    chunk_elements: int = 2**23,
) -> SupportLogProbs:
    """The policy's view at the support ``S`` of ``N`` positions, from their last hidden states ``(N, d)``.

    ``head`` maps hidden states to logits (the LM head). With ``own_topk`` the distribution's own top-K is returned
    too, and where ``use_own`` (N,) is set the support's first ``K`` ids are that top-K (on-policy: μ = π_old = π).
    The full-vocabulary logits exist for one chunk of positions at a time (about ``chunk_elements`` values, 32 MiB
    in float32), and in training each chunk is recomputed in the backward pass instead of kept, so memory grows with
    ``N × K``, not ``N × V`` (the equivalent of TRL's chunked LM head for a ``K + 1`` support).
    """

    def chunk(h, ids, a, own):
        logits = head(h).float()
        raw = logits.gather(-1, a.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        scaled = logits / temperature
        if excluded_id is not None:
            scaled = scaled.index_fill(-1, torch.tensor([excluded_id], device=scaled.device), float("-inf"))
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        own_logps = own_ids = None
        if own_topk:
            with torch.no_grad():
                values, own_ids = scaled.topk(own_topk, dim=-1)
                own_logps = values - lse
            ids = torch.where(own.unsqueeze(-1), own_ids, ids)
        slots = torch.cat([ids.long().clamp(min=0), a.long().unsqueeze(-1)], dim=-1)
        return scaled.gather(-1, slots) - lse, raw, own_logps, own_ids

    n = hidden.shape[0]
    if use_own is None:
        use_own = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    return SupportLogProbs(*head_in_chunks(chunk, head, chunk_elements, hidden, support_ids, action, use_own))


def support_mask(topk_ids: torch.Tensor, action: torch.Tensor, binary: bool = False) -> torch.Tensor:
    """Validity of the ``K+1`` slots: top-K ids ``≥ 0`` plus slot ``K`` iff ``a ∉ topK``.

    With ``binary=True`` (or ``K = 0``) the support is ``S = {a}``: only slot ``K`` is valid.
    """
    action = action.long()
    if binary:
        valid = torch.zeros(topk_ids.shape[:-1] + (topk_ids.shape[-1] + 1,), dtype=torch.bool, device=topk_ids.device)
        valid[..., -1] = True
        return valid
    topk_valid = topk_ids >= 0
    in_topk = ((topk_ids.long() == action.unsqueeze(-1)) & topk_valid).any(dim=-1)
    return torch.cat([topk_valid, (~in_topk).unsqueeze(-1)], dim=-1)


def truncated_view(
    mu_topk_ids: torch.Tensor,
    mu_topk_logps: torch.Tensor,
    action: torch.Tensor,
    mu_action_logp: torch.Tensor,
    pi_support_logps: torch.Tensor,
    *,
    vocab_size: int | None = None,
    binary: bool = False,
) -> TruncatedView:
    """Build the truncated view of μ and π on ``S = topK(μ) ∪ {a}`` plus a tail bucket (SPEC §3.1).

    Args:
        mu_topk_ids: ``(..., K)`` behaviour top-K token ids (``< 0`` = padding).
        mu_topk_logps: ``(..., K)`` behaviour log-probs at those ids.
        action: ``(...)`` sampled token ids.
        mu_action_logp: ``(...)`` behaviour log-prob of the sampled token (used for ``μ_a``; when
            ``a ∈ topK`` the top-K entry is the one summed over ``S``).
        pi_support_logps: ``(..., K+1)`` from :func:`gather_policy_view`.
        vocab_size: V, only needed by the uniform-tail estimator.
        binary: use ``S = {a}`` (DPPO's binary approximation, "K = 0").

    Tail masses ``μ_tail = 1 − Σ_S μ``, ``π_tail = 1 − Σ_S π`` are clamped ≥ 1e-12. Computation is in
    float32, or float64 when any input is float64. Invalid slots cannot poison sums (``where``, not
    multiplication, removes them, so NaN/−inf padding is harmless).
    """
    dtype = _compute_dtype(mu_topk_logps, mu_action_logp, pi_support_logps)
    k = mu_topk_ids.shape[-1]
    if pi_support_logps.shape[-1] != k + 1:
        raise ValueError(f"pi_support_logps must have K+1={k + 1} slots, got {pi_support_logps.shape[-1]}")
    valid = support_mask(mu_topk_ids, action, binary=binary or k == 0)
    mu_action_logp = mu_action_logp.to(dtype)
    mu_logp = torch.cat([mu_topk_logps.to(dtype), mu_action_logp.unsqueeze(-1)], dim=-1)
    pi_logp = pi_support_logps.to(dtype)

    zero = torch.zeros((), dtype=dtype, device=mu_logp.device)
    mu_logp_c = mu_logp.clamp(max=0.0)
    pi_logp_c = pi_logp.clamp(max=0.0)
    mu = torch.where(valid, mu_logp_c.exp(), zero)
    pi = torch.where(valid, pi_logp_c.exp(), zero)
    log_mu = torch.where(valid, mu_logp_c.clamp(min=_LOG_EPS), zero)
    log_pi = torch.where(valid, pi_logp_c.clamp(min=_LOG_EPS), zero)

    pi_a_logp = pi_logp_c[..., -1]
    mu_a_logp = mu_action_logp.clamp(max=0.0)
    if binary or k == 0:
        # 1 − p via expm1: exact near p ≈ 1, the common case for LLM tokens.
        mu_tail = -torch.expm1(mu_a_logp)
        pi_tail = -torch.expm1(pi_a_logp)
    else:
        mu_tail = 1.0 - mu.sum(dim=-1)
        pi_tail = 1.0 - pi.sum(dim=-1)
    return TruncatedView(
        mu=mu,
        pi=pi,
        log_mu=log_mu,
        log_pi=log_pi,
        valid=valid,
        mu_tail=mu_tail.clamp(min=EPS),
        pi_tail=pi_tail.clamp(min=EPS),
        mu_a=mu_a_logp.exp(),
        pi_a=pi_a_logp.exp(),
        support_size=valid.sum(dim=-1),
        vocab_size=vocab_size,
    )


def truncated_view_from_full(
    policy_logps: torch.Tensor,
    mu_topk_ids: torch.Tensor,
    mu_topk_logps: torch.Tensor,
    action: torch.Tensor,
    mu_action_logp: torch.Tensor,
    *,
    binary: bool = False,
) -> TruncatedView:
    """Convenience: :func:`gather_policy_view` + :func:`truncated_view` (V read from ``policy_logps``)."""
    pi_support = gather_policy_view(policy_logps, mu_topk_ids, action)
    return truncated_view(
        mu_topk_ids,
        mu_topk_logps,
        action,
        mu_action_logp,
        pi_support,
        vocab_size=policy_logps.shape[-1],
        binary=binary,
    )


# --------------------------------------------------------------------------------------------------
# Divergences (SPEC §3.1, paper Eq. 5)
# --------------------------------------------------------------------------------------------------
def topk_kl(view: TruncatedView) -> torch.Tensor:
    """Top-K KL ``Σ_S μ log(μ/π) + μ_tail log(μ_tail/π_tail)`` (paper Eq. 5; a lower bound of KL(μ‖π)).

    On a binary view (``S = {a}``) this is the binary KL
    ``μ_a log(μ_a/π_a) + (1−μ_a) log((1−μ_a)/(1−π_a))``.
    """
    terms = torch.where(view.valid & (view.mu > 0), view.mu * (view.log_mu - view.log_pi), 0.0)
    tail = view.mu_tail * (view.mu_tail.log() - view.pi_tail.log())
    return terms.sum(dim=-1) + tail


def topk_tv(view: TruncatedView) -> torch.Tensor:
    """Top-K TV ``½ (Σ_S |π − μ| + |π_tail − μ_tail|)``; on a binary view it equals ``|π_a − μ_a|``."""
    terms = torch.where(view.valid, (view.pi - view.mu).abs(), 0.0)
    return 0.5 * (terms.sum(dim=-1) + (view.pi_tail - view.mu_tail).abs())


def binary_kl(pi_a: torch.Tensor, mu_a: torch.Tensor) -> torch.Tensor:
    """Binary KL over ``{a, not a}`` from probabilities (log arguments clamped ≥ 1e-12)."""
    pi_a, mu_a = pi_a.clamp(0.0, 1.0), mu_a.clamp(0.0, 1.0)
    mu_n, pi_n = 1.0 - mu_a, 1.0 - pi_a
    t1 = torch.where(mu_a > 0, mu_a * (mu_a.clamp(min=EPS).log() - pi_a.clamp(min=EPS).log()), 0.0)
    t2 = torch.where(mu_n > 0, mu_n * (mu_n.clamp(min=EPS).log() - pi_n.clamp(min=EPS).log()), 0.0)
    return t1 + t2


def binary_tv(pi_a: torch.Tensor, mu_a: torch.Tensor) -> torch.Tensor:
    """Binary TV ``|π_a − μ_a|``."""
    return (pi_a - mu_a).abs()


def divergence(view: TruncatedView, kind: DivergenceKind = "kl") -> torch.Tensor:
    """Top-K (or, on a binary view, binary) KL or TV of the view."""
    if kind == "kl":
        return topk_kl(view)
    if kind == "tv":
        return topk_tv(view)
    raise ValueError(f"unknown divergence kind {kind!r}")


# --------------------------------------------------------------------------------------------------
# Directional derivative along e_a − π (SPEC §3.2, paper Eq. 7, 10, 11, App. D)
# --------------------------------------------------------------------------------------------------
def _tail_weight(view: TruncatedView, tail: TailModel) -> torch.Tensor | float:
    if tail == "aggregated":
        return 1.0
    if tail == "uniform":
        if view.vocab_size is None:
            raise ValueError("the uniform-tail estimator needs vocab_size")
        n_unseen = (view.vocab_size - view.support_size).clamp(min=1)
        return 1.0 / n_unseen.to(view.pi.dtype)
    raise ValueError(f"unknown tail model {tail!r}")


def kl_direction(view: TruncatedView, tail: TailModel = "aggregated") -> torch.Tensor:
    """Estimate ``g = (π_a − μ_a) − Σ_v π_v(π_v − μ_v)`` of KL(μ‖π) from the truncated view.

    * ``aggregated`` (paper Eq. 10): the tail is one token,
      ``g_agg = (π_a − μ_a) − [Σ_S π_v(π_v − μ_v) + π_tail(π_tail − μ_tail)]``;
    * ``uniform`` (paper Eq. 11): the tail mass is spread over the ``V − |S|`` unseen tokens,
      ``g_uni = (π_a − μ_a) − [Σ_S π_v(π_v − μ_v) + π_tail(π_tail − μ_tail)/(V − |S|)]``.

    These estimate the full-vocabulary ``g`` (``tests/oracles.py``'s ``kl_direction_full``); they are not
    derivatives of the top-K KL. On a binary view ``g_agg = 2(1 − π_a)(π_a − μ_a)`` (paper App. C).
    """
    w = _tail_weight(view, tail)
    seen = torch.where(view.valid, view.pi * (view.pi - view.mu), 0.0).sum(dim=-1)
    unseen = view.pi_tail * (view.pi_tail - view.mu_tail)
    return (view.pi_a - view.mu_a) - (seen + w * unseen)


def tv_direction(view: TruncatedView, tail: TailModel = "aggregated") -> torch.Tensor:
    """Estimate the TV directional derivative (``tests/oracles.py``'s ``tv_direction_full``) from the truncated view.

    With ``s_v = sign(π_v − μ_v)`` on ``S``, ``s_t = sign(π_tail − μ_tail)`` and
    ``s̄ = Σ_S s_v π_v + s_t π_tail`` (the same under both tail models, since a uniform tail keeps the
    sign and total mass):

    ``g_TV = ½ [ (s_a − s̄) π_a − Σ_S π_v² (s_v − s̄) − c · π_tail² (s_t − s̄) ]``

    with ``c = 1`` (aggregated: tail is one token) or ``c = 1/(V − |S|)`` (uniform: ``V − |S|`` tokens
    of mass ``π_tail/(V − |S|)`` each). On a binary view ``g_agg = 2 s_a π_a (1 − π_a)²``, whose sign
    is again the ratio direction ``sign(r − 1)``.
    """
    w = _tail_weight(view, tail)
    s = torch.where(view.valid, torch.sign(view.pi - view.mu), 0.0)
    s_t = torch.sign(view.pi_tail - view.mu_tail)
    s_a = torch.sign(view.pi_a - view.mu_a)
    s_bar = (s * view.pi).sum(dim=-1) + s_t * view.pi_tail
    seen = torch.where(view.valid, view.pi.square() * (s - s_bar.unsqueeze(-1)), 0.0).sum(dim=-1)
    unseen = view.pi_tail.square() * (s_t - s_bar)
    return 0.5 * ((s_a - s_bar) * view.pi_a - seen - w * unseen)


def directional_derivative(
    view: TruncatedView, kind: DivergenceKind = "kl", tail: TailModel = "aggregated"
) -> torch.Tensor:
    """Dispatch to :func:`kl_direction` / :func:`tv_direction`."""
    if kind == "kl":
        return kl_direction(view, tail)
    if kind == "tv":
        return tv_direction(view, tail)
    raise ValueError(f"unknown divergence kind {kind!r}")


# --------------------------------------------------------------------------------------------------
# Masks (SPEC §3; keep = NOT(proximity AND direction))
# --------------------------------------------------------------------------------------------------
def ratio_direction(log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Ratio direction ``A·(r − 1) > 0``, evaluated as ``A·sign(log r) > 0`` (no exp overflow)."""
    return advantages * torch.sign(log_ratio) > 0


def ppo_proximity(log_ratio: torch.Tensor, eps_low: float, eps_high: float | None = None) -> torch.Tensor:
    """PPO proximity ``r < 1 − ε_low or r > 1 + ε_high`` (``ε_high`` defaults to ``ε_low``)."""
    eps_high = eps_low if eps_high is None else eps_high
    r = log_ratio.to(_compute_dtype(log_ratio)).exp()
    return (r < 1.0 - eps_low) | (r > 1.0 + eps_high)


def divergence_proximity(
    div: torch.Tensor,
    advantages: torch.Tensor,
    delta: float | torch.Tensor | None = None,
    delta_low: float | torch.Tensor | None = None,
    delta_high: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``D > δ`` with ``δ_high`` on ``A > 0`` tokens and ``δ_low`` otherwise (both default to ``δ``)."""
    delta_low = delta if delta_low is None else delta_low
    delta_high = delta if delta_high is None else delta_high
    if delta_low is None or delta_high is None:
        raise ValueError("a divergence threshold (delta, or delta_low and delta_high) is required")
    threshold = torch.where(
        advantages > 0,
        torch.as_tensor(delta_high, dtype=div.dtype, device=div.device),
        torch.as_tensor(delta_low, dtype=div.dtype, device=div.device),
    )
    return div > threshold


def ppo_mask(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2, eps_high: float | None = None
) -> torch.Tensor:
    """PPO keep-mask: drop iff ``|r − 1|`` outside ``[−ε_low, ε_high]`` AND ``A·(r − 1) > 0``."""
    return ~(ppo_proximity(log_ratio, eps_low, eps_high) & ratio_direction(log_ratio, advantages))


def dppo_mask(
    div: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    delta: float | torch.Tensor | None = None,
    delta_low: float | torch.Tensor | None = None,
    delta_high: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """DPPO keep-mask: drop iff ``D > δ`` AND ``A·(r − 1) > 0``: the predictive mask with the ratio's direction
    ``sign(log r)`` in place of ``g`` (:func:`ratio_direction`)."""
    return predictive_mask(div, torch.sign(log_ratio), advantages, delta, delta_low, delta_high)


def predictive_mask(
    div: torch.Tensor,
    direction: torch.Tensor,
    advantages: torch.Tensor,
    delta: float | torch.Tensor | None = None,
    delta_low: float | torch.Tensor | None = None,
    delta_high: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Predictive divergence keep-mask: drop iff ``D > δ`` AND ``A·g > 0`` (paper Eq. 13)."""
    prox = divergence_proximity(div, advantages, delta, delta_low, delta_high)
    return ~(prox & (advantages * direction > 0))


def trust_region_mask(
    rule: MaskRule,
    *,
    advantages: torch.Tensor,
    log_ratio: torch.Tensor | None = None,
    div: torch.Tensor | None = None,
    direction: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    delta: float | torch.Tensor | None = None,
    delta_low: float | torch.Tensor | None = None,
    delta_high: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean keep-mask (True = token contributes) for ``rule`` in ``{"ppo", "dppo", "predictive"}``.

    Needs ``log_ratio = log π_θ(a) − log μ(a)`` for ppo/dppo, ``div`` for dppo/predictive and the
    directional derivative ``direction`` (``g``) for predictive. Pass detached tensors.
    """
    if rule == "ppo":
        if log_ratio is None:
            raise ValueError("ppo needs log_ratio")
        return ppo_mask(log_ratio, advantages, eps_low, eps_high)
    if rule == "dppo":
        if log_ratio is None or div is None:
            raise ValueError("dppo needs log_ratio and div")
        return dppo_mask(div, log_ratio, advantages, delta, delta_low, delta_high)
    if rule == "predictive":
        if direction is None or div is None:
            raise ValueError("predictive needs direction and div")
        return predictive_mask(div, direction, advantages, delta, delta_low, delta_high)
    raise ValueError(f"unknown mask rule {rule!r}")


# --------------------------------------------------------------------------------------------------
# Loss terms
# --------------------------------------------------------------------------------------------------
def masked_policy_gradient_terms(
    logp_action: torch.Tensor,
    mu_logp_action: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    is_cap: float | None = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token terms ``−keep · w · A · log π_θ(a)`` and the weights ``w`` (SPEC §3).

    ``w = stopgrad(min(exp(log π_θ(a) − log μ(a)), C))`` is the truncated importance weight (no PPO
    min/clip; ``is_cap=None`` disables truncation). Masked tokens give exactly 0 and a zero gradient,
    even when their inputs are non-finite. Aggregate the terms with the trainer's loss-type options.
    """
    dtype = _compute_dtype(logp_action, mu_logp_action)
    with torch.no_grad():
        w = (logp_action.detach().to(dtype) - mu_logp_action.detach().to(dtype)).exp()
        if is_cap is not None:
            w = w.clamp(max=is_cap)
        coef = torch.where(keep, w * advantages.detach().to(dtype), 0.0)
    terms = torch.where(keep, -coef * logp_action, 0.0)
    return terms, w

