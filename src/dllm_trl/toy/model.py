"""The embedded toy model: where its checkpoint lives, its shape, how it decodes, and loading it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer

from ..generation import DiffusionGenerationConfig
from ..models import load_diffusion_model

TOY_GEN_LENGTH = 8
"""Completion positions: the answer (at most 3 digits), then EOS up to the end (LLaDA's SFT convention)."""

TOY_MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4)
"""LLaDA layout (no biases, untied head, RoPE, SwiGLU, RMSNorm) at toy size; the vocabulary is the tokenizer's."""


def toy_assets_dir() -> Path:
    """Folder of the shipped checkpoint and tokenizer, inside the installed package."""
    return Path(str(resources.files("dllm_trl").joinpath("assets", "toy")))


def toy_generation_config(**overrides) -> DiffusionGenerationConfig:
    """Sampler settings for the toy task: 8 positions in blocks of 4, dynamic threshold 0.9, greedy.

    Keyword arguments override any field, e.g. ``toy_generation_config(temperature=1.0)`` for rollouts.
    """
    settings = dict(gen_length=TOY_GEN_LENGTH, block_length=4, unmasking="dynamic", threshold=0.9, temperature=0.0)
    settings.update(overrides)
    return DiffusionGenerationConfig(**settings)


def load_toy(device: str = "cpu", path: str | Path | None = None, **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped toy checkpoint (or of ``path``), the model in eval mode."""
    path = str(path or toy_assets_dir())
    model = load_diffusion_model(path, **from_pretrained_kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
