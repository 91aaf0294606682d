"""The embedded toy models: where their checkpoints live, their shapes, how they decode, and loading them.

* addition (``assets/toy``): a masked-diffusion LM for :mod:`~dllm_trl.toy.task`, the fast test fixture;
* Sudoku (``assets/sudoku``): a masked-diffusion LM for :mod:`~dllm_trl.toy.sudoku`, the estimator and trust-region
  studies' model;
* Sudoku, noisy teacher (``assets/sudoku_noisy_teacher``): the same model pre-trained longer on answers of which half
  exchange the digits 1 and 2 (:func:`~dllm_trl.toy.sudoku.noisy_teacher_problems`), the main job's model;
* Sudoku, causal (``assets/sudoku_causal``): an ordinary left-to-right ``LlamaForCausalLM`` on the same task, for
  the causal path of :class:`~dllm_trl.trainers.DPPOMaskTrainer` (paper 2's setting);
* Sudoku, DiffusionGemma (``assets/sudoku_diffusion_gemma``): a tiny ``DiffusionGemmaForBlockDiffusion``
  (uniform-noise block diffusion, no mask token; its answer is one canvas of 20 tokens) on the same task, for
  :class:`~dllm_trl.generation.DiffusionGemmaSampler` and the DiffusionGemma losses; and its noisy-teacher twin
  (``assets/sudoku_diffusion_gemma_noisy_teacher``), on which RLDF's gain is large (docs/diffusion_gemma.md).
"""

from __future__ import annotations

import contextlib
from importlib import resources
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from ..generation import DiffusionGenerationConfig
from ..families import load_diffusion_model

TOY_GEN_LENGTH = 8
"""Completion positions: the answer (at most 3 digits), then EOS up to the end (LLaDA's SFT convention)."""

TOY_MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4)
"""LLaDA layout (no biases, untied head, RoPE, SwiGLU, RMSNorm) at toy size; the vocabulary is the tokenizer's."""


SUDOKU_GEN_LENGTH = 20
"""Completion positions of the Sudoku toy: the 19-token grid (four rows of four digits, spaces between) and EOS."""

SUDOKU_MODEL_SHAPE = TOY_MODEL_SHAPE
"""Shape of both Sudoku toys (LLaDA layout for the diffusion one, the plain Llama layout for the causal one)."""


SUDOKU_DIFFUSION_GEMMA_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=64, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
)
"""Shape of the DiffusionGemma Sudoku toy: the 26B-A4B layout (shared-weight causal encoder and bidirectional
decoder, sliding-window layers then a full-attention one, a dense MLP beside a top-2 mixture of experts, soft-capped
tied head, self-conditioning) at 0.6M weights; its vocabulary is the tokenizer's plus the three image ids. The window
(64) covers prompt and canvas, so no layer slides here."""

SUDOKU_DIFFUSION_GEMMA_STEPS = 16
"""Denoising steps per canvas of the DiffusionGemma Sudoku toy's sampler (``max_denoising_steps``)."""


def toy_assets_dir(name: str = "toy") -> Path:
    """Folder of a shipped checkpoint and its tokenizer inside the installed package: ``"toy"`` (addition),
    ``"sudoku"``, ``"sudoku_noisy_teacher"``, ``"sudoku_causal"``, ``"sudoku_diffusion_gemma"`` or
    ``"sudoku_diffusion_gemma_noisy_teacher"``."""
    return Path(str(resources.files("dllm_trl").joinpath("assets", name)))


def toy_generation_config(**overrides) -> DiffusionGenerationConfig:
    """Sampler settings for the toy task: 8 positions in blocks of 4, dynamic threshold 0.9, greedy.

    Keyword arguments override any field, e.g. ``toy_generation_config(temperature=1.0)`` for rollouts.
    """
    settings = dict(gen_length=TOY_GEN_LENGTH, block_length=4, unmasking="dynamic", threshold=0.9, temperature=0.0)
    settings.update(overrides)
    return DiffusionGenerationConfig(**settings)


