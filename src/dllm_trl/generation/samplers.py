"""Sampler objects handed to the trainers: a model family's rollout (prompt → completion + the trajectory its loss
needs), so that a new family adds a sampler and a loss object and touches no trainer. :class:`RolloutSampler` is the
interface the trainers call."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..models.bidirectional import diffusion_block_size
from ..models.engines import model_config, unwrap_model
from .config import DiffusionGenerationConfig
from .masked_diffusion import DiffusionGenerationOutput, check_block_decoding, diffusion_generate


@runtime_checkable
class RolloutSampler(Protocol):
    """What a diffusion trainer asks of its sampler (``tests/test_interfaces.py`` checks every shipped sampler)."""

    config: object
    """A dataclass of the sampler's settings: the trainer copies it with the loss's requests
    (``dataclasses.replace``) and the loss reads its sampling settings."""

    def check_model(self, model) -> None:
        """Refuse, at init, a model or setting this sampler cannot decode with."""

    def __call__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 generator: torch.Generator | None = None) -> DiffusionGenerationOutput:
        """Left-padded prompts (B, P) → completions and the trajectory the loss reads."""


class MaskedDiffusionSampler:
    """Block-wise masked-diffusion decoding with a KV cache that records the denoising trajectory (SPEC §1): LLaDA,
    Dream and block-diffusion models (SDAR / TraDo, Fast-dLLM v2)."""

    def __init__(self, config: DiffusionGenerationConfig):
        self.config = config

    def check_model(self, model) -> None:
        """Refuse settings the model cannot decode with (e.g. a block-diffusion model's block size), and a
        ``reference_decoder``, whose prompt alignment the training forward does not share."""
        if getattr(model_config(model), "mask_token_id", None) is None:
            raise ValueError(
                f"MaskedDiffusionSampler decodes masked-diffusion LMs, and this {type(unwrap_model(model)).__name__} "
                "has no config.mask_token_id (DiffusionGemma is uniform-noise diffusion: DiffusionGemmaSampler). Load "
                "a masked-diffusion LM with load_diffusion_model(...), or let the trainer pick the sampler of the "
                "model's family (leave sampler= unset)."
            )
        check_block_decoding(self.config, diffusion_block_size(model))
        if self.config.reference_decoder is not None:
            raise ValueError(
                f"reference_decoder={self.config.reference_decoder!r} reproduces the family's own decoding for "
                "evaluation: its first block starts inside the prompt, while the training forward pads every prompt to "
                "a block boundary, so its trajectory is not the training forward's. Train with reference_decoder=None."
            )

    def __call__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 generator: torch.Generator | None = None) -> DiffusionGenerationOutput:
        """Left-padded prompts (B, P) → completions and their trajectory."""
        return diffusion_generate(model, prompt_ids, prompt_mask, self.config, generator)
