"""Thin GRPOTrainer subclasses (hook glue over a sampler and a loss object) and their configs."""

from ..generation.behaviour import BehaviourCapture
from .dppo_mask_config import CausalDPPOMaskConfig, DPPOMaskConfig, TrustRegionArguments
from .dppo_mask_trainer import DPPO_MASK_TRAINERS, CausalDPPOMaskTrainer, DiffusionDPPOMaskTrainer, DPPOMaskTrainer
from .rldf_config import RLDFConfig
from .rldf_trainer import RLDFTrainer

__all__ = [
    "BehaviourCapture",
    "CausalDPPOMaskConfig",
    "CausalDPPOMaskTrainer",
    "DPPO_MASK_TRAINERS",
    "DPPOMaskConfig",
    "DPPOMaskTrainer",
    "DiffusionDPPOMaskTrainer",
    "RLDFConfig",
    "RLDFTrainer",
    "TrustRegionArguments",
]