@contextlib.contextmanager
def quiet_progress_bars():
    """Within the context transformers draws no progress bars (its "Loading weights" bar over a toy's few tensors is
    noise on the console); the previous setting is restored on exit."""
    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def sudoku_generation_config(**overrides) -> DiffusionGenerationConfig:
    """Sampler settings for the Sudoku toy: 20 positions in one block, static unmasking with 20 steps (one cell per
    step, the most confident first: the sampler picks the order of all 16 cells), greedy. Keyword arguments override
    any field (``temperature=1.0`` for rollouts).

    Not the dynamic threshold of the addition toy: there RL's sharpening makes several cells cross the threshold in
    one step, they are committed in parallel without seeing each other, and the grids break (docs/main_job.md).
    """
    settings = dict(gen_length=SUDOKU_GEN_LENGTH, block_length=SUDOKU_GEN_LENGTH, unmasking="static",
                    steps=SUDOKU_GEN_LENGTH, temperature=0.0)
    settings.update(overrides)
    return DiffusionGenerationConfig(**settings)


def sudoku_diffusion_gemma_sampler_config(**overrides):
    """Sampler settings of the DiffusionGemma Sudoku toy: one canvas of 20 tokens, 16 denoising steps, the rest
    ``model.generate``'s defaults (temperatures 0.8 → 0.4, entropy bound 0.1: decoding is random, so the toy's solve
    rate is a mean over seeds). Keyword arguments override any field of
    :class:`~dllm_trl.generation.DiffusionGemmaSamplerConfig`."""
    from ..generation import DiffusionGemmaSamplerConfig

    settings = dict(gen_length=SUDOKU_GEN_LENGTH, max_denoising_steps=SUDOKU_DIFFUSION_GEMMA_STEPS)
    settings.update(overrides)
    return DiffusionGemmaSamplerConfig(**settings)


def configure_diffusion_gemma_generation(model) -> None:
    """Give a DiffusionGemma toy's ``generation_config`` the toy sampler's settings, so that ``model.generate(ids,
    max_new_tokens=20)`` decodes as :func:`sudoku_diffusion_gemma_sampler_config` does."""
    text = model.config.get_text_config()
    sampler = sudoku_diffusion_gemma_sampler_config()
    generation = model.generation_config
    generation.max_denoising_steps = sampler.max_denoising_steps
    generation.t_min, generation.t_max = sampler.t_min, sampler.t_max
    generation.stability_threshold, generation.confidence_threshold = (sampler.stability_threshold,
                                                                       sampler.confidence_threshold)
    generation.eos_token_id, generation.pad_token_id = text.eos_token_id, text.pad_token_id


def load_toy(device: str = "cpu", path: str | Path | None = None, **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped addition toy (or of the diffusion checkpoint at ``path``), in eval
    mode."""
    path = str(path or toy_assets_dir())
    with quiet_progress_bars():
        model = load_diffusion_model(path, **from_pretrained_kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def load_sudoku(device: str = "cpu", path: str | Path | None = None, **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped Sudoku diffusion toy (or of ``path``), in eval mode."""
    return load_toy(device, path or toy_assets_dir("sudoku"), **from_pretrained_kwargs)


def load_sudoku_noisy_teacher(device: str = "cpu", path: str | Path | None = None, **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped noisy-teacher Sudoku diffusion toy (the main job's), in eval mode."""
    return load_toy(device, path or toy_assets_dir("sudoku_noisy_teacher"), **from_pretrained_kwargs)


def load_sudoku_causal(device: str = "cpu", path: str | Path | None = None, **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped causal Sudoku toy (a plain ``LlamaForCausalLM``), in eval mode."""
    path = str(path or toy_assets_dir("sudoku_causal"))
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


def load_sudoku_diffusion_gemma(device: str = "cpu", path: str | Path | None = None, **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped DiffusionGemma Sudoku toy (transformers' own
    ``DiffusionGemmaForBlockDiffusion``; or the checkpoint at ``path``), in eval mode."""
    return load_toy(device, path or toy_assets_dir("sudoku_diffusion_gemma"), **from_pretrained_kwargs)


def load_sudoku_diffusion_gemma_noisy_teacher(device: str = "cpu", path: str | Path | None = None,
                                              **from_pretrained_kwargs):
    """``(model, tokenizer)`` of the shipped noisy-teacher DiffusionGemma Sudoku toy (pre-trained on answers of which
    half exchange the digits 1 and 2: the error RL removes, as in the main job), in eval mode."""
    return load_toy(device, path or toy_assets_dir("sudoku_diffusion_gemma_noisy_teacher"), **from_pretrained_kwargs)
