"""Sampler objects handed to the trainers: a model family's rollout (prompt → completion + the trajectory its loss
needs), so that a new family adds a sampler and a loss object and touches no trainer."""

from __future__ import annotations

import torch

from ..models.bidirectional import diffusion_block_size
from ..models.diffusion_gemma import is_diffusion_gemma
from .config import DiffusionGenerationConfig
from .masked_diffusion import DiffusionGenerationOutput, check_block_decoding, diffusion_generate


class MaskedDiffusionSampler:
    """Block-wise masked-diffusion decoding with a KV cache that records the denoising trajectory (SPEC §1): LLaDA,
    Dream and block-diffusion models (SDAR / TraDo, Fast-dLLM v2)."""

    def __init__(self, config: DiffusionGenerationConfig):
        self.config = config

    def check_model(self, model) -> None:
        """Refuse settings the model cannot decode with (e.g. a block-diffusion model's block size), and a
        ``reference_decoder``, whose prompt alignment the training forward does not share."""
        if is_diffusion_gemma(model):
            raise ValueError("DiffusionGemma is uniform-noise diffusion (no mask token, canvases of its own length): "
                             "decode it with DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(...)), not "
                             "MaskedDiffusionSampler.")
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
