"""diffusion_generate warns when prompt + gen_length run past the model's positions, and only then."""

from __future__ import annotations

import warnings

import pytest
import torch

from dllm_trl import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.generation import encode_prompts
from dllm_trl.toy import load_toy


def test_warns_past_max_position_embeddings():
    model, tokenizer = load_toy()
    positions = model.config.max_position_embeddings  # 64
    input_ids, attention_mask = encode_prompts(tokenizer, ["12+34=", "5+6="])
    fits = positions - input_ids.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exactly at the limit: no warning
        config = DiffusionGenerationConfig(gen_length=fits, block_length=fits)
        diffusion_generate(model, input_ids, attention_mask, config)
    too_long = DiffusionGenerationConfig(gen_length=2 * positions, block_length=positions)
    with pytest.warns(UserWarning, match=f"gen_length={2 * positions} exceed the model's max_position_embeddings=64"):
        out = diffusion_generate(model, input_ids, attention_mask, too_long)
    assert out.sequences.shape == (2, input_ids.shape[1] + 2 * positions) and torch.isfinite(out.commit_prob).all()
