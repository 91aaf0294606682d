"""Tests for the block-wise diffusion sampler (SPEC §1).

The oracles of SPEC §1.2 (a)–(e), the replay check of §1.3, the unmasking rules (static schedule, dynamic
threshold), candidate drawing (temperature, top-p / top-k, seeds), the recorded trajectory
(``commit_prob``, top-K), early stop at EOS and config validation.

Most checks recompute what the sampler should have seen with plain, uncached forwards through the model's
public 2-D-mask path, independently of the sampler's own forward helpers.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from dllm_trl.generation import (
    NEVER_COMMITTED,
    DiffusionGenerationConfig,
    diffusion_generate,
    draw_candidates,
    static_schedule,
)
from dllm_trl.generation.cache import CanvasCache, cache_keyword
from dllm_trl.generation.masked_diffusion import _block_window, _logits_at
from dllm_trl.models import attention_mask_4d, mask_dtype_for
from tests.tiny_models import build_tiny_dream, build_tiny_llada

VOCAB, MASK, EOS = 100, 99, 1
KINDS = ("llada", "dream")
CACHES = ("none", "prefix", "dual")
UNMASKINGS = ("dynamic", "static")
TOL = dict(rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def make_model(kind: str, layers: int = 1, seed: int = 0, head_gain: float = 3.0, attn: str = "sdpa"):
    """A tiny LLaDA- or Dream-shaped model whose random weights are large enough that predictions depend
    on the context and confidences spread over (0, 1) (default init gives near-uniform, context-free
    logits, which would make most oracles pass trivially)."""
    build = build_tiny_llada if kind == "llada" else build_tiny_dream
    extra = {"num_key_value_heads": 2} if kind == "dream" else {}
    model = build(
        seed=seed, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, eos_token_id=EOS, attn_implementation=attn, **extra,
    )
    assert model.config.mask_token_id == MASK
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 2:
                continue
            if "embed" in name:
                std = 1.0
            else:
                std = (head_gain if "lm_head" in name else 1.5) / math.sqrt(param.shape[1])
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


def with_head_bias(model, token: int, bias: float):
    """Give the LM head a bias that shifts ``token``'s logit by ``bias`` at every position."""
    old = model.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[token] = bias
    model.lm_head = head
    return model


