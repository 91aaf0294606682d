"""The toy block-diffusion model: the addition task (``"37+45="`` → ``"82"``) for an SDAR-shaped model (SPEC §7).

Qwen3 layout at toy size (GQA, per-head q/k norms, no logit shift), attention blocks of ``TOY_BLOCK_SIZE`` = 4:
causal across blocks, bidirectional inside one. It shares the toy tokenizer, task and reward; its checkpoint lives
in ``assets/toy_block`` and is produced by ``scripts/pretrain_toy_block.py``::

    from dllm_trl.toy import evaluate_accuracy, toy_dataset
    from dllm_trl.toy.block import load_toy_block, toy_block_generation_config

    model, tokenizer = load_toy_block()
    print(evaluate_accuracy(model, tokenizer, toy_dataset("test"), toy_block_generation_config())["accuracy"])

Pre-training is block-diffusion SFT (the SDAR / Fast-dLLM v2 objective): each response block is masked with its own
ratio ``t ~ U(eps, 1]``, every noisy block sees the clean blocks before it (one packed forward, the layout of
:mod:`dllm_trl.losses.packed_states`), and the loss is the cross-entropy at the masked positions weighted by ``1/t``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..generation import DiffusionGenerationConfig
from ..losses.packed_states import pack_block_copies, packed_read_positions
from ..models import attention_mask_dtype, token_logps_at
from ..families import load_diffusion_model
from ..testing import build_tiny_sdar
from .model import TOY_GEN_LENGTH, quiet_progress_bars
from .pretrain import ToyPretrainConfig, run_pretraining

TOY_BLOCK_SIZE = 4
"""Attention block of the toy block model: the 8 completion positions are two blocks."""

TOY_BLOCK_MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2)
"""SDAR's (Qwen3) layout at toy size; the vocabulary is the toy tokenizer's."""


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


def block_diffusion_loss(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    mask_token_id: int,
    block_size: int,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
) -> torch.Tensor:
    """Block-diffusion SFT loss: ``t_b ~ U(eps, 1]`` per row and response block ``b``, each response token masked in
    its block's noisy copy with probability ``t_b``; ``Σ_masked CE / t_b`` over the number of response positions.

    One packed forward: prompt ⊕ the clean response's blocks but the last ⊕ a noisy copy of every block.
    """
    rows, length = response_ids.shape
    blocks = length // block_size
    device = response_ids.device
    t = eps + (1 - eps) * torch.rand(rows, blocks, 1, generator=generator, device=device)
    masked = torch.rand(rows, blocks, block_size, generator=generator, device=device) < t
    copies = response_ids.view(rows, blocks, block_size).masked_fill(masked, mask_token_id)
    copy_blocks = torch.arange(blocks, device=device).expand(rows, blocks)
    packed = pack_block_copies(
        prompt_ids, prompt_mask, response_ids[:, : (blocks - 1) * block_size], copies, copy_blocks,
        torch.ones(rows, blocks, dtype=torch.bool, device=device), block_size, mask_token_id,
        attention_mask_dtype(model),
    )
    own_block = torch.arange(length, device=device) // block_size == torch.arange(blocks, device=device)[:, None]
    read = masked.view(rows, 1, length) & own_block  # (rows, copy, position): the masked positions of each copy
    read_rows, read_columns, (r, j, i) = packed_read_positions(packed, read, shift=0)
    logps = token_logps_at(model, read_rows, read_columns, response_ids[r, i], input_ids=packed.input_ids,
                           attention_mask=packed.attention_mask, position_ids=packed.position_ids)
    weights = 1.0 / t.view(rows, blocks)[r, j]
    return -(logps * weights).sum() / response_ids.numel()


@dataclass
class ToyBlockPretrainConfig(ToyPretrainConfig):
    """Settings of :func:`pretrain_toy_block`: the toy's (the defaults produce the shipped checkpoint)."""


def pretrain_toy_block(output_dir: str | Path, config: ToyBlockPretrainConfig | None = None, log=print) -> dict:
    """Train the toy block model from scratch and save model + tokenizer to ``output_dir``; returns a summary.

    Stops at the first evaluation whose greedy held-out accuracy reaches ``target_accuracy`` (a partly competent
    model that RL can still improve). Deterministic algorithms throughout (the toy's loop,
    :func:`~dllm_trl.toy.pretrain.run_pretraining`).
    """
    cfg = config or ToyBlockPretrainConfig()

    def build(tokenizer):
        return build_tiny_sdar(
            mask_token_id=tokenizer.mask_token_id, block_size=TOY_BLOCK_SIZE, seed=cfg.seed,
            vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
            max_position_embeddings=tokenizer.model_max_length, **TOY_BLOCK_MODEL_SHAPE,
        )

    def batch_loss(model, tokenizer, prompt_ids, prompt_mask, response_ids, generator):
        return block_diffusion_loss(model, prompt_ids, prompt_mask, response_ids, tokenizer.mask_token_id,
                                    TOY_BLOCK_SIZE, generator, cfg.mask_eps)

    return run_pretraining(output_dir, cfg, build, batch_loss, toy_block_generation_config(), log)
