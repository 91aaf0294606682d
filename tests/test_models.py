"""Tests for loading LLaDA / Dream checkpoints as bidirectional transformers models (SPEC §4).

Tiny checkpoints are written here in the *official* LLaDA (OLMo-style names, LLaDA config keys) and Dream
(Qwen2 names, ``model_type: "Dream"``) formats, loaded through ``load_diffusion_model`` and compared to a
plain float64 reference forward written from scratch below (embeddings, RMSNorm, rotate-half RoPE,
bidirectional multi-head attention with a key padding mask and GQA, SwiGLU, final norm, untied head).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

from dllm_trl.families import load_diffusion_model
from dllm_trl.models import (
    attention_mask_4d,
    diffusion_config,
    is_bidirectional,
)

F64 = torch.float64

VOCAB = 96
LLADA_MASK, LLADA_EOS = 90, 91
DREAM_MASK, DREAM_EOS = 92, 93


# --------------------------------------------------------------------------------------------------
# official-format checkpoint writers
# --------------------------------------------------------------------------------------------------
def llada_raw_config(**overrides) -> dict:
    """A tiny config.json with the keys of the published LLaDA-8B checkpoint (OLMo-derived)."""
    config = {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": 48,
        "embedding_dropout": 0.0,
        "embedding_size": VOCAB,
        "eos_token_id": LLADA_EOS,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": LLADA_MASK,
        "max_sequence_length": 128,
        "mlp_hidden_size": 80,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": 4,
        "n_kv_heads": 4,
        "n_layers": 2,
        "pad_token_id": LLADA_EOS,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": VOCAB,
        "weight_tying": False,
    }
    config.update(overrides)
    return config


def dream_raw_config(**overrides) -> dict:
    """A tiny config.json with the keys of the published Dream-v0-Instruct-7B checkpoint (Qwen2 keys)."""
    config = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": DREAM_EOS,
        "eos_token_id": DREAM_EOS,
        "hidden_act": "silu",
        "hidden_size": 48,
        "initializer_range": 0.02,
        "intermediate_size": 80,
        "mask_token_id": DREAM_MASK,
        "max_position_embeddings": 128,
        "max_window_layers": 2,
        "model_type": "Dream",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": DREAM_EOS,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    config.update(overrides)
    return config


def _randn(gen, *shape, std=1.0):
    return torch.randn(*shape, generator=gen) * std


def llada_weights(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under LLaDA's own parameter names (float32)."""
    gen = torch.Generator().manual_seed(seed)
    d, f, vocab = raw["d_model"], raw["mlp_hidden_size"], raw["embedding_size"] or raw["vocab_size"]
    hd = d // raw["n_heads"]
    kv = raw["n_kv_heads"] * hd
    s = 1.0 / math.sqrt(d)
    w = {"model.transformer.wte.weight": _randn(gen, vocab, d)}
    for i in range(raw["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        w[p + "attn_norm.weight"] = 1.0 + _randn(gen, d, std=0.1)
        w[p + "q_proj.weight"] = _randn(gen, d, d, std=2 * s)
        w[p + "k_proj.weight"] = _randn(gen, kv, d, std=2 * s)
        w[p + "v_proj.weight"] = _randn(gen, kv, d, std=s)
        w[p + "attn_out.weight"] = _randn(gen, d, d, std=s)
        w[p + "ff_norm.weight"] = 1.0 + _randn(gen, d, std=0.1)
        w[p + "ff_proj.weight"] = _randn(gen, f, d, std=s)
        w[p + "up_proj.weight"] = _randn(gen, f, d, std=s)
        w[p + "ff_out.weight"] = _randn(gen, d, f, std=1.0 / math.sqrt(f))
    w["model.transformer.ln_f.weight"] = 1.0 + _randn(gen, d, std=0.1)
    w["model.transformer.ff_out.weight"] = _randn(gen, vocab, d, std=s)
    return w


def dream_weights(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Dream's (= Qwen2's) parameter names, qkv with biases (float32)."""
    gen = torch.Generator().manual_seed(seed)
    d, f, vocab = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    hd = d // raw["num_attention_heads"]
    kv = raw["num_key_value_heads"] * hd
    s = 1.0 / math.sqrt(d)
    w = {"model.embed_tokens.weight": _randn(gen, vocab, d)}
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + _randn(gen, d, std=0.1)
        w[p + "self_attn.q_proj.weight"] = _randn(gen, d, d, std=2 * s)
        w[p + "self_attn.q_proj.bias"] = _randn(gen, d, std=0.3)
        w[p + "self_attn.k_proj.weight"] = _randn(gen, kv, d, std=2 * s)
        w[p + "self_attn.k_proj.bias"] = _randn(gen, kv, std=0.3)
        w[p + "self_attn.v_proj.weight"] = _randn(gen, kv, d, std=s)
        w[p + "self_attn.v_proj.bias"] = _randn(gen, kv, std=0.3)
        w[p + "self_attn.o_proj.weight"] = _randn(gen, d, d, std=s)
        w[p + "post_attention_layernorm.weight"] = 1.0 + _randn(gen, d, std=0.1)
        w[p + "mlp.gate_proj.weight"] = _randn(gen, f, d, std=s)
        w[p + "mlp.up_proj.weight"] = _randn(gen, f, d, std=s)
        w[p + "mlp.down_proj.weight"] = _randn(gen, d, f, std=1.0 / math.sqrt(f))
    w["model.norm.weight"] = 1.0 + _randn(gen, d, std=0.1)
    w["lm_head.weight"] = _randn(gen, vocab, d, std=s)
    return w


def write_checkpoint(path, raw_config: dict, weights: dict[str, torch.Tensor], shards: int = 1) -> str:
    """config.json + ``model.safetensors`` (or ``shards`` files with a ``model.safetensors.index.json``)."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw_config, f, indent=2)
    weights = {k: v.contiguous() for k, v in weights.items()}
    if shards == 1:
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(weights)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: weights[n] for n in names[s * per_shard : (s + 1) * per_shard]}
        save_file(chunk, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return path


# --------------------------------------------------------------------------------------------------
# plain reference forward (float64, torch only), written from the raw weights
# --------------------------------------------------------------------------------------------------
def _llada_layer(w, i):
    p = f"model.transformer.blocks.{i}."
    return {
        "ln1": w[p + "attn_norm.weight"], "q": w[p + "q_proj.weight"], "k": w[p + "k_proj.weight"],
        "v": w[p + "v_proj.weight"], "o": w[p + "attn_out.weight"], "ln2": w[p + "ff_norm.weight"],
        "gate": w[p + "ff_proj.weight"], "up": w[p + "up_proj.weight"], "down": w[p + "ff_out.weight"],
    }


def _dream_layer(w, i):
    p = f"model.layers.{i}."
    return {
        "ln1": w[p + "input_layernorm.weight"], "q": w[p + "self_attn.q_proj.weight"],
        "k": w[p + "self_attn.k_proj.weight"], "v": w[p + "self_attn.v_proj.weight"],
        "qb": w[p + "self_attn.q_proj.bias"], "kb": w[p + "self_attn.k_proj.bias"],
        "vb": w[p + "self_attn.v_proj.bias"], "o": w[p + "self_attn.o_proj.weight"],
        "ln2": w[p + "post_attention_layernorm.weight"], "gate": w[p + "mlp.gate_proj.weight"],
        "up": w[p + "mlp.up_proj.weight"], "down": w[p + "mlp.down_proj.weight"],
    }


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x, positions, theta):
    """Rotate-half RoPE. x: (B, H, L, hd); positions: (B, L)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=F64) / hd)
    angles = positions.to(F64)[..., None] * inv_freq  # (B, L, hd/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, L, hd)
    return x * angles.cos() + _rotate_half(x) * angles.sin()


def reference_logits(family: str, raw: dict, weights: dict, input_ids, attention_mask=None, positions=None):
    """Bidirectional transformer forward from scratch; Dream's logits are returned *unshifted*."""
    w = {k: v.to(F64) for k, v in weights.items()}
    if family == "llada":
        n_layers, n_heads, n_kv = raw["n_layers"], raw["n_heads"], raw["n_kv_heads"]
        eps, theta = raw["rms_norm_eps"], raw["rope_theta"]
        emb, final_norm, head = w["model.transformer.wte.weight"], w["model.transformer.ln_f.weight"], w[
            "model.transformer.ff_out.weight"]
        layer = _llada_layer
    else:
        n_layers, n_heads, n_kv = raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"]
        eps, theta = raw["rms_norm_eps"], raw["rope_theta"]
        emb, final_norm, head = w["model.embed_tokens.weight"], w["model.norm.weight"], w["lm_head.weight"]
        layer = _dream_layer
    batch, length = input_ids.shape
    if positions is None:
        positions = torch.arange(length).expand(batch, length)
    keep = torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    key_bias = torch.zeros(batch, 1, 1, length, dtype=F64).masked_fill(~keep[:, None, None, :], float("-inf"))

    h = emb[input_ids]
    d = h.shape[-1]
    hd = d // n_heads
    for i in range(n_layers):
        p = layer(w, i)
        x = _rms_norm(h, p["ln1"], eps)
        q = x @ p["q"].T + p.get("qb", 0.0)
        k = x @ p["k"].T + p.get("kb", 0.0)
        v = x @ p["v"].T + p.get("vb", 0.0)
        q = q.view(batch, length, n_heads, hd).transpose(1, 2)
        k = k.view(batch, length, n_kv, hd).transpose(1, 2)
        v = v.view(batch, length, n_kv, hd).transpose(1, 2)
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        k = k.repeat_interleave(n_heads // n_kv, dim=1)  # GQA: head j reads kv head j // group
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd) + key_bias  # no causal mask
        attn = scores.softmax(-1) @ v
        h = h + attn.transpose(1, 2).reshape(batch, length, d) @ p["o"].T
        x = _rms_norm(h, p["ln2"], eps)
        h = h + (torch.nn.functional.silu(x @ p["gate"].T) * (x @ p["up"].T)) @ p["down"].T
    return _rms_norm(h, final_norm, eps) @ head.T


def shift_logits(logits: torch.Tensor) -> torch.Tensor:
    """Dream's right shift by one: position i is predicted from the output at i - 1 (position 0 keeps its own)."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def as_predictions(logits: torch.Tensor, config) -> torch.Tensor:
    """Per-position predictions the way the library reads them (``config.diffusion_logit_shift``)."""
    return shift_logits(logits) if config.diffusion_logit_shift else logits


# --------------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------------
FAMILIES = ("llada", "dream")
RAW = {"llada": llada_raw_config, "dream": dream_raw_config}
WEIGHTS = {"llada": llada_weights, "dream": dream_weights}
MASK = {"llada": LLADA_MASK, "dream": DREAM_MASK}
EOS = {"llada": LLADA_EOS, "dream": DREAM_EOS}
CLASS = {"llada": LlamaForCausalLM, "dream": Qwen2ForCausalLM}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(family, shards): (path, raw_config, weights)} for both families, single-file and 2-shard."""
    out = {}
    for family in FAMILIES:
        raw = RAW[family]()
        weights = WEIGHTS[family](raw, seed=1 if family == "llada" else 2)
        for shards in (1, 2):
            path = write_checkpoint(tmp_path_factory.mktemp(f"{family}{shards}"), raw, weights, shards=shards)
            out[family, shards] = (path, raw, weights)
    return out


def _ids(batch, length, seed=0, low=0, high=80):
    return torch.randint(low, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, mask=None, **kw):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kw).logits