def prompts(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random prompt ids, never the mask token nor EOS."""
    return torch.randint(2, MASK, (batch, length), generator=torch.Generator().manual_seed(seed))


def gen_config(**overrides) -> DiffusionGenerationConfig:
    defaults = dict(gen_length=16, block_length=8, threshold=0.5, cache="none", stop_at_eos=False)
    defaults.update(overrides)
    if defaults.get("unmasking") == "static" and "steps" not in overrides:
        defaults["steps"] = defaults["gen_length"] // 2
    return DiffusionGenerationConfig(**defaults)


def run(model, ids, attention_mask=None, generator=None, **overrides):
    """Generate and collect the canvases ``step_callback`` saw: a list of (step, canvas copy)."""
    cfg = gen_config(**overrides)
    seen = []
    out = diffusion_generate(
        model, ids, attention_mask, cfg, generator=generator, step_callback=lambda s, c: seen.append((s, c.clone()))
    )
    check_invariants(out, ids, cfg, seen)
    return out, seen


def check_invariants(out, ids, cfg, seen):
    batch, prompt_len = ids.shape
    gen = cfg.gen_length
    assert out.sequences.shape == (batch, prompt_len + gen)
    assert torch.equal(out.sequences[:, :prompt_len], ids)
    assert torch.equal(out.completion_ids, out.sequences[:, prompt_len:])
    assert not (out.completion_ids == MASK).any(), "a mask token survived decoding (oracle e)"
    committed = out.commit_step != NEVER_COMMITTED
    # Never-committed positions only come from an early stop at EOS and hold EOS.
    assert (out.completion_ids[~committed] == EOS).all()
    assert (out.commit_prob[~committed] == 0).all()
    assert ((out.commit_prob[committed] > 0) & (out.commit_prob[committed] <= 1 + 1e-6)).all()
    for b in range(batch):
        steps = out.commit_step[b][committed[b]]
        assert sorted(set(steps.tolist())) == list(range(int(out.num_steps[b]))), "row steps not dense from 0"
    # completion_mask: 1 up to and including the first EOS.
    is_eos = out.completion_ids == EOS
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), gen)
    expected = (torch.arange(gen)[None] <= first[:, None]).long()
    assert torch.equal(out.completion_mask, expected)
    assert out.nfe == len(seen)
    assert [s for s, _ in seen] == list(range(len(seen)))


def replay(out, prompt_len: int, t: int) -> torch.Tensor:
    """SPEC §1.3: every completion position with ``commit_step ≥ t`` masked."""
    canvas = out.sequences.clone()
    canvas[:, prompt_len:][out.commit_step >= t] = MASK
    return canvas


def row_canvases(seen, b: int, final: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Row ``b``'s canvases before each of its own steps (a row idles in lock-step: drop repeats), then
    ``final`` if given (a row that finishes before the others is also seen once in its final state)."""
    canvases = []
    for canvas in [c[b] for _, c in seen] + ([] if final is None else [final]):
        if not canvases or not torch.equal(canvases[-1], canvas):
            canvases.append(canvas)
    return canvases


def check_replay(out, seen, prompt_len: int):
    """For every row: the canvas before its step t is the final canvas with ``commit_step ≥ t`` masked."""
    for b in range(out.sequences.shape[0]):
        num_steps = int(out.num_steps[b])
        never = torch.cat([torch.zeros(prompt_len, dtype=torch.bool), out.commit_step[b] == NEVER_COMMITTED])
        # Positions filled with EOS after an early stop were masks while the sampler ran.
        final = out.sequences[b].masked_fill(never, MASK)
        canvases = row_canvases(seen, b, final)
        assert len(canvases) == num_steps + 1
        for t, canvas in enumerate(canvases):
            assert torch.equal(canvas, replay(out, prompt_len, t)[b]), f"row {b}: canvas before step {t} differs"
        assert (out.sequences[b][never] == EOS).all()


def full_forward_view(model, canvases, attention_mask=None):
    """Uncached forward through the public 2-D mask path: per canvas position, the mask-free distribution
    (log-probs, V) it is drawn from at temperature 0, shifted for Dream-style models."""
    with torch.no_grad():
        logits = model(input_ids=canvases, attention_mask=attention_mask).logits.double()
    if model.config.diffusion_logit_shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    logits[..., MASK] = float("-inf")
    return logits.log_softmax(-1)


def check_steps_against_full_forward(model, out, prompt_len, cfg, attention_mask=None):
    """Recompute every step of every row with an uncached forward on the replayed canvas.

    Checks the committed token (argmax at temperature 0), ``commit_prob`` (the plain softmax, mask
    excluded), and which positions were committed (dynamic threshold rule or static top-n). Returns
    counters so a test can assert that both dynamic branches were exercised.
    """
    block = cfg.block_length
    stats = {"multi": 0, "fallback": 0}
    for b in range(out.sequences.shape[0]):
        n = int(out.num_steps[b])
        canvases = torch.stack([replay(out, prompt_len, t)[b] for t in range(n)])
        mask = None if attention_mask is None else attention_mask[b : b + 1].expand(n, -1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones(n, cfg.gen_length, dtype=mask.dtype)], dim=1)
        logps = full_forward_view(model, canvases, mask)[:, prompt_len:]  # (n, G, V)
        conf, cand = logps.exp().max(-1)
        for t in range(n):
            completion = canvases[t, prompt_len:]
            masked = completion == MASK
            block_index = int(masked.int().argmax()) // block
            in_block = torch.zeros_like(masked)
            in_block[block_index * block : (block_index + 1) * block] = True
            candidates = masked & in_block
            committed = out.commit_step[b] == t
            assert not (committed & ~candidates).any(), "committed a position outside the block's masks"
            tokens = out.completion_ids[b][committed]
            torch.testing.assert_close(tokens, cand[t][committed])
            torch.testing.assert_close(out.commit_prob[b][committed].double(), conf[t][committed], **TOL)
            c = conf[t]
            if cfg.unmasking == "dynamic":
                above = candidates & (c >= cfg.threshold)
                near = candidates & ((c - cfg.threshold).abs() < 1e-5)
                if above.any():
                    assert torch.equal(committed & ~near, above & ~near), f"row {b} step {t}: threshold rule broken"
                    stats["multi"] += int(above.sum() > 1)
                else:
                    assert int(committed.sum()) == 1
                    assert c[committed].item() >= c[candidates].max().item() - 1e-6, "fallback is not the most confident"
                    stats["fallback"] += 1
            else:
                steps_per_block = cfg.total_steps // cfg.num_blocks
                expected = static_schedule(block, steps_per_block)[t % steps_per_block]
                assert int(committed.sum()) == expected
                left = candidates & ~committed
                if left.any():
                    assert c[committed].min().item() >= c[left].max().item() - 1e-6, "static did not take the top-n"
    return stats


