"""Prompt canvas -> completion + denoising trajectory (SPEC §1); prompts -> completion texts (:mod:`.decode`)."""

from .behaviour import BehaviourCapture, appended_logits_processor
from .config import CACHE_MODES, SAMPLING_STYLES, UNMASKING_MODES, DiffusionGenerationConfig
from .diffusion_gemma import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig
from .decode import DecodedPrompts, decode_completions, decode_prompts, encode_prompts
from .masked_diffusion import NEVER_COMMITTED, DiffusionGenerationOutput, diffusion_generate, draw_candidates
from .masked_diffusion import static_schedule
from .samplers import MaskedDiffusionSampler, RolloutSampler
from .trajectory import DenoisingSteps

__all__ = [
    "BehaviourCapture",
    "DenoisingSteps",
    "DiffusionGemmaSampler",
    "DiffusionGemmaSamplerConfig",
    "MaskedDiffusionSampler",
    "RolloutSampler",
    "appended_logits_processor",
    "CACHE_MODES",
    "NEVER_COMMITTED",
    "SAMPLING_STYLES",
    "UNMASKING_MODES",
    "DecodedPrompts",
    "DiffusionGenerationConfig",
    "DiffusionGenerationOutput",
    "decode_completions",
    "decode_prompts",
    "diffusion_generate",
    "draw_candidates",
    "encode_prompts",
    "static_schedule",
]
