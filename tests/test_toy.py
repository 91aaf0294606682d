"""Tests for the embedded toy model, tokenizer and task (dllm_trl.toy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from dllm_trl import diffusion_generate
from dllm_trl.generation import encode_prompts
from tests.tiny_models import build_tiny_llada
from dllm_trl.toy import (
    TEST_SIZE,
    TOY_GEN_LENGTH,
    build_toy_tokenizer,
    completion_text,
    evaluate_accuracy,
    load_toy,
    toy_assets_dir,
    toy_dataset,
    toy_generation_config,
    toy_problems,
    toy_reward,
)
from scripts.toy_pretraining import masked_diffusion_loss

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    return load_toy()


# --------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------
def test_tokenizer_round_trip_and_special_ids():
    tokenizer = build_toy_tokenizer()
    ids = tokenizer("37+45=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == "37+45="
    assert tokenizer("37+45=")["input_ids"] == ids  # nothing is added to plain text
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    assert tokenizer.mask_token_id not in (None, tokenizer.eos_token_id)
    assert tokenizer.padding_side == "left"
    assert tokenizer.decode(ids + [tokenizer.eos_token_id] * 2, skip_special_tokens=True) == "37+45="
    assert tokenizer.convert_ids_to_tokens(tokenizer("7?")["input_ids"])[-1] == tokenizer.unk_token


def test_chat_template():
    tokenizer = build_toy_tokenizer()
    messages = [{"role": "user", "content": "37+45="}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|user|>37+45=<|assistant|>"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids["input_ids"] == tokenizer(text)["input_ids"]
    assert len(ids["input_ids"]) == 9  # every special token is one token
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "82"}], tokenize=False)
    assert full == "<|bos|><|user|>37+45=<|assistant|>82<|eos|>"
    with pytest.raises(Exception):
        tokenizer.apply_chat_template([{"role": "tool", "content": "1"}], tokenize=False)


def test_encode_prompts_left_pads_both_formats():
    tokenizer = build_toy_tokenizer()
    ids, mask = encode_prompts(tokenizer, ["1+2=", [{"role": "user", "content": "37+45="}]])
    assert ids.shape == mask.shape == (2, 9)
    assert mask[0].tolist() == [0] * 5 + [1] * 4 and mask[1].all()
    assert tokenizer.decode(ids[0][mask[0].bool()]) == "1+2="


def test_shipped_tokenizer_is_the_built_one(shipped):
    _, tokenizer = shipped
    assert type(tokenizer).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    built = build_toy_tokenizer()
    assert tokenizer.get_vocab() == built.get_vocab()
    assert tokenizer.chat_template == built.chat_template
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.mask_token) == (
        built.eos_token, built.pad_token, built.mask_token,
    )
    assert tokenizer.padding_side == "left"
    loaded = AutoTokenizer.from_pretrained(toy_assets_dir())
    assert loaded("37+45=")["input_ids"] == built("37+45=")["input_ids"]


# --------------------------------------------------------------------------------------------------
# task
# --------------------------------------------------------------------------------------------------
def test_splits_are_deterministic_disjoint_and_correct():
    train, test = toy_problems("train"), toy_problems("test")
    assert len(test) == TEST_SIZE and len(train) + len(test) == 100 * 100
    assert toy_problems("test") == test
    assert not {p for p, _ in train} & {p for p, _ in test}
    for prompt, answer in train[:50] + test:
        a, b = prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(answer) and len(answer) < TOY_GEN_LENGTH
    with pytest.raises(ValueError):
        toy_problems("validation")


def test_toy_dataset_formats():
    plain = toy_dataset("test", size=5)
    assert plain.column_names == ["prompt", "answer"] and len(plain) == 5
    assert plain["prompt"] == [p for p, _ in toy_problems("test")[:5]]
    chat = toy_dataset("test", size=5, conversational=True)
    assert chat[0]["prompt"] == [{"role": "user", "content": plain[0]["prompt"]}]
    assert chat["answer"] == plain["answer"]
    assert len(toy_dataset("train")) == 100 * 100 - TEST_SIZE
    with pytest.raises(ValueError):
        toy_dataset("test", size=TEST_SIZE + 1)


def test_reward():
    assert toy_reward(["82", "83", " 82 ", "82<|eos|><|eos|>", "8<|eos|>2", ""], ["82"] * 6) == [1, 0, 1, 1, 0, 0]
    conversational = [[{"role": "assistant", "content": "82"}], [{"role": "assistant", "content": "28"}]]
    assert toy_reward(conversational, ["82", "82"]) == [1.0, 0.0]
    assert toy_reward(["100"], [100]) == [1.0]
    assert completion_text([]) == ""
    with pytest.raises(ValueError):
        toy_reward(["1"], ["1", "2"])


def test_generation_config():
    config = toy_generation_config()
    assert (config.gen_length, config.block_length, config.unmasking, config.threshold, config.temperature) == (
        TOY_GEN_LENGTH, 4, "dynamic", 0.9, 0.0,
    )
    assert toy_generation_config(temperature=1.0, seed=3).temperature == 1.0


# --------------------------------------------------------------------------------------------------
# pre-training loss (paper 1 Eq. 2)
# --------------------------------------------------------------------------------------------------
def test_masked_diffusion_loss_matches_brute_force():
    torch.manual_seed(0)
    model = build_tiny_llada(vocab_size=22, mask_token_id=2, eos_token_id=0).float()
    batch, prompt_len, gen = 3, 5, 4
    input_ids = torch.randint(3, 22, (batch, prompt_len + gen))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    seen = {}
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.update(ids=kw["input_ids"].clone()), with_kwargs=True)
    loss = masked_diffusion_loss(model, input_ids, attention_mask, gen, 2, torch.Generator().manual_seed(7), eps=1e-3)
    hook.remove()

    generator = torch.Generator().manual_seed(7)
    t = 1e-3 + (1 - 1e-3) * torch.rand(batch, 1, generator=generator)
    masked = torch.rand(batch, gen, generator=generator) < t
    noisy = seen["ids"]
    assert torch.equal(noisy[:, :prompt_len], input_ids[:, :prompt_len])  # the prompt is never masked
    assert torch.equal(noisy[:, prompt_len:] == 2, masked)
    log_probs = model(input_ids=noisy, attention_mask=attention_mask).logits.log_softmax(-1)
    expected = 0.0
    for b in range(batch):
        for i in range(gen):
            if masked[b, i]:
                expected -= log_probs[b, prompt_len + i, input_ids[b, prompt_len + i]] / t[b, 0]
    torch.testing.assert_close(loss, expected / (batch * gen), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# the shipped checkpoint
# --------------------------------------------------------------------------------------------------
def test_shipped_checkpoint_files():
    folder = toy_assets_dir()
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert 0 < weights and total <= 10 * 2**20
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "pretrain_summary.json"):
        assert (folder / name).is_file()
    tensors = load_file(folder / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "lm_head.weight" in tensors  # untied head, like LLaDA
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["mask_token_id"] == 2 and config["eos_token_id"] == 0


def test_shipped_model_loads(shipped):
    model, tokenizer = shipped
    assert model.config.mask_token_id == tokenizer.mask_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id == model.config.pad_token_id
    assert model.config.vocab_size == len(tokenizer)
    assert not model.config.diffusion_logit_shift and not model.training


def test_shipped_model_is_partly_competent(shipped):
    model, tokenizer = shipped
    result = evaluate_accuracy(model, tokenizer, toy_dataset("test", size=64))
    assert 0.1 <= result["accuracy"] <= 0.8
    assert result["num_problems"] == 64 and result["tokens_per_second"] > 0 and result["nfe"] > 0
    # Wrong answers are still numbers: the format is learnt, the arithmetic only partly.
    assert sum(c.isdigit() for c in result["completions"]) >= 56


def test_shipped_model_never_emits_the_mask_and_ends_with_eos(shipped):
    model, tokenizer = shipped
    ids, mask = encode_prompts(tokenizer, toy_dataset("test", size=32)["prompt"])
    out = diffusion_generate(model, ids, mask, toy_generation_config())
    assert not (out.completion_ids == tokenizer.mask_token_id).any()
    assert (out.completion_ids == tokenizer.eos_token_id).any(1).all()
    sampled = diffusion_generate(model, ids, mask, toy_generation_config(temperature=1.0, seed=0))
    assert not (sampled.completion_ids == tokenizer.mask_token_id).any()


def test_main_prints_accuracy(capsys):
    from dllm_trl.toy import main

    result = main(["--size", "16", "--examples", "2"])
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "tokens/s" in printed
    assert 0.0 <= result["accuracy"] <= 1.0


@pytest.mark.slow
def test_script_reproduces_the_shipped_checkpoint(tmp_path):
    """Bit-exact on the software stack and CPU that produced the shipped file (2 threads)."""
    script = ROOT / "scripts" / "pretrain_toy.py"
    subprocess.run([sys.executable, str(script), "--output-dir", str(tmp_path)], check=True)
    shipped = toy_assets_dir()
    assert json.loads((tmp_path / "pretrain_summary.json").read_text()) == json.loads(
        (shipped / "pretrain_summary.json").read_text()
    )
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(shipped / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