# --------------------------------------------------------------------------------------------------
# config validation
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(gen_length=30, block_length=8), "gen_length"),
        (dict(gen_length=0), "gen_length"),
        (dict(gen_length=32, block_length=0), "block_length"),
        (dict(unmasking="greedy"), "unmasking"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(threshold=-0.1), "threshold"),
        (dict(threshold=float("nan")), "threshold"),
        (dict(gen_length=64, block_length=32, unmasking="static", steps=1), "steps"),  # too few
        (dict(gen_length=64, block_length=32, unmasking="static", steps=3), "steps"),  # not per-block
        (dict(gen_length=64, block_length=32, unmasking="static", steps=0), "steps"),
        (dict(gen_length=64, block_length=32, unmasking="static", steps=66), "steps"),  # > block_length per block
        (dict(gen_length=64, block_length=32, unmasking="dynamic", steps=32), "steps"),
        (dict(cache="full"), "cache"),
        (dict(sampling="beam"), "sampling"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(record_topk=-1), "record_topk"),
    ],
)
def test_config_rejects_invalid_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DiffusionGenerationConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(threshold=1.0, top_p=1.0, top_k=1, temperature=0.7, sampling="categorical", cache="prefix"),
        dict(gen_length=64, block_length=32, unmasking="static"),  # steps = gen_length
        dict(gen_length=64, block_length=32, unmasking="static", steps=2),  # one step per block
        dict(gen_length=64, block_length=32, unmasking="static", steps=64),
    ],
)
def test_config_accepts_valid_values(kwargs):
    cfg = DiffusionGenerationConfig(**kwargs)
    assert cfg.total_steps % cfg.num_blocks == 0


@pytest.mark.parametrize("block, steps", [(8, 3), (8, 8), (8, 1), (32, 5), (7, 2)])
def test_static_schedule_is_even_with_remainder_first(block, steps):
    schedule = static_schedule(block, steps)
    assert len(schedule) == steps and sum(schedule) == block
    assert max(schedule) - min(schedule) <= 1 and schedule == sorted(schedule, reverse=True)


# --------------------------------------------------------------------------------------------------
# drawing candidates
# --------------------------------------------------------------------------------------------------
def test_draw_candidates_excludes_mask_and_leaves_logits_alone():
    logits = torch.randn(4, 6, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[..., MASK] = 100.0  # the mask is by far the most likely token
    before = logits.clone()
    for temperature, sampling in [(0.0, "gumbel"), (1.0, "gumbel"), (1.0, "categorical")]:
        gen = torch.Generator().manual_seed(1)
        candidate, confidence, log_probs = draw_candidates(logits, MASK, temperature, None, None, sampling, gen)
        assert torch.equal(logits, before), "draw_candidates modified its input"
        assert not (candidate == MASK).any()
        assert (log_probs[..., MASK] == float("-inf")).all()
        torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(4, 6))
        torch.testing.assert_close(confidence, log_probs.gather(-1, candidate[..., None]).squeeze(-1).exp())
    # temperature 0: argmax of the mask-free logits, confidence its plain softmax probability
    candidate, confidence, _ = draw_candidates(logits, MASK, 0.0, 0.5, 3, "gumbel", None)
    free = logits.clone()
    free[..., MASK] = float("-inf")
    assert torch.equal(candidate, free.argmax(-1))
    torch.testing.assert_close(confidence, free.softmax(-1).max(-1).values)


@pytest.mark.parametrize("sampling", ["gumbel", "categorical"])
def test_draws_follow_the_truncated_tempered_softmax(sampling):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])  # id 5 is the mask
    n = 20000
    batch = logits.expand(n, -1)
    gen = torch.Generator().manual_seed(0)
    candidate, confidence, log_probs = draw_candidates(batch, 5, 0.5, None, None, sampling, gen)
    expected = logits[:5].div(0.5).softmax(-1)
    freq = torch.bincount(candidate, minlength=6).double() / n
    assert freq[5] == 0
    torch.testing.assert_close(freq[:5], expected.double(), atol=0.015, rtol=0)
    torch.testing.assert_close(confidence, expected[candidate])
    # top-p keeps the smallest prefix whose mass reaches p, top-k the k best; confidence is renormalised
    probs = logits[:5].softmax(-1)  # ≈ [.61, .22, .14, .08, .03]
    for top_p, top_k, support in [(0.7, None, [0, 1]), (None, 3, [0, 1, 2]), (0.95, 2, [0, 1]), (0.5, None, [0])]:
        candidate, confidence, log_probs = draw_candidates(batch[:4000], 5, 1.0, top_p, top_k, sampling, gen)
        assert set(candidate.unique().tolist()) == set(support)
        renormalised = probs[support] / probs[support].sum()
        torch.testing.assert_close(log_probs[0, support].exp(), renormalised)
        assert (log_probs[0, [i for i in range(6) if i not in support]] == float("-inf")).all()


