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
    with warnings.catch_warnings(record=True) as again:  # the same run (config): said once, not at every rollout
        warnings.simplefilter("always")
        diffusion_generate(model, input_ids, attention_mask, too_long)
    assert not [w for w in again if "max_position_embeddings" in str(w.message)]


def test_importing_the_package_prints_no_known_third_party_noise():
    """bitsandbytes' missing optional CPU kernel and DeepSpeed's accelerator probe say nothing wrong: not shown."""
    import subprocess
    import sys

    code = ("import dllm_trl; from dllm_trl import RLDFTrainer, DPPOMaskTrainer; import deepspeed; "
            "from deepspeed.accelerator import get_accelerator; get_accelerator()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                            env={k: v for k, v in __import__("os").environ.items() if k != "DS_ACCELERATOR"})
    output = result.stdout + result.stderr
    assert "gemm_4bit_forward" not in output and "Setting accelerator to CPU" not in output, output