# --------------------------------------------------------------------------------------------------
# loading official formats, vs. the reference forward
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 2], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_official_checkpoint_matches_reference(checkpoints, family, shards):
    path, raw, weights = checkpoints[family, shards]
    model = load_diffusion_model(path, dtype=F64)
    assert type(model) is CLASS[family]
    assert is_bidirectional(model)
    cfg = model.config
    assert cfg.mask_token_id == MASK[family]
    assert cfg.diffusion_logit_shift is (family == "dream")
    assert cfg.diffusion_sampling == ("categorical" if family == "dream" else "gumbel")
    assert cfg.eos_token_id == EOS[family] and cfg.pad_token_id == EOS[family]
    assert diffusion_config(model) is cfg
    assert model.get_input_embeddings().weight.dtype == F64

    # every checkpoint tensor was loaded (not randomly initialised)
    if family == "llada":
        torch.testing.assert_close(model.lm_head.weight, weights["model.transformer.ff_out.weight"].to(F64))
        torch.testing.assert_close(
            model.model.layers[1].mlp.down_proj.weight, weights["model.transformer.blocks.1.ff_out.weight"].to(F64)
        )

    ids = _ids(3, 11, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    ref = reference_logits(family, raw, weights, ids, mask)
    out = _logits(model, ids, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if family == "dream":  # the shift is applied by the consumers (sampler / loss), not by model(...)
        torch.testing.assert_close(as_predictions(out, cfg), shift_logits(ref), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(as_predictions(out, cfg), ref)

    # default-dtype (float32) load agrees at float32 tolerance
    model32 = load_diffusion_model(path, dtype=torch.float32)
    out32 = _logits(model32, ids, mask)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.to(F64), ref, rtol=1e-4, atol=1e-4)


def test_llada_padded_embedding_size(tmp_path):
    """OLMo-style checkpoints may pad the embedding table past vocab_size: the table size wins."""
    raw = llada_raw_config(vocab_size=90, embedding_size=VOCAB, mask_token_id=89, eos_token_id=88, pad_token_id=88)
    weights = llada_weights(raw, seed=5)
    model = load_diffusion_model(write_checkpoint(tmp_path, raw, weights), dtype=F64)
    assert model.get_input_embeddings().weight.shape[0] == VOCAB
    assert model.config.mask_token_id == 89
    ids = _ids(2, 7, seed=4)
    torch.testing.assert_close(_logits(model, ids), reference_logits("llada", raw, weights, ids), rtol=1e-5, atol=1e-5)


def test_override_arguments(checkpoints):
    path, _, _ = checkpoints["llada", 1]
    model = load_diffusion_model(path, mask_token_id=5, logit_shift=True, sampling="categorical")
    assert model.config.mask_token_id == 5
    assert model.config.diffusion_logit_shift is True
    assert model.config.diffusion_sampling == "categorical"
    with pytest.raises(ValueError):
        load_diffusion_model(path, mask_token_id=VOCAB + 10)
    with pytest.raises(ValueError):
        load_diffusion_model(path, sampling="greedy")


# --------------------------------------------------------------------------------------------------
# bidirectionality, masks and attention kernels
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_bidirectional_across_masks_and_kernels(checkpoints, family):
    path, raw, weights = checkpoints[family, 1]
    models = {impl: load_diffusion_model(path, dtype=torch.float32, attn_implementation=impl) for impl in ("eager", "sdpa")}
    for impl, model in models.items():
        assert model.config._attn_implementation == impl
        assert all(not m.is_causal for m in model.modules() if hasattr(m, "is_causal"))

    ids = _ids(2, 9, seed=7)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 80
    ones = torch.ones_like(ids)
    ref = reference_logits(family, raw, weights, ids).float()

    variants = {}
    for impl, model in models.items():
        dtype_for_mask = None if impl == "sdpa" else torch.float32
        explicit = attention_mask_4d(ones, 2, 9, 9, ids.device, dtype_for_mask)
        for mask_name, mask in (("none", None), ("2d", ones), ("2d-bool", ones.bool()), ("4d", explicit)):
            out = _logits(model, ids, mask)
            variants[impl, mask_name] = out
            # a late token influences the first position: attention is not causal
            out_changed = _logits(model, changed, mask)
            assert (out_changed[:, 0] - out[:, 0]).abs().max() > 1e-3, (impl, mask_name)
    for key, out in variants.items():
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padding_invariance(checkpoints, family, impl):
    path, raw, weights = checkpoints[family, 1]
    model = load_diffusion_model(path, dtype=torch.float32, attn_implementation=impl)
    n, pad = 7, 4
    row = _ids(1, n, seed=11)
    pad_id = model.config.pad_token_id
    unpadded = _logits(model, row)[0]

    pads = torch.full((1, pad), pad_id)
    ids = torch.cat([torch.cat([pads, row], 1), torch.cat([row, pads], 1)])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    mask[1, n:] = 0
    out = _logits(model, ids, mask)
    # left padding shifts absolute positions; RoPE is relative, so real positions agree to float tolerance
    torch.testing.assert_close(out[0, pad:], unpadded, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1, :n], unpadded, rtol=1e-4, atol=1e-4)
    # and so do the shifted predictions at real positions past the first real token
    preds = as_predictions(out, model.config)
    base = as_predictions(unpadded[None], model.config)[0]
    torch.testing.assert_close(preds[0, pad + 1 :], base[1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(preds[1, 1:n], base[1:], rtol=1e-4, atol=1e-4)
    # padded keys are really ignored: changing pad ids changes nothing at real positions
    other = ids.clone()
    other[0, :pad] = 3
    other[1, n:] = 4
    out_other = _logits(model, other, mask)
    torch.testing.assert_close(out_other[0, pad:], out[0, pad:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_other[1, :n], out[1, :n], rtol=1e-5, atol=1e-5)
    # with the same absolute positions the padded rows match the reference exactly
    ref = reference_logits(family, raw, weights, ids, mask).float()
    torch.testing.assert_close(out[0, pad:], ref[0, pad:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1, :n], ref[1, :n], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# save / reload, plain checkpoints
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_save_reload_round_trip(checkpoints, family, tmp_path):
    path, _, _ = checkpoints[family, 2]
    model = load_diffusion_model(path, dtype=torch.float32)
    ids = _ids(2, 8, seed=13)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    before = _logits(model, ids, mask)

    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)
    assert saved["model_type"] == ("llama" if family == "llada" else "qwen2")  # a plain checkpoint
    assert saved["mask_token_id"] == MASK[family]

    # weights are saved under the plain names (not reverted to LLaDA's), so any Llama/Qwen2 loader reads them
    saved_names = set()
    for file in os.listdir(tmp_path):
        if file.endswith(".safetensors"):
            with safe_open(str(tmp_path / file), "pt") as f:
                saved_names |= set(f.keys())
    assert saved_names == set(model.state_dict())
    plain, info = CLASS[family].from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    reloaded = load_diffusion_model(str(tmp_path))  # no mask_token_id argument needed
    assert reloaded.dtype == torch.float32
    assert type(reloaded) is CLASS[family]
    assert is_bidirectional(reloaded)
    for key in ("mask_token_id", "diffusion_logit_shift", "diffusion_sampling", "eos_token_id", "pad_token_id"):
        assert getattr(reloaded.config, key) == getattr(model.config, key), key
    torch.testing.assert_close(_logits(reloaded, ids, mask), before, rtol=1e-5, atol=1e-5)


def test_plain_checkpoint_needs_mask_token_id(tmp_path):
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=7, pad_token_id=7,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mask_token_id"):
        load_diffusion_model(str(tmp_path))

    model = load_diffusion_model(str(tmp_path), mask_token_id=9)
    assert type(model) is LlamaForCausalLM and is_bidirectional(model)
    assert model.config.mask_token_id == 9
    assert model.config.diffusion_logit_shift is False
    assert model.config.diffusion_sampling == "gumbel"
    ids = _ids(1, 6, seed=1)
    changed = ids.clone()
    changed[0, -1] += 1
    assert (_logits(model, changed)[0, 0] - _logits(model, ids)[0, 0]).abs().max() > 0


# --------------------------------------------------------------------------------------------------
# training: LoRA, gradient checkpointing, bf16
# --------------------------------------------------------------------------------------------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_attaches_and_trains(checkpoints, family):
    from peft import LoraConfig, get_peft_model

    path, _, _ = checkpoints[family, 1]
    base_logits = _logits(load_diffusion_model(path, dtype=torch.float32), _ids(2, 8, seed=17))

    # default init: LoRA is a no-op (B = 0), the wrapper keeps the diffusion properties and bidirectionality
    model = get_peft_model(load_diffusion_model(path, dtype=torch.float32), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    assert is_bidirectional(model)
    assert diffusion_config(model).mask_token_id == MASK[family]
    lora_modules = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n}
    assert lora_modules == set(LORA_TARGETS)
    ids = _ids(2, 8, seed=17)
    torch.testing.assert_close(_logits(model, ids), base_logits, rtol=1e-5, atol=1e-5)

    # non-zero B so that both A and B get gradients on the first backward
    model = get_peft_model(
        load_diffusion_model(path, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False),
    )
    model.train()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 80
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a, b = model(input_ids=ids, attention_mask=mask).logits, model(input_ids=changed, attention_mask=mask).logits
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-3  # still bidirectional through the PEFT wrapper

    targets = _ids(2, 8, seed=19, high=VOCAB)
    logits = model(input_ids=ids, attention_mask=mask).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    lora_params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora_params) == 2 * len(LORA_TARGETS) * 2  # A and B, 7 targets, 2 layers
    for name, p in lora_params.items():
        assert p.requires_grad and p.grad is not None and p.grad.abs().max() > 0, name
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert not p.requires_grad and p.grad is None, name


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_same_logits_and_grads(checkpoints, family, lora):
    from peft import LoraConfig, get_peft_model

    path, _, _ = checkpoints[family, 1]
    ids = _ids(2, 8, seed=23)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    targets = _ids(2, 8, seed=29, high=VOCAB)

    def run(checkpointing: bool):
        model = load_diffusion_model(path, dtype=torch.float32)
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        if lora:
            torch.manual_seed(0)  # same LoRA init in both runs
            config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
            model = get_peft_model(model, config)
        model.train()
        logits = model(input_ids=ids, attention_mask=mask).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return logits.detach(), grads

    logits_ref, grads_ref = run(False)
    logits_gc, grads_gc = run(True)
    torch.testing.assert_close(logits_gc, logits_ref, rtol=1e-5, atol=1e-5)
    assert grads_gc.keys() == grads_ref.keys()
    if lora:
        assert len(grads_ref) == 2 * len(LORA_TARGETS) * 2 and all("lora_" in n for n in grads_ref)
    for name in grads_ref:
        torch.testing.assert_close(grads_gc[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert all(g.abs().max() > 0 for g in grads_gc.values())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_runs(checkpoints, family, impl):
    path, raw, weights = checkpoints[family, 1]
    model = load_diffusion_model(path, dtype=torch.bfloat16, attn_implementation=impl)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    ids = _ids(2, 8, seed=31)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = _logits(model, ids, mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = reference_logits(family, raw, weights, ids, mask)
    real = mask.bool()
    err = (out.to(F64) - ref)[real].abs().max()
    assert err < 0.05 * ref[real].abs().max() + 0.05
    # bidirectional in bf16 too
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 80
    assert (_logits(model, changed, mask)[:, 3].float() - out[:, 3].float()).abs().max() > 0


@pytest.mark.parametrize("name", ["./no-such-model", "outputs/runs/none", "/tmp/definitely/not/here"])
def test_a_missing_local_folder_is_named_not_read_as_a_hub_id(name):
    with pytest.raises(FileNotFoundError, match=f"{name!r}: no such folder"):
        load_diffusion_model(name)