# --------------------------------------------------------------------------------------------------
# oracle (a): right after a refresh, a cached step's logits equal a full forward's
# --------------------------------------------------------------------------------------------------
def sampler_call_inputs(model, key_mask):
    """What the sampler hands its one model call, built the same way: the canvas-order 4-D key mask and
    position ids (B, 1, P+G, P+G) / (B, P+G), of which a call feeding positions ``fed`` takes the rows."""
    batch, total = key_mask.shape
    mask_dtype = mask_dtype_for(model, torch.float32)
    mask = attention_mask_4d(key_mask.bool(), batch, 1, total, key_mask.device, mask_dtype)
    return mask.expand(batch, 1, total, total), torch.arange(total).expand(batch, total)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_step_after_refresh_equals_full_forward(kind, cache):
    model = make_model(kind, layers=2)  # exact at any depth: the canvas has not changed since the refresh
    prompt_len, gen, block = 6, 24, 8
    ids = prompts(3, prompt_len, seed=1)
    prompt_mask = torch.ones_like(ids)
    prompt_mask[1, :2] = 0  # a left-padded row
    prompt_mask[2, :5] = 0
    key_mask = torch.cat([prompt_mask, torch.ones(3, gen, dtype=prompt_mask.dtype)], dim=1)
    shift = 1 if kind == "dream" else 0
    total = prompt_len + gen
    mask, positions = sampler_call_inputs(model, key_mask)
    filler = torch.Generator().manual_seed(2)
    for block_index in range(gen // block):
        start, end = prompt_len + block_index * block, prompt_len + (block_index + 1) * block
        canvas = torch.cat([ids, torch.full((3, gen), MASK)], dim=1)
        canvas[:, prompt_len:start] = torch.randint(2, MASK, (3, start - prompt_len), generator=filler)
        partly = torch.rand(3, block, generator=filler) < 0.5  # some of the block already decoded
        canvas[:, start:end][partly] = torch.randint(2, MASK, (int(partly.sum()),), generator=filler)
        logit_index = torch.arange(start - shift, end - shift)
        rows, columns = torch.arange(3).repeat_interleave(block), logit_index.repeat(3)
        with torch.no_grad():
            reference = model(input_ids=canvas, attention_mask=key_mask).logits[:, logit_index].reshape(3 * block, -1)
            window = _block_window(cache, start, end, total, shift)
            kv = CanvasCache(model.config.num_hidden_layers, total)
            kv.window_start = window.start
            logits, kv = _logits_at(model, canvas, positions, mask, kv, rows, columns)
            torch.testing.assert_close(logits, reference, **TOL)
            assert kv.get_seq_length() == total
            storage = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.layers]
            for _ in range(2):  # the second call checks that the first left the cache as the refresh did
                logits, kv = _logits_at(
                    model, canvas[:, window], positions[:, window], mask[:, :, window], kv,
                    rows, columns - window.start,
                )
                torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
                assert kv.get_seq_length() == total
                assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.layers] == storage


