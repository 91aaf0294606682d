"""Thin GRPOTrainer subclasses and their configs."""

from .rldf_config import RLDFConfig
from .rldf_trainer import RLDFTrainer

__all__ = ["RLDFConfig", "RLDFTrainer"]
