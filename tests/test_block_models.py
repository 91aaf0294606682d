"""Block-diffusion checkpoints (SDAR / TraDo, Fast-dLLM v2) as transformers models with a block-causal mask (SPEC §7).

Tiny checkpoints are written here in the official formats, from the conventions of the public modeling code:

* SDAR / TraDo (Gen-Verse ``SDARForCausalLM``): ``model_type: "sdar"``, Qwen3 config keys (``head_dim``,
  ``attention_bias``, ``rope_theta``, ``tie_word_embeddings`` …) and Qwen3 weight names (per-head ``q_norm`` /
  ``k_norm``); no block size or mask id in the config (both are run settings of the public sampler);
* Fast-dLLM v2 (NVlabs ``Fast_dLLM_QwenForCausalLM``): ``model_type: "Fast_dLLM_Qwen"``, Qwen2 keys plus ``bd_size``,
  Qwen2.5 weight names (q/k/v biases). Its inference mask is plain block-causal over absolute positions
  (``q // block >= k // block``); its sub-blocks (``small_block_size``) only order the decoding inside a block and
  never enter the mask; its logits are shifted right by one ("token shift").

They are loaded through ``load_diffusion_model`` and compared with a plain float64 reference forward written from
scratch below, whose mask is the public code's block-causal one built with Python loops.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

from dllm_trl.families import load_diffusion_model
from dllm_trl.models import (
    block_causal_mask,
    completion_logits,
    diffusion_block_size,
    diffusion_config,
    is_bidirectional,
)

from .test_models import _rms_norm, _rope, dream_raw_config, dream_weights, llada_raw_config, llada_weights, write_checkpoint

F64 = torch.float64
VOCAB = 96
MASK, EOS = 92, 93
BLOCK = 4
FORMATS = ("sdar", "fast_dllm_v2")


# --------------------------------------------------------------------------------------------------
# official-format checkpoint writers
# --------------------------------------------------------------------------------------------------
def sdar_raw_config(**overrides) -> dict:
    """A tiny config.json with the keys of the published SDAR / TraDo checkpoints (Qwen3 keys, remote code)."""
    config = {
        "architectures": ["SDARForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "bos_token_id": EOS,
        "eos_token_id": EOS,
        "fuse_cross_entropy": True,
        "head_dim": 16,  # != hidden_size / num_attention_heads, as in Qwen3
        "hidden_act": "silu",
        "hidden_size": 48,
        "initializer_range": 0.02,
        "intermediate_size": 80,
        "max_position_embeddings": 128,
        "max_window_layers": 2,
        "model_type": "sdar",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": EOS,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.4",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    config.update(overrides)
    return config


def fast_dllm_v2_raw_config(**overrides) -> dict:
    """A tiny config.json with the keys of the published Fast-dLLM v2 checkpoints (Qwen2 keys + ``bd_size``)."""
    config = dream_raw_config(
        architectures=["Fast_dLLM_QwenForCausalLM"],
        auto_map={
            "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
            "AutoModel": "modeling.Fast_dLLM_QwenModel",
            "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
        },
        model_type="Fast_dLLM_Qwen",
        bd_size=BLOCK,
        layer_types=["full_attention", "full_attention"],
        eos_token_id=EOS,
        bos_token_id=EOS,
        pad_token_id=EOS,
        transformers_version="4.53.1",
    )
    del config["mask_token_id"]  # the public generate() takes it as an argument (151665 by default)
    config.update(overrides)
    return config


def sdar_weights(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under SDAR's (= Qwen3's) parameter names (float32)."""
    gen = torch.Generator().manual_seed(seed)
    d, f, vocab, hd = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"], raw["head_dim"]
    q, kv = raw["num_attention_heads"] * hd, raw["num_key_value_heads"] * hd
    s = 1.0 / math.sqrt(d)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": randn(vocab, d)}
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + randn(d, std=0.1)
        w[p + "self_attn.q_proj.weight"] = randn(q, d, std=2 * s)
        w[p + "self_attn.k_proj.weight"] = randn(kv, d, std=2 * s)
        w[p + "self_attn.v_proj.weight"] = randn(kv, d, std=s)
        w[p + "self_attn.o_proj.weight"] = randn(d, q, std=1.0 / math.sqrt(q))
        if raw["attention_bias"]:
            for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", d)):
                w[p + f"self_attn.{name}.bias"] = randn(size, std=0.3)
        w[p + "self_attn.q_norm.weight"] = 1.0 + randn(hd, std=0.3)
        w[p + "self_attn.k_norm.weight"] = 1.0 + randn(hd, std=0.3)
        w[p + "post_attention_layernorm.weight"] = 1.0 + randn(d, std=0.1)
        w[p + "mlp.gate_proj.weight"] = randn(f, d, std=s)
        w[p + "mlp.up_proj.weight"] = randn(f, d, std=s)
        w[p + "mlp.down_proj.weight"] = randn(d, f, std=1.0 / math.sqrt(f))
    w["model.norm.weight"] = 1.0 + randn(d, std=0.1)
    if not raw["tie_word_embeddings"]:
        w["lm_head.weight"] = randn(vocab, d, std=3 * s)
    return w


