"""dllm-trl: reinforcement learning for masked diffusion language models on top of TRL."""

from .generation import DiffusionGenerationConfig, DiffusionGenerationOutput, diffusion_generate
from .models import load_diffusion_model
from .trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFConfig, RLDFTrainer

__version__ = "0.1.0.dev0"

__all__ = [
    "DPPOMaskConfig",
    "DPPOMaskTrainer",
    "DiffusionGenerationConfig",
    "DiffusionGenerationOutput",
    "RLDFConfig",
    "RLDFTrainer",
    "diffusion_generate",
    "load_diffusion_model",
]
