"""Decoding a LLaDA2-shaped block-diffusion MoE model (``Glm4MoeForCausalLM``, SPEC §7–8).

The same oracles as the dense block models (``test_block_generation``): cached = uncached token for token, a
left-padded batch = its rows one by one, every committed token's recorded distribution = a plain forward of its
replayed state. And ``reference_decoder="llada2"`` = a decoding loop written here from the official
``LLaDA2MoeModelLM.generate``: blocks counted from the prompt's first token (its last block is shared with the
first decoded tokens), one step = one forward of the whole canvas up to the current block under the block-causal
mask, greedy candidates, every masked position with confidence strictly above the threshold committed, else the
most confident one; stop after the block holding the first EOS. The one deliberate difference: the mask token is
never a candidate here (the official code leaves it in the softmax; a trained LLaDA2 gives it no mass).
"""

from __future__ import annotations

import math

import pytest
import torch

from dllm_trl import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.generation import MaskedDiffusionSampler
from tests.tiny_models import build_tiny_llada2

from .test_block_generation import assert_same_decoding, run
from .test_generation import EOS, MASK, VOCAB, check_replay, prompts

BLOCK = 4


def make_llada2(layers: int = 2, seed: int = 0, attn: str = "sdpa"):
    """A tiny LLaDA2-shaped model (8 experts in 4 groups, 2 chosen from 2 groups, one shared) with weights large
    enough that predictions depend on the context and confidences spread over (0, 1)."""
    model = build_tiny_llada2(
        seed=seed, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=16, eos_token_id=EOS, block_size=BLOCK,
        attn_implementation=attn,
    )
    assert model.config.mask_token_id == MASK
    gen = torch.Generator().manual_seed(3000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                fan_in = param.shape[-1]
                std = 1.0 if "embed" in name else (3.0 if "lm_head" in name else 1.5) / math.sqrt(fan_in)
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


# --------------------------------------------------------------------------------------------------
# the exact block cache, padded batches, recorded distributions
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("unmasking", ["dynamic", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_decoding_equals_uncached(unmasking, temperature):
    model = make_llada2(layers=2)
    for batch, prompt_len, seed in [(3, 5, 0), (2, 8, 1)]:
        ids = prompts(batch, prompt_len, seed)
        kwargs = dict(unmasking=unmasking, temperature=temperature, seed=seed, gen_length=12)
        base, _ = run(model, ids, cache="none", **kwargs)
        out, seen = run(model, ids, cache="dual", **kwargs)
        assert_same_decoding(out, base)
        check_replay(out, seen, prompt_len)
    if unmasking == "dynamic" and temperature == 0.0:
        assert (base.num_steps < 12).any(), "the threshold should commit several tokens in some step"


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_left_padded_batch_equals_rows_one_by_one(cache):
    model = make_llada2(layers=2, attn="eager" if cache == "none" else "sdpa")
    lengths = [7, 4, 1, 5]
    width = max(lengths)
    ids = prompts(len(lengths), width, seed=4)
    attention_mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        attention_mask[b, : width - n] = 0
    out, seen = run(model, ids, attention_mask, cache=cache, gen_length=12)
    check_replay(out, seen, width)
    for b, n in enumerate(lengths):
        alone, _ = run(model, ids[b : b + 1, width - n :], cache=cache, gen_length=12)
        assert torch.equal(out.completion_ids[b], alone.completion_ids[0]), f"row {b} (prompt of {n})"
        assert torch.equal(out.commit_step[b], alone.commit_step[0])
        torch.testing.assert_close(out.commit_prob[b], alone.commit_prob[0], rtol=1e-4, atol=1e-5)


def test_recorded_distribution_is_the_training_forwards():
    """The top-K each committed token was drawn from = one plain forward of its replayed state (prompt left-padded
    to a block boundary, as the training forward does)."""
    model = make_llada2(layers=2)
    ids = prompts(1, 6, seed=6)
    K = 5
    out, _ = run(model, ids, record_topk=K, temperature=1.0, seed=1, gen_length=8)
    pad = -6 % BLOCK
    for t in range(int(out.num_steps[0])):
        state = out.completion_ids[0].masked_fill(out.commit_step[0] >= t, MASK)
        canvas = torch.cat([torch.full((pad,), MASK), ids[0], state])[None]
        key_mask = torch.ones_like(canvas)
        key_mask[0, :pad] = 0
        with torch.no_grad():
            logits = model(input_ids=canvas, attention_mask=key_mask).logits[0, pad + 6:].double()
        logits[:, MASK] = float("-inf")
        committed = out.commit_step[0] == t
        values, indices = logits[committed].log_softmax(-1).topk(K, dim=-1)
        assert torch.equal(out.topk_ids[0][committed], indices)
        torch.testing.assert_close(out.topk_logps[0][committed].double(), values, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# reference_decoder="llada2": the official generate, token for token
# --------------------------------------------------------------------------------------------------
def official_llada2_generate(model, prompt: list[int], gen_length: int, block: int, threshold: float) -> list[int]:
    """The official decoding loop (batch 1, greedy, ``steps = block_length``: one token at least per step)."""
    length = len(prompt)
    num_blocks = (length + gen_length + block - 1) // block
    x = torch.full((1, num_blocks * block), MASK)
    x[0, :length] = torch.tensor(prompt)
    columns = torch.arange(num_blocks * block)
    visible = (columns[:, None] // block) >= (columns[None, :] // block)  # query block >= key block
    for n in range(length // block, num_blocks):
        end = (n + 1) * block
        for _ in range(block):
            masked = x[0, end - block:end] == MASK
            if not masked.any():
                break
            with torch.no_grad():
                logits = model(input_ids=x[:, :end], attention_mask=visible[None, None, :end, :end],
                               position_ids=columns[None, :end]).logits[0, -block:].double()
            logits[:, MASK] = float("-inf")
            probs = logits.softmax(-1)
            token = probs.argmax(-1)
            confidence = torch.where(masked, probs.gather(-1, token[:, None])[:, 0], float("-inf"))
            commit = confidence > threshold
            if not commit.any():
                commit = torch.zeros_like(masked)
                commit[confidence.argmax()] = True
            x[0, end - block:end] = torch.where(commit, token, x[0, end - block:end])
        if (x[0, length:end] == EOS).any():
            break
    out = x[0, length:length + gen_length].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


def _decode_official(model, ids, attention_mask=None, **overrides):
    settings = dict(gen_length=12, block_length=BLOCK, threshold=0.6, reference_decoder="llada2", stop_at_eos=True)
    settings.update(overrides)
    return diffusion_generate(model, ids, attention_mask, DiffusionGenerationConfig(**settings))


def _until_eos(out, b):
    return out.completion_ids[b, : int(out.completion_mask[b].sum())].tolist()


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_reference_decoder_equals_the_official_loop(cache):
    model = make_llada2(layers=2)
    differs = 0
    for prompt_len in range(1, 2 * BLOCK + 1):  # every alignment of the prompt's end in its block
        ids = prompts(1, prompt_len, seed=10 + prompt_len)
        expected = official_llada2_generate(model, ids[0].tolist(), 12, BLOCK, 0.6)
        out = _decode_official(model, ids, cache=cache)
        assert _until_eos(out, 0) == expected, f"prompt of {prompt_len}"
        aligned = diffusion_generate(model, ids, None, DiffusionGenerationConfig(
            gen_length=12, block_length=BLOCK, threshold=0.6, cache=cache))
        differs += _until_eos(aligned, 0) != expected
    assert differs > 0, "the default (block-aligned) decoding should differ for some unaligned prompt"


def test_reference_decoder_batches_prompts_of_one_alignment():
    """Rows whose prompt lengths agree modulo the block decode as alone; other batches are refused."""
    model = make_llada2(layers=2)
    lengths = [6, 2, 6]
    ids = prompts(3, 6, seed=21)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0
    out = _decode_official(model, ids, attention_mask)
    for b, n in enumerate(lengths):
        assert _until_eos(out, b) == official_llada2_generate(model, ids[b, 6 - n:].tolist(), 12, BLOCK, 0.6)
    attention_mask[1, :5] = 0
    with pytest.raises(ValueError, match="reference_decoder"):
        _decode_official(model, ids, attention_mask)


def test_reference_decoder_settings_and_training_are_refused():
    for bad in (dict(unmasking="static", steps=12), dict(block_length=2), dict(reference_decoder="sdar")):
        with pytest.raises(ValueError, match="reference_decoder"):
            model = make_llada2(layers=1)
            _decode_official(model, prompts(1, 3), **bad)
    sampler = MaskedDiffusionSampler(DiffusionGenerationConfig(gen_length=8, block_length=BLOCK,
                                                               reference_decoder="llada2"))
    with pytest.raises(ValueError, match="reference_decoder"):
        sampler.check_model(make_llada2(layers=1))  # what the trainers call before training