def layer_keys_values(model, canvas, key_mask):
    """Post-RoPE keys/values (B, kv_heads, P+G, head_dim) of every layer in an uncached forward, through a
    reference ``DynamicCache`` (transformers' own bookkeeping)."""
    from transformers import DynamicCache

    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=canvas, attention_mask=key_mask, use_cache=True, **{cache_keyword(model): reference})
    return [(layer.keys, layer.values) for layer in reference.layers]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_step_writes_only_its_window_in_place(kind, cache):
    """A cached step overwrites exactly the window's slots of the refresh's key/value tensors (same storage),
    with the keys/values a full forward of the new canvas has there in the first layer (right rotary positions;
    deeper layers see cached, stale keys); every other slot keeps the refresh's values bit for bit."""
    model = make_model(kind, layers=2)
    prompt_len, gen, block, batch = 5, 16, 8, 3
    shift = 1 if kind == "dream" else 0
    total = prompt_len + gen
    ids = prompts(batch, prompt_len, seed=21)
    prompt_mask = torch.ones_like(ids)
    prompt_mask[2, :3] = 0
    key_mask = torch.cat([prompt_mask, torch.ones(batch, gen, dtype=prompt_mask.dtype)], dim=1)
    mask, positions = sampler_call_inputs(model, key_mask)
    start, end = prompt_len + block, prompt_len + 2 * block  # the second block
    window = _block_window(cache, start, end, total, shift)
    canvas = torch.cat([ids, torch.full((batch, gen), MASK)], dim=1)
    canvas[:, prompt_len:start] = prompts(batch, block, seed=22)
    rows, columns = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    kv = CanvasCache(model.config.num_hidden_layers, total)
    kv.window_start = window.start
    with torch.no_grad():
        _logits_at(model, canvas, positions, mask, kv, rows, columns)
        refreshed = [(layer.keys.clone(), layer.values.clone()) for layer in kv.layers]
        storage = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.layers]
        canvas[:, start : start + 3] = prompts(batch, 3, seed=23)  # the step decoded three positions
        _logits_at(model, canvas[:, window], positions[:, window], mask[:, :, window], kv, rows, columns)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.layers] == storage
    outside = torch.ones(total, dtype=torch.bool)
    outside[window] = False
    for (keys, values), (old_keys, old_values) in zip([(l.keys, l.values) for l in kv.layers], refreshed):
        assert torch.equal(keys[..., outside, :], old_keys[..., outside, :])
        assert torch.equal(values[..., outside, :], old_values[..., outside, :])
        assert not torch.equal(keys[..., window, :], old_keys[..., window, :])
    fresh_keys, fresh_values = layer_keys_values(model, canvas, key_mask)[0]
    torch.testing.assert_close(kv.layers[0].keys[..., window, :], fresh_keys[..., window, :], **TOL)
    torch.testing.assert_close(kv.layers[0].values[..., window, :], fresh_values[..., window, :], **TOL)


@pytest.mark.parametrize("cache", CACHES)
def test_decoding_warns_about_nothing(cache):
    """Newer transformers deprecate ``past_key_values=`` for ``cache=``: the sampler passes the cache under the
    name the installed version expects, so no deprecation (or any other) warning is raised."""
    model = make_model("llada", layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, prompts(2, 5, seed=24), cache=cache)


def test_canvas_cache_refuses_a_window_before_the_whole_canvas():
    kv = CanvasCache(num_layers=1, canvas_length=10)
    with pytest.raises(RuntimeError, match="whole canvas"):
        kv.update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_cache_mode_feeds_only_its_window(kind, cache):
    """The decoder sees the whole canvas at a block's first step and then only the cache mode's window;
    the LM head sees exactly the positions the step reads (each row's still-masked block positions)."""
    model = make_model(kind, layers=1)
    prompt_len, gen, block = 5, 16, 8
    fed, read = [], []
    hooks = [
        model.get_decoder().register_forward_pre_hook(
            lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        ),
        model.get_output_embeddings().register_forward_pre_hook(lambda module, args: read.append(args[0].shape[-2])),
    ]
    try:
        out, seen = run(model, prompts(3, prompt_len), cache=cache)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(fed) == len(read) == out.nfe
    shift = 1 if kind == "dream" else 0
    total = prompt_len + gen
    previous = None
    for (_, canvas), length, positions in zip(seen, fed, read):
        masked = canvas[:, prompt_len:] == MASK
        block_index = int(masked.any(0).int().argmax()) // block
        start = prompt_len + block_index * block
        window = {"none": total, "prefix": total - start + shift, "dual": block + shift}[cache]
        assert length == (total if block_index != previous else window)  # a full forward starts each block
        assert positions == int(masked[:, block_index * block : (block_index + 1) * block].sum())
        previous = block_index


# --------------------------------------------------------------------------------------------------
# oracle (b): with one layer, cached greedy decoding is token-identical to uncached decoding
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("unmasking", UNMASKINGS)
def test_one_layer_cache_is_exact(kind, unmasking):
    model = make_model(kind, layers=1)
    for batch, prompt_len, seed in [(4, 5, 0), (3, 9, 1)]:
        ids = prompts(batch, prompt_len, seed)
        base, _ = run(model, ids, cache="none", unmasking=unmasking)
        for cache in ("prefix", "dual"):
            out, seen = run(model, ids, cache=cache, unmasking=unmasking)
            assert torch.equal(out.sequences, base.sequences), f"{cache} cache changed the decoded tokens"
            assert torch.equal(out.commit_step, base.commit_step)
            assert torch.equal(out.num_steps, base.num_steps)
            assert out.nfe == base.nfe
            torch.testing.assert_close(out.commit_prob, base.commit_prob, **TOL)
            check_replay(out, seen, prompt_len)


