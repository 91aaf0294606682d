"""Thin GRPOTrainer subclasses and their configs."""

from .dppo_mask_config import DPPOMaskConfig
from .dppo_mask_trainer import BehaviourCapture, DPPOMaskTrainer
from .rldf_config import RLDFConfig
from .rldf_trainer import RLDFTrainer

__all__ = ["BehaviourCapture", "DPPOMaskConfig", "DPPOMaskTrainer", "RLDFConfig", "RLDFTrainer"]
