"""The toy block-diffusion model (dllm_trl.toy.block): its loss, the shipped checkpoint, RLDF on it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from dllm_trl import RLDFTrainer, diffusion_generate
from dllm_trl.generation import encode_prompts
from tests.tiny_models import build_tiny_sdar
from dllm_trl.toy import evaluate_accuracy, toy_dataset, toy_reward, toy_rldf_config
from dllm_trl.toy.block import TOY_BLOCK_SIZE, load_toy_block, toy_block_assets_dir, toy_block_generation_config
from scripts.toy_pretraining import block_diffusion_loss

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    return load_toy_block()


def test_block_diffusion_loss_matches_brute_force():
    """Each response block masked with its own ratio, scored seeing the prompt and the clean blocks before it: one
    plain forward per (row, block) of ``prompt ⊕ clean earlier blocks ⊕ noisy block`` through the model's own
    block-causal mask, the prompt left-padded to a block boundary by hand."""
    torch.manual_seed(0)
    B, mask_id = 2, 2
    model = build_tiny_sdar(vocab_size=22, mask_token_id=mask_id, eos_token_id=0, block_size=B)
    rows, prompt_len, gen = 3, 3, 6
    prompt = torch.randint(3, 22, (rows, prompt_len))
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[0, :2] = 0
    response = torch.randint(3, 22, (rows, gen))
    loss = block_diffusion_loss(model, prompt, prompt_mask, response, mask_id, B, torch.Generator().manual_seed(7))

    generator = torch.Generator().manual_seed(7)
    t = 1e-3 + (1 - 1e-3) * torch.rand(rows, gen // B, 1, generator=generator)
    masked = torch.rand(rows, gen // B, B, generator=generator) < t
    expected, pad = 0.0, -prompt_len % B
    for r in range(rows):
        for b in range(gen // B):
            noisy = response[r, b * B : (b + 1) * B].masked_fill(masked[r, b], mask_id)
            ids = torch.cat([torch.full((pad,), 5), prompt[r], response[r, : b * B], noisy])[None]
            keys = torch.cat([torch.zeros(pad, dtype=torch.long), prompt_mask[r], torch.ones(b * B + B, dtype=torch.long)])
            log_probs = model(input_ids=ids, attention_mask=keys[None]).logits[0].log_softmax(-1)
            for o in range(B):
                if masked[r, b, o]:
                    expected -= log_probs[-B + o, response[r, b * B + o]] / t[r, b, 0]
    assert masked.any() and not masked.all()
    torch.testing.assert_close(loss, expected / (rows * gen), rtol=1e-5, atol=1e-6)


def test_shipped_checkpoint_files():
    folder = toy_block_assets_dir()
    total = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert total <= 10 * 2**20
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "pretrain_summary.json"):
        assert (folder / name).is_file()
    assert all(t.dtype == torch.float32 for t in load_file(folder / "model.safetensors").values())
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["diffusion_block_size"] == TOY_BLOCK_SIZE
    assert config["mask_token_id"] == 2 and config["eos_token_id"] == 0 and config["diffusion_logit_shift"] is False


def test_shipped_model_is_a_partly_competent_block_model(shipped):
    model, tokenizer = shipped
    assert type(model) is Qwen3ForCausalLM and model.config.diffusion_block_size == TOY_BLOCK_SIZE
    result = evaluate_accuracy(model, tokenizer, toy_dataset("test", size=64), toy_block_generation_config())
    assert 0.1 <= result["accuracy"] <= 0.8
    assert sum(c.isdigit() for c in result["completions"]) >= 56  # the format is learnt, the arithmetic partly


def test_shipped_model_never_emits_the_mask_and_ends_with_eos(shipped):
    model, tokenizer = shipped
    ids, mask = encode_prompts(tokenizer, toy_dataset("test", size=32)["prompt"])
    for config in (toy_block_generation_config(), toy_block_generation_config(temperature=1.0, seed=0, cache="none")):
        out = diffusion_generate(model, ids, mask, config)
        assert not (out.completion_ids == tokenizer.mask_token_id).any()
        assert (out.completion_ids == tokenizer.eos_token_id).any(1).all()


def test_rldf_on_the_toy_block_model(tmp_path, shipped):
    """What the README shows: two RLDF steps on the block model, on CPU."""
    model, tokenizer = load_toy_block()
    args = toy_rldf_config(str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4)
    trainer = RLDFTrainer(model=model, args=args, reward_funcs=toy_reward, train_dataset=toy_dataset("train", size=64),
                          processing_class=tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(math.isfinite(entry["loss"]) for entry in logged)


@pytest.mark.slow
def test_script_reproduces_the_shipped_checkpoint(tmp_path):
    """Bit-exact on the software stack and CPU that produced the shipped file (2 threads)."""
    script = ROOT / "scripts" / "pretrain_toy_block.py"
    subprocess.run([sys.executable, str(script), "--output-dir", str(tmp_path)], check=True)
    shipped = toy_block_assets_dir()
    assert json.loads((tmp_path / "pretrain_summary.json").read_text()) == json.loads(
        (shipped / "pretrain_summary.json").read_text()
    )
    assert (tmp_path / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