RAW = {"sdar": sdar_raw_config, "fast_dllm_v2": fast_dllm_v2_raw_config}
WEIGHTS = {"sdar": sdar_weights, "fast_dllm_v2": dream_weights}
CLASS = {"sdar": Qwen3ForCausalLM, "fast_dllm_v2": Qwen2ForCausalLM}
LOAD_ARGS = {"sdar": dict(block_size=BLOCK, mask_token_id=MASK), "fast_dllm_v2": dict(mask_token_id=MASK)}
F32 = dict(dtype=torch.float32)  # the configs say bfloat16, which transformers would load by default


# --------------------------------------------------------------------------------------------------
# plain reference forward (float64), the public code's block-causal mask
# --------------------------------------------------------------------------------------------------
def official_block_mask(length: int, block_size: int, key_padding=None) -> torch.Tensor:
    """(B, 1, L, L) additive mask: query ``q`` sees key ``k`` iff ``q // block >= k // block`` (SDAR's
    ``tril(ones(nb, nb)).repeat_interleave(block)``, Fast-dLLM v2's ``eval_block_diff_mask``) and ``k`` is real."""
    batch = 1 if key_padding is None else key_padding.shape[0]
    bias = torch.zeros(batch, 1, length, length, dtype=F64)
    for b in range(batch):
        for q in range(length):
            for k in range(length):
                real = key_padding is None or bool(key_padding[b, k])
                if not (q // block_size >= k // block_size and real):
                    bias[b, 0, q, k] = float("-inf")
    return bias


def reference_logits(fmt: str, raw: dict, weights: dict, input_ids, block_size: int) -> torch.Tensor:
    """Block-causal transformer forward from scratch (Qwen3 layout for SDAR, Qwen2.5 for Fast-dLLM v2), unshifted."""
    w = {k: v.to(F64) for k, v in weights.items()}
    batch, length = input_ids.shape
    n_heads, n_kv = raw["num_attention_heads"], raw["num_key_value_heads"]
    hd = raw.get("head_dim") or raw["hidden_size"] // n_heads
    eps, theta = raw["rms_norm_eps"], raw["rope_theta"]
    positions = torch.arange(length).expand(batch, length)
    bias = official_block_mask(length, block_size)

    h = w["model.embed_tokens.weight"][input_ids]
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms_norm(h, w[p + "input_layernorm.weight"], eps)

        def proj(name):
            return x @ w[p + f"self_attn.{name}.weight"].T + w.get(p + f"self_attn.{name}.bias", 0.0)

        q = proj("q_proj").view(batch, length, n_heads, hd)
        k = proj("k_proj").view(batch, length, n_kv, hd)
        v = proj("v_proj").view(batch, length, n_kv, hd).transpose(1, 2)
        if fmt == "sdar":  # Qwen3: RMSNorm over each head's dimensions, before RoPE
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q.transpose(1, 2), positions, theta), _rope(k.transpose(1, 2), positions, theta)
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        attn = ((q @ k.transpose(-1, -2)) / math.sqrt(hd) + bias).softmax(-1) @ v
        out = attn.transpose(1, 2).reshape(batch, length, n_heads * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = h + out + w.get(p + "self_attn.o_proj.bias", 0.0)
        x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return _rms_norm(h, w["model.norm.weight"], eps) @ head.T


# --------------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(format, shards): (path, raw_config, weights)}."""
    out = {}
    for fmt in FORMATS:
        raw = RAW[fmt]()
        weights = WEIGHTS[fmt](raw, seed=3 if fmt == "sdar" else 4)
        for shards in (1, 2):
            path = write_checkpoint(tmp_path_factory.mktemp(f"{fmt}{shards}"), raw, weights, shards=shards)
            out[fmt, shards] = (path, raw, weights)
    return out


def _ids(batch, length, seed=0, high=80):
    return torch.randint(0, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# --------------------------------------------------------------------------------------------------
# fidelity: official formats vs. the reference forward
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 2], ids=["single", "sharded"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_official_checkpoint_matches_reference(checkpoints, fmt, shards):
    path, raw, weights = checkpoints[fmt, shards]
    model = load_diffusion_model(path, dtype=F64, **LOAD_ARGS[fmt])
    assert type(model) is CLASS[fmt] and is_bidirectional(model)
    cfg = model.config
    assert diffusion_block_size(model) == cfg.diffusion_block_size == BLOCK
    assert cfg.mask_token_id == MASK and cfg.eos_token_id == EOS
    assert cfg.diffusion_logit_shift is (fmt == "fast_dllm_v2")  # Fast-dLLM v2's token shift; SDAR has none
    assert cfg.diffusion_sampling == "categorical"
    assert all(not m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
    if fmt == "sdar":
        torch.testing.assert_close(model.model.layers[1].self_attn.k_norm.weight,
                                   weights["model.layers.1.self_attn.k_norm.weight"].to(F64))
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 48)  # head_dim 16 × 4 heads
    torch.testing.assert_close(model.lm_head.weight, weights["lm_head.weight"].to(F64))

    ids = _ids(2, 11, seed=5)  # 11 = two full blocks and a partial one
    ref = reference_logits(fmt, raw, weights, ids, BLOCK)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(model, ids, torch.ones_like(ids)), ref, rtol=1e-5, atol=1e-5)
    for impl in ("eager", "sdpa"):
        model32 = load_diffusion_model(path, dtype=torch.float32, attn_implementation=impl, **LOAD_ARGS[fmt])
        torch.testing.assert_close(_logits(model32, ids).to(F64), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_sdar_variants_tied_head_and_biases(tmp_path, tie):
    """``tie_word_embeddings`` as the config says (SDAR-1.7B ties, SDAR-8B does not) and ``attention_bias`` on
    q/k/v/o."""
    raw = sdar_raw_config(tie_word_embeddings=tie, attention_bias=True, num_key_value_heads=1)
    weights = sdar_weights(raw, seed=6)
    assert ("lm_head.weight" in weights) is not tie
    model = load_diffusion_model(write_checkpoint(tmp_path, raw, weights), dtype=F64, **LOAD_ARGS["sdar"])
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tie
    ids = _ids(3, 9, seed=7)
    torch.testing.assert_close(_logits(model, ids), reference_logits("sdar", raw, weights, ids, BLOCK), rtol=1e-5, atol=1e-5)


def test_block_size_and_mask_token_sources(tmp_path):
    sdar = write_checkpoint(tmp_path / "sdar", sdar_raw_config(), sdar_weights(sdar_raw_config()))
    with pytest.raises(ValueError, match="block_size="):
        load_diffusion_model(sdar, mask_token_id=MASK)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # SDAR's <|MASK|> 151669 is not in a tiny vocab
        load_diffusion_model(sdar, block_size=BLOCK)
    assert load_diffusion_model(sdar, block_size=8, mask_token_id=MASK).config.diffusion_block_size == 8

    raw = fast_dllm_v2_raw_config(bd_size=8, mask_token_id=MASK)
    fast = write_checkpoint(tmp_path / "fast", raw, dream_weights(raw))
    model = load_diffusion_model(fast)
    assert model.config.diffusion_block_size == 8 and model.config.mask_token_id == MASK  # bd_size, config's mask
    assert not hasattr(model.config, "bd_size")
    assert load_diffusion_model(fast, block_size=2).config.diffusion_block_size == 2

    llada = write_checkpoint(tmp_path / "llada", llada_raw_config(), llada_weights(llada_raw_config()))
    with pytest.raises(ValueError, match="bidirectional"):
        load_diffusion_model(llada, block_size=4)
    sliding = write_checkpoint(tmp_path / "sliding", sdar_raw_config(use_sliding_window=True, sliding_window=8),
                               sdar_weights(sdar_raw_config()))
    with pytest.raises(ValueError, match="sliding-window"):
        load_diffusion_model(sliding, block_size=BLOCK, mask_token_id=MASK)
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(sdar_raw_config(model_type="sdar_moe")))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_diffusion_model(str(tmp_path / "moe"), block_size=BLOCK, mask_token_id=MASK)
    with pytest.raises(ValueError, match="block_size"):
        load_diffusion_model(sdar, block_size=0, mask_token_id=MASK)


# --------------------------------------------------------------------------------------------------
# the block-causal mask
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_is_causal_across_blocks_and_bidirectional_inside(checkpoints, fmt, impl):
    path, _, _ = checkpoints[fmt, 1]
    model = load_diffusion_model(path, attn_implementation=impl, **F32, **LOAD_ARGS[fmt])
    ids = _ids(1, 12, seed=9)
    base = _logits(model, ids)
    for changed_at in (5, 7):  # inside block 1 (positions 4–7)
        other = ids.clone()
        other[0, changed_at] = (other[0, changed_at] + 1) % 80
        delta = (_logits(model, other) - base).abs().amax(-1)[0]
        assert delta[:4].max() == 0, "an earlier block saw a later token"
        assert delta[4:8].min() > 1e-4, "a position missed a token of its own block"
        assert delta[8:].min() > 1e-4, "a later block missed an earlier token"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_explicit_mask_equals_the_hooks_mask(checkpoints, impl):
    path, raw, weights = checkpoints["sdar", 1]
    model = load_diffusion_model(path, attn_implementation=impl, **F32, **LOAD_ARGS["sdar"])
    ids = _ids(2, 10, seed=11)
    keys = torch.ones_like(ids)
    columns = torch.arange(10)
    explicit = block_causal_mask(keys, columns // BLOCK, columns // BLOCK, columns,
                                 additive_dtype=torch.float32 if impl == "eager" else None)
    torch.testing.assert_close(_logits(model, ids, explicit), _logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_left_padding_and_prompt_alignment(checkpoints, fmt):
    """Blocks count from the first column (the public code's convention), so left padding by a whole block changes
    nothing, and the scoring pass aligns any left-padded prompt to a block boundary: its completion logits equal the
    unpadded prompt's."""
    path, _, _ = checkpoints[fmt, 1]
    model = load_diffusion_model(path, **F32, **LOAD_ARGS[fmt])
    row = _ids(1, 7, seed=13)
    alone = _logits(model, row)[0]
    padded = torch.cat([torch.full((1, BLOCK), 3), row], 1)
    mask = torch.ones_like(padded)
    mask[0, :BLOCK] = 0
    torch.testing.assert_close(_logits(model, padded, mask)[0, BLOCK:], alone, rtol=1e-5, atol=1e-5)

    prompt, state = row[:, :5], _ids(1, 8, seed=14)
    state[0, 4:] = MASK
    reference = completion_logits(model, prompt, torch.ones_like(prompt), state)
    for pad in (1, 2, 3, 6):
        ids = torch.cat([torch.full((1, pad), 5), prompt], 1)
        prompt_mask = torch.ones_like(ids)
        prompt_mask[0, :pad] = 0
        torch.testing.assert_close(completion_logits(model, ids, prompt_mask, state), reference, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# save / reload, PEFT
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_reload_round_trip(checkpoints, fmt, tmp_path):
    path, _, _ = checkpoints[fmt, 2]
    model = load_diffusion_model(path, **F32, **LOAD_ARGS[fmt])
    ids = _ids(2, 9, seed=15)
    before = _logits(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == ("qwen3" if fmt == "sdar" else "qwen2")  # a plain checkpoint, no remote code
    assert saved["diffusion_block_size"] == BLOCK and saved["mask_token_id"] == MASK and "auto_map" not in saved
    reloaded = load_diffusion_model(str(tmp_path))  # no block size, no mask id needed
    assert type(reloaded) is CLASS[fmt]
    for key in ("diffusion_block_size", "mask_token_id", "diffusion_logit_shift", "diffusion_sampling"):
        assert getattr(reloaded.config, key) == getattr(model.config, key), key
    torch.testing.assert_close(_logits(reloaded, ids), before, rtol=1e-5, atol=1e-5)


def test_lora_keeps_the_block_structure(checkpoints):
    from peft import LoraConfig, get_peft_model

    path, raw, weights = checkpoints["sdar", 1]
    model = get_peft_model(
        load_diffusion_model(path, **F32, **LOAD_ARGS["sdar"]),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False),
    )
    assert diffusion_block_size(model) == BLOCK and diffusion_config(model).mask_token_id == MASK
    ids = _ids(1, 8, seed=17)
    other = ids.clone()
    other[0, 6] += 1
    delta = (_logits(model, other) - _logits(model, ids)).abs().amax(-1)[0]
    assert delta[:4].max() == 0 and delta[4:].min() > 1e-4
    model.train()
    model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in model.named_parameters() if "lora_" in n)
