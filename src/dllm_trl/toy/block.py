"""The toy block-diffusion model: the addition task (``"37+45="`` → ``"82"``) for an SDAR-shaped model (SPEC §7).

Qwen3 layout at toy size (GQA, per-head q/k norms, no logit shift), attention blocks of ``TOY_BLOCK_SIZE`` = 4:
causal across blocks, bidirectional inside one. It shares the toy tokenizer, task and reward; its checkpoint lives
in ``assets/toy_block`` and is produced by ``scripts/pretrain_toy_block.py``::

    from dllm_trl.toy import evaluate_accuracy, toy_dataset
    from dllm_trl.toy.block import load_toy_block, toy_block_generation_config

    model, tokenizer = load_toy_block()
    print(evaluate_accuracy(model, tokenizer, toy_dataset("test"), toy_block_generation_config())["accuracy"])

Its pre-training (block-diffusion SFT) lives with the toys' other pre-training in ``scripts/toy_pretraining.py``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer

from ..generation import DiffusionGenerationConfig
from ..families import load_diffusion_model
from .model import TOY_GEN_LENGTH, quiet_progress_bars

TOY_BLOCK_SIZE = 4
"""Attention block of the toy block model: the 8 completion positions are two blocks."""

TOY_BLOCK_MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2)
"""SDAR's (Qwen3) layout at toy size; the vocabulary is the toy tokenizer's (``scripts/pretrain_toy_block.py``)."""


def toy_block_assets_dir() -> Path:
    """Folder of the shipped toy block-diffusion checkpoint and tokenizer, inside the installed package."""
    return Path(str(resources.files("dllm_trl").joinpath("assets", "toy_block")))


def toy_block_generation_config(**overrides) -> DiffusionGenerationConfig:
    """Sampler settings of the toy block model: 8 positions in its blocks of 4, dynamic threshold 0.9, greedy, the
    exact block cache. Keyword arguments override any field (``temperature=1.0`` for rollouts)."""
    settings = dict(gen_length=TOY_GEN_LENGTH, block_length=TOY_BLOCK_SIZE, unmasking="dynamic", threshold=0.9,
                    temperature=0.0, cache="dual")
    settings.update(overrides)
    return DiffusionGenerationConfig(**settings)


def load_toy_block(device: str = "cpu", path: str | Path | None = None, **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped toy block model (or of ``path``), the model in eval mode."""
    path = str(path or toy_block_assets_dir())
    with quiet_progress_bars():
        model = load_diffusion_model(path, **from_pretrained_kwargs).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)
