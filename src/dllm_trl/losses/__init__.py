"""Trajectory -> sampled states -> per-token loss terms (SPEC §2–3). Pure tensor functions."""

from .rldf import (
    INVALID_STEP,
    clean_target_mask,
    k3_kl,
    noisy_state,
    policy_token_terms,
    sample_timesteps,
    sequential_target_mask,
    step_uncertainty,
)

__all__ = [
    "INVALID_STEP",
    "clean_target_mask",
    "k3_kl",
    "noisy_state",
    "policy_token_terms",
    "sample_timesteps",
    "sequential_target_mask",
    "step_uncertainty",
]
