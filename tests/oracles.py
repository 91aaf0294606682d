"""Full-vocabulary references for the truncated estimators of :mod:`dllm_trl.losses.divergence_masks`, and the per-token
mask statistics that :class:`~dllm_trl.trainers.DPPOMaskTrainer` logs (``dppo/*``), over one batch in one process.

They read the whole vocabulary ``(..., V)``: exact, and affordable for tests and small vocabularies only (tests and
benchmarks import them; not part of the installed package).
"""

from __future__ import annotations

import math

import torch

from dllm_trl.losses.divergence_masks import EPS

_LOG_EPS = math.log(EPS)


def full_kl(mu_logps: torch.Tensor, pi_logps: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary ``KL(μ‖π)`` from log-probs ``(..., V)``."""
    mu = mu_logps.exp()
    return torch.where(mu > 0, mu * (mu_logps - pi_logps.clamp(min=_LOG_EPS)), 0.0).sum(dim=-1)


def full_tv(mu_logps: torch.Tensor, pi_logps: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary ``½ Σ_v |π_v − μ_v|``."""
    return 0.5 * (pi_logps.exp() - mu_logps.exp()).abs().sum(dim=-1)


def kl_direction_full(pi_logps: torch.Tensor, mu_logps: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Exact ``g = d/dh KL(μ ‖ softmax(z + h(e_a − π)))|_{h=0}`` from full log-probs ``(..., V)``.

    ``∂KL/∂z_j = π_j − μ_j``, so ``g = Σ_j (π_j − μ_j)(δ_ja − π_j) = (π_a − μ_a) − Σ_v π_v(π_v − μ_v)``
    (SPEC §3.2, paper Eq. 7); :func:`~dllm_trl.losses.divergence_masks.kl_direction` estimates it from the top-K.
    """
    pi, mu = pi_logps.exp(), mu_logps.exp()
    idx = action.long().unsqueeze(-1)
    local = (pi.gather(-1, idx) - mu.gather(-1, idx)).squeeze(-1)
    return local - (pi * (pi - mu)).sum(dim=-1)


def tv_direction_full(pi_logps: torch.Tensor, mu_logps: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Exact directional derivative of ``TV = ½ Σ_v |π_v − μ_v|`` along ``u = e_a − π`` (paper App. D).

    Derivation (``s_v = sign(π_v − μ_v)``, sign(0) := 0, i.e. valid away from kinks ``π_v = μ_v``):
    ``∂π_v/∂z_j = π_v(δ_vj − π_j)`` so
    ``∂TV/∂z_j = ½ Σ_v s_v π_v(δ_vj − π_j) = ½ π_j (s_j − s̄)`` with ``s̄ = Σ_v s_v π_v``.
    Along ``u_j = δ_ja − π_j``:
    ``g_TV = Σ_j ∂TV/∂z_j · u_j = ½ [ (s_a − s̄) π_a − Σ_v π_v² (s_v − s̄) ]``,
    i.e. (like KL) "gradient at a minus its π-weighted mean", with gradient ``½ π_j (s_j − s̄)``.
    """
    pi, mu = pi_logps.exp(), mu_logps.exp()
    s = torch.sign(pi - mu)
    s_bar = (s * pi).sum(dim=-1, keepdim=True)
    idx = action.long().unsqueeze(-1)
    local = ((s - s_bar) * pi).gather(-1, idx).squeeze(-1)
    return 0.5 * (local - (pi.square() * (s - s_bar)).sum(dim=-1))


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    x = x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def mask_metrics(
    keep: torch.Tensor,
    advantages: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    div: torch.Tensor | None = None,
    log_ratio: torch.Tensor | None = None,
    direction: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Scalar metrics over the tokens where ``valid`` (default: all) — 0 when a set is empty.

    * ``masked_frac`` / ``masked_frac_pos`` / ``masked_frac_neg``: fraction dropped among all / A>0 / A<0;
    * ``divergence_mean``; ``is_weight_mean``;
    * ``direction_disagree_frac``: fraction with ``sign(g) ≠ sign(r − 1)`` (sign(0) = 0), i.e. where
      the predictive and ratio direction criteria can decide differently.
    """
    if valid is None:
        valid = torch.ones_like(keep, dtype=torch.bool)
    valid = valid.bool()
    masked = (~keep).to(torch.float32)
    out = {
        "masked_frac": _masked_mean(masked, valid),
        "masked_frac_pos": _masked_mean(masked, valid & (advantages > 0)),
        "masked_frac_neg": _masked_mean(masked, valid & (advantages < 0)),
    }
    if div is not None:
        out["divergence_mean"] = _masked_mean(div, valid)
    if direction is not None and log_ratio is not None:
        disagree = (torch.sign(direction) != torch.sign(log_ratio)).to(torch.float32)
        out["direction_disagree_frac"] = _masked_mean(disagree, valid)
    if weights is not None:
        out["is_weight_mean"] = _masked_mean(weights, valid)
    return out
