"""The block-diffusion decoder (SPEC §7): block by block over the exact cache of the finished blocks.

Oracles that hold exactly: cached decoding is token-identical to uncached decoding (every layer count, dynamic and
static unmasking, greedy and sampled with the same seed, decoding blocks equal to the attention blocks or sub-blocks
of them); a batch of left-padded prompts equals its rows one by one; no mask is left; every finished block's
keys/values are written to the cache once and equal a fresh forward's; every committed token's recorded
distribution is the one a plain forward of the replayed state gives (the training forward sees what the sampler saw).
"""

from __future__ import annotations

import math

import pytest
import torch

from dllm_trl import DiffusionGenerationConfig, diffusion_generate
from dllm_trl.generation.cache import BlockCache, cache_keyword
from tests.tiny_models import build_tiny_fast_dllm_v2, build_tiny_sdar

from .test_generation import EOS, MASK, VOCAB, check_invariants, check_replay, prompts, with_head_bias

FORMATS = ("sdar", "fast_dllm_v2")
BLOCK = 4
TOL = dict(rtol=1e-5, atol=1e-6)


def make_block_model(fmt: str, layers: int = 2, seed: int = 0, block_size: int = BLOCK, attn: str = "sdpa"):
    """A tiny SDAR- (no shift) or Fast-dLLM-v2-shaped (logit shift) block model with weights large enough that
    predictions depend on the context and confidences spread over (0, 1)."""
    build = build_tiny_sdar if fmt == "sdar" else build_tiny_fast_dllm_v2
    model = build(
        seed=seed, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS, block_size=block_size,
        attn_implementation=attn,
    )
    assert model.config.mask_token_id == MASK
    gen = torch.Generator().manual_seed(2000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = 1.0 if "embed" in name else (3.0 if "lm_head" in name else 1.5) / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


def run(model, ids, attention_mask=None, **overrides):
    settings = dict(gen_length=16, block_length=BLOCK, threshold=0.5, cache="dual", stop_at_eos=False)
    settings.update(overrides)
    if settings.get("unmasking") == "static":
        settings.setdefault("steps", settings["gen_length"] // 2)
    cfg = DiffusionGenerationConfig(**settings)
    seen = []
    out = diffusion_generate(model, ids, attention_mask, cfg, step_callback=lambda s, c: seen.append((s, c.clone())))
    check_invariants(out, ids, cfg, seen)
    return out, seen


def assert_same_decoding(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.commit_step, b.commit_step)
    assert torch.equal(a.num_steps, b.num_steps)
    assert a.nfe == b.nfe
    torch.testing.assert_close(a.commit_prob, b.commit_prob, **TOL)


# --------------------------------------------------------------------------------------------------
# cached = uncached, token for token
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("unmasking", ["dynamic", "static"])
@pytest.mark.parametrize("block_length", [BLOCK, 2], ids=["blocks", "sub-blocks"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_decoding_equals_uncached(fmt, unmasking, block_length, temperature):
    model = make_block_model(fmt, layers=3)
    for batch, prompt_len, seed in [(3, 5, 0), (2, 8, 1)]:  # a prompt padded to a block boundary, and one on it
        ids = prompts(batch, prompt_len, seed)
        kwargs = dict(unmasking=unmasking, block_length=block_length, temperature=temperature, seed=seed, gen_length=16)
        base, _ = run(model, ids, cache="none", **kwargs)
        for cache in ("prefix", "dual"):
            out, seen = run(model, ids, cache=cache, **kwargs)
            assert_same_decoding(out, base)
            check_replay(out, seen, prompt_len)
    if unmasking == "dynamic" and temperature == 0.0:
        assert (base.num_steps < 16).any(), "the threshold should commit several tokens in some step"


@pytest.mark.parametrize("fmt", FORMATS)
def test_finished_blocks_are_written_once_and_exact(fmt):
    """Each canvas position outside the block being decoded is written to the cache by one call only, and the cache
    ends up holding exactly what one forward over the final canvas gives (post-RoPE keys, values)."""
    model = make_block_model(fmt, layers=2)
    ids = prompts(2, 6, seed=2)
    writes = []  # (layer 0) canvas positions each call wrote
    original = BlockCache.update
    caches = []

    def recording(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            writes.append(range(self.window_start, self.window_start + key_states.shape[-2]))
            if not caches or caches[-1] is not self:
                caches.append(self)
        return original(self, key_states, value_states, layer_idx, *args, **kwargs)

    BlockCache.update = recording
    try:
        out, _ = run(model, ids, gen_length=12)
    finally:
        BlockCache.update = original
    prompt_width = 8  # 6 prompt tokens left-padded to the block boundary
    total = prompt_width + 12
    counts = torch.zeros(total, dtype=torch.long)
    for window in writes:
        counts[list(window)] += 1
    last_block = range(total - BLOCK, total)
    assert (counts[: total - BLOCK] >= 1).all()
    finished_writes = [w for w in writes if w.start < total - BLOCK]
    # A finished position is written by the steps of its own block and, once, by the first step of the next block
    # (the write that stays): no step of any later block rewrites it.
    for position in range(total - BLOCK):
        block_end = (position // BLOCK + 1) * BLOCK
        later = [w for w in finished_writes if position in w and w.stop > block_end]
        assert len(later) == 1, f"position {position} rewritten by {len(later)} later calls"
    assert out.nfe == len(writes) and any(w.start in last_block for w in writes)

    # The cache vs one uncached forward over the final canvas (through the model's own block-causal mask).
    canvas = torch.cat([torch.full((2, 2), MASK), out.sequences], dim=1)
    key_mask = torch.ones_like(canvas)
    key_mask[:, :2] = 0
    fresh = BlockCache(model.config.num_hidden_layers, total)
    with torch.no_grad():
        model(input_ids=canvas, attention_mask=key_mask, use_cache=True, **{cache_keyword(model): fresh})
    cached = caches[0]
    for layer, (ours, theirs) in enumerate(zip(cached.layers, fresh.layers)):
        finished = slice(2, total - BLOCK)  # real positions of every block but the last (its keys are transient)
        torch.testing.assert_close(ours.keys[..., finished, :], theirs.keys[..., finished, :], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.values[..., finished, :], theirs.values[..., finished, :], rtol=1e-5, atol=1e-5)


def test_cached_steps_feed_only_the_current_block():
    model = make_block_model("sdar", layers=1)
    fed = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        out, _ = run(model, prompts(2, 8, seed=3), gen_length=12)
    finally:
        hook.remove()
    # first step of each block: the previous block (or the 8-token prompt) and the block; later steps: the block
    assert fed[0] == 8 + BLOCK and set(fed[1:]) <= {BLOCK, 2 * BLOCK} and fed.count(2 * BLOCK) == 2
    assert len(fed) == out.nfe


# --------------------------------------------------------------------------------------------------
# batches, padding, the mask token, the recorded distributions
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("unmasking", ["dynamic", "static"])
def test_left_padded_batch_equals_rows_one_by_one(fmt, cache, unmasking):
    model = make_block_model(fmt, layers=2, attn="eager" if cache == "none" else "sdpa")  # both mask kinds
    lengths = [7, 4, 1, 5]
    width = max(lengths)
    ids = prompts(len(lengths), width, seed=4)  # random tokens in the padding: only the key mask hides them
    attention_mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        attention_mask[b, : width - n] = 0
    out, seen = run(model, ids, attention_mask, cache=cache, unmasking=unmasking, gen_length=16)
    check_replay(out, seen, width)
    if unmasking == "dynamic":
        assert len(set(out.num_steps.tolist())) > 1, "rows should progress at different speeds"
    for b, n in enumerate(lengths):
        alone, _ = run(model, ids[b : b + 1, width - n :], cache=cache, unmasking=unmasking, gen_length=16)
        assert torch.equal(out.completion_ids[b], alone.completion_ids[0]), f"row {b} (prompt of {n})"
        assert torch.equal(out.commit_step[b], alone.commit_step[0])
        torch.testing.assert_close(out.commit_prob[b], alone.commit_prob[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mask_token_is_never_emitted(fmt):
    model = with_head_bias(make_block_model(fmt, layers=1), MASK, 50.0)
    ids = prompts(3, 5, seed=5)
    for cache in ("none", "dual"):
        for temperature in (0.0, 1.0):
            run(model, ids, cache=cache, temperature=temperature, seed=0, block_length=2)  # run() checks no mask left


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_recorded_distribution_is_the_training_forwards(fmt, temperature):
    """The top-K each committed token was drawn from equals what one plain forward of its replayed state ``o_t``
    gives (mask token excluded, temperature applied): no cache approximation between rollout and training."""
    model = make_block_model(fmt, layers=3)
    lengths = [6, 3]
    ids = prompts(2, 6, seed=6)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    K = 6
    out, _ = run(model, ids, attention_mask, record_topk=K, temperature=temperature, seed=1, gen_length=12)
    shift = 1 if model.config.diffusion_logit_shift else 0
    for b, n in enumerate(lengths):
        prompt = ids[b, 6 - n :]
        pad = -n % BLOCK  # the canvas the sampler ran: the prompt left-padded to a block boundary
        for t in range(int(out.num_steps[b])):
            state = out.completion_ids[b].masked_fill(out.commit_step[b] >= t, MASK)
            canvas = torch.cat([torch.full((pad,), MASK), prompt, state])[None]
            key_mask = torch.ones_like(canvas)
            key_mask[0, :pad] = 0
            with torch.no_grad():
                logits = model(input_ids=canvas, attention_mask=key_mask).logits[0].double()
            logits = logits[pad + n - shift : pad + n - shift + 12]
            logits[:, MASK] = float("-inf")
            logps = (logits / (temperature or 1.0)).log_softmax(-1)
            committed = out.commit_step[b] == t
            values, indices = logps[committed].topk(K, dim=-1)
            assert torch.equal(out.topk_ids[b][committed], indices)
            torch.testing.assert_close(out.topk_logps[b][committed].double(), values, rtol=1e-5, atol=1e-5)
            chosen = logps[committed].gather(-1, out.completion_ids[b][committed, None]).squeeze(-1).exp()
            torch.testing.assert_close(out.commit_prob[b][committed].double(), chosen, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_early_stop_at_eos(fmt):
    model = with_head_bias(make_block_model(fmt, layers=1), EOS, 12.0)
    ids = prompts(3, 5, seed=7)
    full, _ = run(model, ids, gen_length=24)
    stopped, seen = run(model, ids, gen_length=24, stop_at_eos=True)
    assert stopped.nfe < full.nfe, "every row should hold an EOS early"
    check_replay(stopped, seen, 5)
    for b in range(3):
        n = int(stopped.completion_mask[b].sum())
        assert torch.equal(stopped.completion_ids[b, :n], full.completion_ids[b, :n])


def test_block_length_must_divide_the_model_block():
    model = make_block_model("sdar", layers=1, block_size=4)
    with pytest.raises(ValueError, match="block_length=8 does not divide"):
        run(model, prompts(1, 4), block_length=8)
    with pytest.raises(ValueError, match="block_length=3 does not divide"):
        run(model, prompts(1, 4), block_length=3, gen_length=12)
    with pytest.raises(ValueError, match="gen_length=6 is not a multiple"):
        run(model, prompts(1, 4), block_length=2, gen_length=6)
