"""Prompt canvas -> completion + denoising trajectory (SPEC §1)."""

from .config import CACHE_MODES, SAMPLING_STYLES, UNMASKING_MODES, DiffusionGenerationConfig
from .behaviour import BehaviourCapture, appended_logits_processor
from .samplers import MaskedDiffusionSampler
from .sampler import NEVER_COMMITTED, DiffusionGenerationOutput, diffusion_generate, draw_candidates, static_schedule

__all__ = [
    "BehaviourCapture",
    "MaskedDiffusionSampler",
    "appended_logits_processor",
    "CACHE_MODES",
    "NEVER_COMMITTED",
    "SAMPLING_STYLES",
    "UNMASKING_MODES",
    "DiffusionGenerationConfig",
    "DiffusionGenerationOutput",
    "diffusion_generate",
    "draw_candidates",
    "static_schedule",
]
