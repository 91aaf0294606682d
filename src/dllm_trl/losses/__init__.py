"""Trajectory -> sampled states -> per-token loss terms (SPEC §2–3): tensor functions, and the loss objects the
trainers call (:class:`RLDFLoss`, :class:`MoERLDFLoss`, :class:`DiffusionTrustRegionLoss`,
:class:`CausalTrustRegionLoss`, :class:`DiffusionGemmaRLDFLoss`), and the Monte-Carlo ELBO of a continuation
(:func:`sequence_elbo`, :mod:`.elbo`)."""

from .rldf_terms import (
    INVALID_STEP,
    clean_target_mask,
    corrected_k3_kl,
    k3_kl,
    noisy_state,
    policy_token_terms,
    sample_timesteps,
    sequential_target_mask,
    step_uncertainty,
)
from .elbo import ELBO_ESTIMATORS, ElboEstimate, mc_elbo, sequence_elbo
from .diffusion_gemma_loss import DiffusionGemmaRLDFLoss, DiffusionGemmaTrustRegionLoss
from .interface import DiffusionLoss
from .rldf_loss import LossCall, RLDFLoss, zero_variance_rows
from .routing_drift import MoERLDFLoss, RoutingDriftMixin, expert_set_agreement
from .trust_region_loss import CausalTrustRegionLoss, DiffusionTrustRegionLoss

__all__ = [
    "CausalTrustRegionLoss",
    "DiffusionGemmaRLDFLoss",
    "DiffusionGemmaTrustRegionLoss",
    "DiffusionLoss",
    "DiffusionTrustRegionLoss",
    "ELBO_ESTIMATORS",
    "ElboEstimate",
    "LossCall",
    "MoERLDFLoss",
    "RLDFLoss",
    "RoutingDriftMixin",
    "corrected_k3_kl",
    "expert_set_agreement",
    "mc_elbo",
    "sequence_elbo",
    "zero_variance_rows",
    "INVALID_STEP",
    "clean_target_mask",
    "k3_kl",
    "noisy_state",
    "policy_token_terms",
    "sample_timesteps",
    "sequential_target_mask",
    "step_uncertainty",
]
