"""dllm-trl: reinforcement learning for masked diffusion language models on top of TRL.

The names below are imported on first use, so ``import dllm_trl.generation`` or ``import dllm_trl.models``
does not pay for TRL and PEFT; ``from dllm_trl import RLDFTrainer`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._console import quiet_known_noise
from ._lazy import lazy_exports

quiet_known_noise()

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "DiffusionGenerationConfig": "generation",
    "DiffusionGenerationOutput": "generation",
    "diffusion_generate": "generation",
    "load_diffusion_model": "families",
    "ModelFamily": "families",
    "register_family": "families",
    "CausalDPPOMaskConfig": "trainers",
    "CausalDPPOMaskTrainer": "trainers",
    "DiffusionDPPOMaskTrainer": "trainers",
    "DPPOMaskConfig": "trainers",
    "DPPOMaskTrainer": "trainers",
    "RLDFConfig": "trainers",
    "RLDFTrainer": "trainers",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .generation import DiffusionGenerationConfig, DiffusionGenerationOutput, diffusion_generate
    from .families import ModelFamily, load_diffusion_model, register_family
    from .trainers import (
        CausalDPPOMaskConfig,
        CausalDPPOMaskTrainer,
        DiffusionDPPOMaskTrainer,
        DPPOMaskConfig,
        DPPOMaskTrainer,
        RLDFConfig,
        RLDFTrainer,
    )