@pytest.mark.parametrize("kind", KINDS)
def test_two_layer_cache_runs_but_is_an_approximation(kind):
    # With 2+ layers a cached key/value goes stale once the canvas changes: no equality is promised,
    # only a well-formed trajectory. The tiny model is sharp enough that the approximation is visible,
    # which shows the one-layer equality above is not trivially true.
    model = make_model(kind, layers=2)
    ids = prompts(4, 6, seed=5)
    base, _ = run(model, ids, cache="none")
    differs = False
    for cache in ("prefix", "dual"):
        out, seen = run(model, ids, cache=cache)
        check_replay(out, seen, ids.shape[1])
        differs |= not torch.allclose(out.commit_prob, base.commit_prob, **TOL)
    assert differs


# --------------------------------------------------------------------------------------------------
# oracle (c): left padding with a key mask gives the unpadded row's result
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("unmasking", UNMASKINGS)
def test_left_padding_matches_unpadded_rows(kind, cache, unmasking):
    model = make_model(kind, layers=2, attn="eager" if cache == "prefix" else "sdpa")  # both mask kinds
    lengths = [7, 4, 1]
    width = max(lengths)
    ids = prompts(len(lengths), width, seed=3)  # the padding holds random tokens: only the mask hides them
    attention_mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        attention_mask[b, : width - n] = 0
    out, seen = run(model, ids, attention_mask, cache=cache, unmasking=unmasking)
    check_replay(out, seen, width)
    for b, n in enumerate(lengths):
        alone, _ = run(model, ids[b : b + 1, width - n :], cache=cache, unmasking=unmasking)
        assert torch.equal(out.completion_ids[b], alone.completion_ids[0]), f"row {b} (padded by {width - n})"
        assert torch.equal(out.commit_step[b], alone.commit_step[0])
        torch.testing.assert_close(out.commit_prob[b], alone.commit_prob[0], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# oracle (d): a batch equals its rows run one by one
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("unmasking", UNMASKINGS)
def test_batch_equals_rows_one_by_one(kind, cache, unmasking):
    # Holds with 2 layers and a cache too: a row's cache only depends on its own canvas, and a row that
    # idles in lock-step does not change it.
    model = make_model(kind, layers=2)
    ids = prompts(4, 6, seed=4)
    out, _ = run(model, ids, cache=cache, unmasking=unmasking, gen_length=24)
    if unmasking == "dynamic":
        assert len(set(out.num_steps.tolist())) > 1, "rows should progress at different speeds"
    for b in range(ids.shape[0]):
        alone, _ = run(model, ids[b : b + 1], cache=cache, unmasking=unmasking, gen_length=24)
        assert torch.equal(out.sequences[b], alone.sequences[0])
        assert torch.equal(out.commit_step[b], alone.commit_step[0])
        assert out.num_steps[b] == alone.num_steps[0]
        torch.testing.assert_close(out.commit_prob[b], alone.commit_prob[0], **TOL)


# --------------------------------------------------------------------------------------------------
# oracle (e): no mask token remains, even when the model prefers it
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_mask_token_is_never_emitted(kind, cache):
    model = with_head_bias(make_model(kind, layers=1), MASK, 50.0)
    ids = prompts(3, 5, seed=6)
    canvas = torch.cat([ids, torch.full((3, 16), MASK)], dim=1)
    with torch.no_grad():
        assert (model(input_ids=canvas).logits.argmax(-1) == MASK).all(), "the model should prefer the mask"
    for unmasking in UNMASKINGS:
        for temperature, sampling in [(0.0, None), (1.0, "gumbel"), (1.0, "categorical")]:
            out, seen = run(
                model, ids, cache=cache, unmasking=unmasking, temperature=temperature, sampling=sampling, seed=0
            )  # run() asserts no mask is left
            check_replay(out, seen, ids.shape[1])


# --------------------------------------------------------------------------------------------------
# SPEC §1.3: the replay check
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("unmasking", UNMASKINGS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_reproduces_every_canvas_the_sampler_saw(kind, cache, unmasking, temperature):
    model = make_model(kind, layers=2)
    ids = prompts(3, 5, seed=7)
    attention_mask = torch.ones_like(ids)
    attention_mask[2, :3] = 0
    out, seen = run(
        model, ids, attention_mask, cache=cache, unmasking=unmasking, temperature=temperature, seed=11,
        gen_length=24, stop_at_eos=True,
    )
    check_replay(out, seen, ids.shape[1])
    # lock-step: every row whose current block still has masks commits at every step
    block, prompt_len = 8, ids.shape[1]
    canvases = [c for _, c in seen] + [out.sequences]
    for before, after in zip(canvases[:-1], canvases[1:]):
        masked = before[:, prompt_len:] == MASK
        current = int(masked.any(0).int().argmax()) // block
        active = masked[:, current * block : (current + 1) * block].any(1)
        changed = (before != after).any(1)
        assert torch.equal(changed & active, active)


# --------------------------------------------------------------------------------------------------
# unmasking rules and the recorded probabilities
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layers, cache", [(2, "none"), (1, "dual"), (1, "prefix")])
def test_dynamic_commits_every_candidate_above_threshold(kind, layers, cache):
    model = make_model(kind, layers=layers)
    ids = prompts(4, 5, seed=8)
    attention_mask = torch.ones_like(ids)
    attention_mask[3, :2] = 0
    totals = {"multi": 0, "fallback": 0}
    for threshold in (0.3, 0.5):
        cfg = gen_config(cache=cache, threshold=threshold, gen_length=24)
        out, seen = run(model, ids, attention_mask, cache=cache, threshold=threshold, gen_length=24)
        assert all(len(row_canvases(seen, b, out.sequences[b])) == out.num_steps[b] + 1 for b in range(4))
        stats = check_steps_against_full_forward(model, out, ids.shape[1], cfg, attention_mask)
        for key in totals:
            totals[key] += stats[key]
    assert totals["multi"] > 0 and totals["fallback"] > 0, "both dynamic branches must be exercised"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("steps", [6, 2, 16, 10])  # per block: [3,3,2], [8], [1]*8, [2,2,2,1,1]
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_static_commits_exactly_its_schedule(kind, steps, cache):
    layers = 2 if cache == "none" else 1  # both exact, so the top-n choice can be checked
    model = make_model(kind, layers=layers)
    ids = prompts(3, 5, seed=9)
    cfg = gen_config(unmasking="static", steps=steps, cache=cache)
    out, seen = run(model, ids, unmasking="static", steps=steps, cache=cache)
    steps_per_block = steps // cfg.num_blocks
    schedule = static_schedule(cfg.block_length, steps_per_block)
    assert out.nfe == steps and (out.num_steps == steps).all()
    for b in range(3):
        for k in range(cfg.num_blocks):
            block_steps = out.commit_step[b, k * cfg.block_length : (k + 1) * cfg.block_length]
            counts = torch.bincount(block_steps - k * steps_per_block, minlength=steps_per_block)
            assert counts.tolist() == schedule
    check_steps_against_full_forward(model, out, ids.shape[1], cfg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sampling, temperature, top_k, top_p", [
    ("gumbel", 0.0, None, None), ("gumbel", 0.8, 3, None), ("categorical", 1.0, None, 0.9),
])
def test_record_topk_is_consistent_with_commit_prob(kind, sampling, temperature, top_k, top_p):
    model = make_model(kind, layers=1)
    ids = prompts(3, 5, seed=10)
    K = 5
    out, _ = run(
        model, ids, cache="dual", record_topk=K, sampling=sampling, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=3,
    )
    logps, topk_ids = out.topk_logps, out.topk_ids
    assert logps.shape == topk_ids.shape == (3, 16, K)
    assert (logps[..., :-1] >= logps[..., 1:]).all(), "top-K log-probs must be sorted"
    assert not ((topk_ids == MASK) & (logps > float("-inf"))).any()
    assert (logps.exp().sum(-1) <= 1 + 1e-5).all()
    if top_k is not None:
        assert (logps[..., top_k:] == float("-inf")).all(), "truncated tokens have zero probability"
    committed_logp = out.commit_prob.log()
    hit = topk_ids == out.completion_ids[..., None]
    found = hit.any(-1)
    torch.testing.assert_close(logps[hit], committed_logp[found], **TOL)
    assert (committed_logp[~found] <= logps[~found][:, -1] + 1e-6).all()
    if temperature == 0:
        assert found.all() and (topk_ids[..., 0] == out.completion_ids).all()
        # the exact oracle: the top-K of the full forward on the replayed canvas
        prompt_len = ids.shape[1]
        for b in range(3):
            for t in range(int(out.num_steps[b])):
                committed = out.commit_step[b] == t
                view = full_forward_view(model, replay(out, prompt_len, t)[b : b + 1])[0, prompt_len:]
                values, indices = view[committed].topk(K, dim=-1)
                assert torch.equal(topk_ids[b][committed], indices)
                torch.testing.assert_close(logps[b][committed].double(), values, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# sampling: seeds, truncation
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", ["gumbel", "categorical"])
@pytest.mark.parametrize("truncation", [dict(), dict(top_p=0.9, top_k=20)])
def test_seed_determinism_without_touching_global_rng(sampling, truncation):
    model = make_model("llada", layers=2)
    ids = prompts(3, 5, seed=12)
    state = torch.get_rng_state()
    kwargs = dict(temperature=1.0, sampling=sampling, cache="dual", **truncation)
    first, _ = run(model, ids, seed=7, **kwargs)
    again, _ = run(model, ids, seed=7, **kwargs)
    explicit, _ = run(model, ids, generator=torch.Generator().manual_seed(7), **kwargs)
    other, _ = run(model, ids, seed=8, **kwargs)
    assert torch.equal(torch.get_rng_state(), state), "the global RNG state was touched"
    for out in (again, explicit):
        assert torch.equal(out.sequences, first.sequences)
        assert torch.equal(out.commit_step, first.commit_step)
        assert torch.equal(out.commit_prob, first.commit_prob)
    assert not torch.equal(other.sequences, first.sequences)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sampling", ["gumbel", "categorical"])
@pytest.mark.parametrize("truncation", [dict(top_k=1), dict(top_p=1e-6)])
def test_truncation_to_one_token_equals_greedy(kind, sampling, truncation):
    model = make_model(kind, layers=2)
    ids = prompts(3, 5, seed=13)
    # One position per block: the commit order is forced, so the tokens must match greedy exactly.
    greedy, _ = run(model, ids, block_length=1, gen_length=12)
    sampled, _ = run(model, ids, block_length=1, gen_length=12, temperature=1.0, sampling=sampling, seed=0, **truncation)
    assert torch.equal(sampled.sequences, greedy.sequences)
    assert (sampled.commit_prob == 1).all(), "a one-token distribution has probability 1"
    # and candidate by candidate on arbitrary logits
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    free = logits.clone()
    free[:, MASK] = float("-inf")
    candidate, _, _ = draw_candidates(logits, MASK, 1.0, truncation.get("top_p"), truncation.get("top_k"), sampling,
                                      torch.Generator().manual_seed(2))
    assert torch.equal(candidate, free.argmax(-1))


# --------------------------------------------------------------------------------------------------
# EOS: completion mask and early stop
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_early_stop_at_eos(kind, cache):
    model = with_head_bias(make_model(kind, layers=1), EOS, 6.0)  # the model emits EOS with high probability
    ids = prompts(3, 5, seed=14)
    kwargs = dict(cache=cache, gen_length=32, block_length=8)
    stopped, seen = run(model, ids, stop_at_eos=True, **kwargs)
    full, _ = run(model, ids, stop_at_eos=False, **kwargs)
    assert stopped.nfe < full.nfe
    never = stopped.commit_step == NEVER_COMMITTED
    assert never.any() and never[:, -8:].all(), "the blocks after the stop are never decoded"
    decoded = never.int().argmax(1)
    for b in range(3):
        n = int(decoded[b])
        assert (never[b, n:]).all() and not never[b, :n].any() and n % 8 == 0
        assert (stopped.completion_ids[b, n:] == EOS).all()
        assert (stopped.completion_ids[b, :n] == EOS).any(), "a row stopped before emitting EOS"
        assert stopped.completion_mask[b, n:].sum() == 0
        # stopping does not change what had been decoded
        assert torch.equal(stopped.completion_ids[b, :n], full.completion_ids[b, :n])
        assert torch.equal(stopped.commit_step[b, :n], full.commit_step[b, :n])
    check_replay(stopped, seen, ids.shape[1])


def test_no_early_stop_while_a_row_lacks_eos():
    model = with_head_bias(make_model("llada", layers=1), EOS, -50.0)  # never emits EOS
    ids = prompts(2, 5, seed=15)
    stopped, _ = run(model, ids, stop_at_eos=True, gen_length=24)
    full, _ = run(model, ids, stop_at_eos=False, gen_length=24)
    assert stopped.nfe == full.nfe and torch.equal(stopped.sequences, full.sequences)
    assert (stopped.completion_mask == 1).all()


def test_completion_mask_ends_at_first_eos():
    model = with_head_bias(make_model("dream", layers=1), EOS, 2.5)  # EOS now and then, mid-completion
    ids = prompts(6, 5, seed=16)
    out, _ = run(model, ids, gen_length=24)  # run() checks the mask against the first EOS of every row
    lengths = out.completion_mask.sum(1)
    assert ((lengths > 1) & (lengths < 24)).any(), "want a row whose completion ends mid-way"
    for b in range(6):
        n = int(lengths[b])
        assert (out.completion_ids[b, : n - 1] != EOS).all()
        if n < 24:
            assert out.completion_ids[b, n - 1] == EOS
