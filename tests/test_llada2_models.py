"""LLaDA2.0 / 2.1 checkpoints (inclusionAI, ``model_type: "llada2_moe"``) as ``Glm4MoeForCausalLM`` (SPEC §8).

Tiny checkpoints are written here in the official on-disk layout of the published LLaDA2 models (the remote code
``LLaDA2MoeModelLM``): a fused ``attention.query_key_value`` (rows ``[H·d, KV·d, KV·d]``), ``word_embeddings``,
``attention.query_layernorm`` / ``key_layernorm`` / ``dense``, a router ``mlp.gate.weight`` with its selection bias
``mlp.gate.expert_bias``, per-expert ``mlp.experts.E.{gate,up,down}_proj``, ``mlp.shared_experts``, the first
``first_k_dense_replace`` layers dense; weights in bfloat16 (the bias in float32), the official config keys.

They are loaded through ``load_diffusion_model`` and compared with a float64 forward written below from the
model's equations: per-head q/k RMSNorm before a partial (half) rotate-half RoPE, GQA attention under the
block-causal mask, a sigmoid router whose bias only chooses the experts (group-limited top-k: groups ranked by the
sum of their two best biased scores), the chosen experts weighted by their unbiased scores renormalised and scaled
by ``routed_scaling_factor``, the shared expert added unweighted, no logit shift.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Glm4MoeForCausalLM, PretrainedConfig

from dllm_trl.models import diffusion_block_size, diffusion_config, is_bidirectional
from dllm_trl.families import load_diffusion_model

from .test_block_models import official_block_mask
from .test_models import _rms_norm, write_checkpoint

F64 = torch.float64
VOCAB = 30
MASK, EOS = 28, 29
BLOCK = 4


# --------------------------------------------------------------------------------------------------
# the official on-disk layout
# --------------------------------------------------------------------------------------------------
def llada2_raw_config(**overrides) -> dict:
    """A tiny config.json with the keys of the published LLaDA2.0-mini checkpoint (remote code ``LLaDA2MoeModelLM``)."""
    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "dtype": "bfloat16",
        "embedding_dropout": 0.0,
        "eos_token_id": EOS,
        "first_k_dense_replace": 1,
        "head_dim": 16,  # != hidden_size / num_attention_heads
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 48,
        "max_position_embeddings": 256,
        "max_window_layers": 3,
        "model_type": "llada2_moe",
        "moe_intermediate_size": 16,
        "moe_router_enable_expert_bias": True,
        "n_group": 4,
        "norm_head": False,
        "norm_softmax": False,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_shared_experts": 1,
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": EOS,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 600000,
        "rotary_dim": 8,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 2,
        "transformers_version": "4.56.0",
        "use_bias": False,
        "use_cache": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "vocab_size": VOCAB,
    }
    config.update(overrides)
    return config


def llada2_weights(raw: dict, seed: int = 0, negative_bias: bool = True) -> dict[str, torch.Tensor]:
    """Random weights under the official names, bfloat16 (``expert_bias`` float32). ``negative_bias``: biases
    large and negative enough that many biased scores ``sigmoid(z) + b`` are below zero (the router must mask the
    unchosen groups with -inf, not 0)."""
    gen = torch.Generator().manual_seed(seed)
    d, hd, vocab = raw["hidden_size"], raw["head_dim"], raw["vocab_size"]
    heads, kv = raw["num_attention_heads"], raw["num_key_value_heads"]
    f, fe, n_exp = raw["intermediate_size"], raw["moe_intermediate_size"], raw["num_experts"]
    shared = raw["num_shared_experts"] * fe
    s = 1.0 / math.sqrt(d)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    def mlp(prefix, width):
        return {prefix + "gate_proj.weight": randn(width, d, std=s), prefix + "up_proj.weight": randn(width, d, std=s),
                prefix + "down_proj.weight": randn(d, width, std=1.0 / math.sqrt(max(width, 1)))}

    w = {"model.word_embeddings.weight": randn(vocab, d)}
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + randn(d, std=0.1)
        w[p + "attention.query_key_value.weight"] = randn((heads + 2 * kv) * hd, d, std=2 * s)
        if raw["use_qkv_bias"]:
            w[p + "attention.query_key_value.bias"] = randn((heads + 2 * kv) * hd, std=0.3)
        w[p + "attention.query_layernorm.weight"] = 1.0 + randn(hd, std=0.3)
        w[p + "attention.key_layernorm.weight"] = 1.0 + randn(hd, std=0.3)
        w[p + "attention.dense.weight"] = randn(d, heads * hd, std=1.0 / math.sqrt(heads * hd))
        w[p + "post_attention_layernorm.weight"] = 1.0 + randn(d, std=0.1)
        if i < raw["first_k_dense_replace"]:
            w.update(mlp(p + "mlp.", f))
            continue
        w[p + "mlp.gate.weight"] = randn(n_exp, d, std=2 * s)
        for e in range(n_exp):
            w.update(mlp(p + f"mlp.experts.{e}.", fe))
        w.update(mlp(p + "mlp.shared_experts.", shared))
    w["model.norm.weight"] = 1.0 + randn(d, std=0.1)
    w["lm_head.weight"] = randn(vocab, d, std=3 * s)
    w = {k: v.to(torch.bfloat16) for k, v in w.items()}
    for i in range(raw["first_k_dense_replace"], raw["num_hidden_layers"]):
        bias = randn(n_exp, std=0.5) - (0.9 if negative_bias else 0.0)
        w[f"model.layers.{i}.mlp.gate.expert_bias"] = bias.float()
    return w


# --------------------------------------------------------------------------------------------------
# float64 reference forward, from the equations
# --------------------------------------------------------------------------------------------------
def _partial_rope(x, positions, theta, rotary_dim):
    """Rotate-half RoPE on the first ``rotary_dim`` dims of each head (the rest pass through). x: (B, H, L, d)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)
    angles = positions.to(F64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, L, rotary_dim)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * angles.cos() + rotated * angles.sin(), rest], dim=-1)


def _swiglu(x, w, prefix):
    gate = x @ w[prefix + "gate_proj.weight"].T
    return (torch.nn.functional.silu(gate) * (x @ w[prefix + "up_proj.weight"].T)) @ w[prefix + "down_proj.weight"].T


def reference_routing(x, w, p, raw):
    """Per token: the chosen experts (sorted) and their weights. x: (N, d)."""
    logits = x @ w[p + "mlp.gate.weight"].T
    scores = torch.sigmoid(logits)
    biased = scores + w[p + "mlp.gate.expert_bias"]
    n_exp, groups, top_k = raw["num_experts"], raw["n_group"], raw["num_experts_per_tok"]
    per_group = n_exp // groups
    chosen, weights = [], []
    for t in range(x.shape[0]):
        group_score = [sorted(biased[t, g * per_group:(g + 1) * per_group].tolist())[-2:] for g in range(groups)]
        group_rank = sorted(range(groups), key=lambda g: -sum(group_score[g]))[: raw["topk_group"]]
        candidates = [e for e in range(n_exp) if e // per_group in group_rank]
        experts = sorted(sorted(candidates, key=lambda e: -float(biased[t, e]))[:top_k])
        unbiased = torch.stack([scores[t, e] for e in experts])
        chosen.append(experts)
        weights.append(unbiased / unbiased.sum() * raw["routed_scaling_factor"])
    return chosen, weights


def reference_logits(raw: dict, weights: dict, input_ids, block_size: int) -> torch.Tensor:
    w = {k: v.to(F64) for k, v in weights.items()}
    batch, length = input_ids.shape
    heads, kv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    eps = raw["rms_norm_eps"]
    rotary_dim = int(hd * raw["partial_rotary_factor"])
    positions = torch.arange(length).expand(batch, length)
    bias = official_block_mask(length, block_size)
    h = w["model.word_embeddings.weight"][input_ids]
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms_norm(h, w[p + "input_layernorm.weight"], eps)
        qkv = x @ w[p + "attention.query_key_value.weight"].T + w.get(p + "attention.query_key_value.bias", 0.0)
        q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)
        q = _rms_norm(q.view(batch, length, heads, hd), w[p + "attention.query_layernorm.weight"], eps)
        k = _rms_norm(k.view(batch, length, kv, hd), w[p + "attention.key_layernorm.weight"], eps)
        q = _partial_rope(q.transpose(1, 2), positions, raw["rope_theta"], rotary_dim)
        k = _partial_rope(k.transpose(1, 2), positions, raw["rope_theta"], rotary_dim)
        v = v.view(batch, length, kv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        attn = ((q @ k.transpose(-1, -2)) / math.sqrt(hd) + bias).softmax(-1) @ v
        h = h + attn.transpose(1, 2).reshape(batch, length, heads * hd) @ w[p + "attention.dense.weight"].T
        h = h + w.get(p + "attention.dense.bias", 0.0)
        x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        if i < raw["first_k_dense_replace"]:
            h = h + _swiglu(x, w, p + "mlp.")
            continue
        flat = x.reshape(-1, x.shape[-1])
        chosen, gates = reference_routing(flat, w, p, raw)
        routed = torch.stack([
            sum(g * _swiglu(flat[t], w, p + f"mlp.experts.{e}.") for e, g in zip(chosen[t], gates[t]))
            for t in range(flat.shape[0])
        ]).view_as(x)
        h = h + routed + _swiglu(x, w, p + "mlp.shared_experts.")
    return _rms_norm(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


# --------------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------------
LOAD = dict(block_size=BLOCK, mask_token_id=MASK)
F64_LOAD = dict(dtype=F64, experts_implementation="eager", **LOAD)  # grouped_mm (the default) takes no float64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{shards: (path, raw, weights)}."""
    raw = llada2_raw_config()
    weights = llada2_weights(raw, seed=3)
    return {shards: (write_checkpoint(tmp_path_factory.mktemp(f"llada2-{shards}"), raw, weights, shards=shards), raw,
                     weights) for shards in (1, 3)}


def _ids(batch, length, seed=0):
    return torch.randint(0, VOCAB - 2, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# --------------------------------------------------------------------------------------------------
# fidelity
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("shards", [1, 3], ids=["single", "sharded"])
def test_official_checkpoint_matches_reference(checkpoints, shards, impl, record_property):
    path, raw, weights = checkpoints[shards]
    model = load_diffusion_model(path, attn_implementation=impl, **F64_LOAD)
    assert type(model) is Glm4MoeForCausalLM and is_bidirectional(model)
    cfg = model.config
    assert diffusion_block_size(model) == BLOCK and cfg.mask_token_id == MASK and cfg.eos_token_id == EOS
    assert cfg.diffusion_logit_shift is False and cfg.diffusion_sampling == "categorical"
    assert all(not m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
    layer = model.model.layers[2]
    hd = raw["head_dim"]
    qkv = weights["model.layers.2.attention.query_key_value.weight"].to(F64)
    torch.testing.assert_close(layer.self_attn.k_proj.weight, qkv[4 * hd: 6 * hd], rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.gate.e_score_correction_bias, weights["model.layers.2.mlp.gate.expert_bias"])
    experts = layer.mlp.experts.gate_up_proj  # (E, 2 · moe_intermediate, d): gate rows then up rows
    torch.testing.assert_close(experts[5, 16:], weights["model.layers.2.mlp.experts.5.up_proj.weight"].to(F64), rtol=0,
                               atol=0)

    ids = _ids(2, 11, seed=5)  # two full blocks and a partial one
    ref = reference_logits(raw, weights, ids, BLOCK)
    got = _logits(model, ids)
    delta = (got - ref).abs().max().item()
    record_property("max_abs_delta_logit", delta)
    print(f"\nLLaDA2 fidelity ({'single' if shards == 1 else 'sharded'}, {impl}, float64): max |Δlogit| = {delta:.2e}")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(model, ids, torch.ones_like(ids)), ref, rtol=1e-5, atol=1e-5)
    model32 = load_diffusion_model(path, dtype=torch.float32, attn_implementation=impl, **LOAD)  # grouped_mm experts
    torch.testing.assert_close(_logits(model32, ids).to(F64), ref, rtol=1e-4, atol=1e-4)


def test_router_sees_negative_biased_scores(checkpoints):
    """The fixture's biases push many biased scores below zero; the chosen experts still equal the reference's."""
    path, raw, weights = checkpoints[1]
    model = load_diffusion_model(path, **F64_LOAD)
    w = {k: v.to(F64) for k, v in weights.items()}
    x = torch.randn(64, raw["hidden_size"], generator=torch.Generator().manual_seed(1), dtype=F64)
    biased = torch.sigmoid(x @ w["model.layers.1.mlp.gate.weight"].T) + w["model.layers.1.mlp.gate.expert_bias"]
    assert (biased < 0).float().mean() > 0.2
    chosen, gates = reference_routing(x, w, "model.layers.1.", raw)
    with torch.no_grad():
        _, got_weights, got_experts = model.model.layers[1].mlp.gate(x)
    order = got_experts.sort(-1)
    assert order.values.tolist() == chosen
    torch.testing.assert_close(got_weights.gather(-1, order.indices).to(F64), torch.stack(gates), rtol=1e-6, atol=1e-6)


def test_official_folder_needs_no_arguments(tmp_path):
    """The real vocabulary: mask 156895, EOS 156892 and blocks of 32 come from the family's defaults."""
    raw = llada2_raw_config(vocab_size=157184, hidden_size=16, head_dim=8, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=2, rotary_dim=4, pad_token_id=156892,
                            intermediate_size=16, moe_intermediate_size=8)
    del raw["eos_token_id"]  # the published config has only pad_token_id
    model = load_diffusion_model(write_checkpoint(tmp_path, raw, llada2_weights(raw)))
    cfg = model.config
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.diffusion_block_size) == (156895, 156892, 32)
    assert model.lm_head.weight.dtype == torch.bfloat16  # the checkpoint's dtype, as from_pretrained does


def test_unsupported_variants_are_refused(tmp_path):
    """Refused: what the official code reads and Glm4Moe cannot compute (scaled RoPE, MTP layers, a nonzero bias on
    the attention output)."""
    weights = llada2_weights(llada2_raw_config())
    cases = {"rope_scaling": {"type": "yarn", "factor": 4.0}, "num_nextn_predict_layers": 1}
    for key, value in cases.items():
        path = write_checkpoint(tmp_path / key, llada2_raw_config(**{key: value}), weights)
        with pytest.raises(ValueError, match=key):
            load_diffusion_model(path, **LOAD)
    raw = llada2_raw_config(use_bias=True)
    biased = {**weights, "model.layers.1.attention.dense.bias": torch.full((raw["hidden_size"],), 0.5)}
    with pytest.raises(ValueError, match=r"nonzero model\.layers\.1\.attention\.dense\.bias \(use_bias=true\)"):
        load_diffusion_model(write_checkpoint(tmp_path / "bias", raw, biased), **LOAD)


OFFICIAL_CONFIG_CLASS_DEFAULTS = dict(
    vocab_size=30592, hidden_size=1024, intermediate_size=None, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=0, hidden_act="silu", use_qkv_bias=False, use_qk_norm=True, use_bias=True, rms_norm_eps=1e-05,
    norm_head=False, tie_word_embeddings=False, embedding_dropout=0.1, attention_dropout=0.1, output_dropout=0.1,
    initializer_range=0.02, max_position_embeddings=16384, rope_theta=10000.0, use_cache=True,
    use_sliding_window=False, sliding_window=4096, max_window_layers=28, rope_scaling=None, pad_token_id=126081,
    num_experts=16, num_shared_experts=0, num_experts_per_tok=2, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    moe_intermediate_size=None, first_k_dense_replace=0, head_dim=None, output_router_logits=False,
    partial_rotary_factor=0.5,
)
"""The keyword defaults of the official ``LLaDA2MoeConfig.__init__`` (LLaDA2.0 / 2.1 ``configuration_llada2_moe.py``),
written out: what ``config.json`` holds for every key a checkpoint's author did not set."""
TINY_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts=8, n_group=4, topk_group=2, moe_intermediate_size=16,
                  first_k_dense_replace=1, pad_token_id=EOS, eos_token_id=EOS)
"""The sizes a tiny model must set (the class's ``num_key_value_heads=0`` / ``moe_intermediate_size=None`` build no
model, even in the official code)."""


@pytest.mark.parametrize("changes", [{}, dict(score_function="softmax", norm_topk_prob=False, norm_head=True,
                                              use_rmsnorm=False, use_sliding_window=True, use_qk_norm=False,
                                              embedding_dropout=0.3, output_dropout=0.3)],
                         ids=["class-defaults", "keys-the-official-code-ignores"])
def test_a_config_written_by_the_official_class_with_its_defaults_loads(tmp_path, changes):
    """A config.json from the official class's defaults (``use_bias=True``, ``embedding_dropout=0.1``, no shared
    experts …), saved under the installed transformers, and one that also flips every key the official modeling code
    never reads: both load, and compute the reference's logits (which follow the official code: q/k always normed,
    sigmoid routing renormalised, no embedding or output dropout). The official model initialises the attention
    output's bias to zero; a zero bias is dropped."""
    kept = {**OFFICIAL_CONFIG_CLASS_DEFAULTS, **TINY_SIZES, **changes}
    raw = transformers5_config(kept, tmp_path / "saved")
    assert raw["use_bias"] is True and raw["embedding_dropout"] == changes.get("embedding_dropout", 0.1)
    weights = llada2_weights({**raw, "num_shared_experts": 0}, seed=4)
    for i in range(raw["num_hidden_layers"]):
        weights[f"model.layers.{i}.attention.dense.bias"] = torch.zeros(raw["hidden_size"], dtype=torch.bfloat16)
    model = load_diffusion_model(write_checkpoint(tmp_path / "model", raw, weights), **F64_LOAD)
    assert model.config.use_qk_norm is True
    ids = _ids(2, 9, seed=5)
    torch.testing.assert_close(_logits(model, ids), reference_logits(raw, weights, ids, BLOCK), rtol=1e-5, atol=1e-5)


def test_qkv_bias_and_qk_norm_off(tmp_path):
    """``use_qkv_bias`` → biases on q/k/v (split like the weight); ``use_qk_norm: false`` changes nothing: the official
    attention norms q and k whatever it says."""
    raw = llada2_raw_config(use_qkv_bias=True)
    weights = llada2_weights(raw, seed=6)
    model = load_diffusion_model(write_checkpoint(tmp_path / "bias", raw, weights), **F64_LOAD)
    ids = _ids(1, 9, seed=7)
    torch.testing.assert_close(_logits(model, ids), reference_logits(raw, weights, ids, BLOCK), rtol=1e-5, atol=1e-5)
    raw = llada2_raw_config(use_qk_norm=False)
    weights = llada2_weights(raw, seed=8)
    model = load_diffusion_model(write_checkpoint(tmp_path / "nonorm", raw, weights), **F64_LOAD)
    torch.testing.assert_close(_logits(model, ids), reference_logits(raw, weights, ids, BLOCK), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# config.json as the official code saves it under transformers 4.x and 5.x
# --------------------------------------------------------------------------------------------------
class OfficialStyleConfig(PretrainedConfig):
    """Saves a config the way the official ``LLaDA2MoeConfig`` does: it sets ``rope_theta``, ``rope_scaling`` and
    ``partial_rotary_factor`` as plain attributes and hands the rest to ``PretrainedConfig``. Under transformers 5
    ``rope_scaling`` is an alias of ``rope_parameters``, which the base class then fills from ``rope_theta`` and
    ``partial_rotary_factor``: the saved file carries ``rope_parameters`` beside ``rope_theta``."""

    model_type = "llada2_moe"

    def __init__(self, rope_theta=10000.0, rope_scaling=None, partial_rotary_factor=0.5, **kwargs):
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.partial_rotary_factor = partial_rotary_factor
        super().__init__(**kwargs)


def transformers5_config(raw: dict, folder) -> dict:
    """``raw`` saved through :class:`OfficialStyleConfig` under the installed transformers (5.x)."""
    kept = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    OfficialStyleConfig(**kept).save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


def test_official_configs_of_transformers_4_and_5_load_alike(checkpoints, tmp_path):
    """The 4.x file (``rope_theta``, ``rope_scaling: null``) and the 5.x file (``rope_parameters`` beside
    ``rope_theta``) of the same checkpoint load to the same model: the reference's logits."""
    path, raw, weights = checkpoints[1]
    assert raw["rope_scaling"] is None and raw["transformers_version"].startswith("4.")
    saved = transformers5_config(raw, tmp_path / "saved")
    assert saved["transformers_version"].startswith("5.") and saved["rope_theta"] == raw["rope_theta"]
    assert saved["rope_parameters"] == {"rope_type": "default", "rope_theta": raw["rope_theta"],
                                        "partial_rotary_factor": raw["partial_rotary_factor"]}
    path5 = write_checkpoint(tmp_path / "v5", saved, weights)
    ids = _ids(2, 11, seed=21)
    ref = reference_logits(raw, weights, ids, BLOCK)
    for folder in (path, path5):
        torch.testing.assert_close(_logits(load_diffusion_model(folder, **F64_LOAD), ids), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes, named", [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), ("rope_theta=600000", "rope_parameters")),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.0}),
     ("partial_rotary_factor=0.5", "rope_parameters")),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 5.0}), ("rope_theta=600000", "rope_scaling")),
    (dict(rotary_dim=16), ("rotary_dim=16", "partial_rotary_factor=0.5")),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 600000}), ("rope_parameters",)),
    (dict(num_nextn_predict_layers=1), ("num_nextn_predict_layers",)),
    (dict(attention_sink=True), ("attention_sink",)),
])
def test_disagreeing_or_unknown_config_keys_are_refused(tmp_path, changes, named):
    raw = llada2_raw_config(**changes)
    path = write_checkpoint(tmp_path, raw, llada2_weights(llada2_raw_config()))
    with pytest.raises(ValueError) as refused:
        load_diffusion_model(path, **LOAD)
    for name in named:
        assert name in str(refused.value)


# --------------------------------------------------------------------------------------------------
# save / reload, PEFT
# --------------------------------------------------------------------------------------------------
def test_save_reload_round_trip(checkpoints, tmp_path):
    path, _, _ = checkpoints[3]
    model = load_diffusion_model(path, dtype=torch.float32, **LOAD)
    ids = _ids(2, 9, seed=15)
    before = _logits(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "glm4_moe" and "auto_map" not in saved
    assert saved["diffusion_block_size"] == BLOCK and saved["mask_token_id"] == MASK
    reloaded = load_diffusion_model(str(tmp_path))
    assert type(reloaded) is Glm4MoeForCausalLM
    for key in ("diffusion_block_size", "mask_token_id", "eos_token_id", "diffusion_logit_shift", "diffusion_sampling"):
        assert getattr(reloaded.config, key) == getattr(model.config, key), key
    torch.testing.assert_close(_logits(reloaded, ids), before, rtol=1e-6, atol=1e-6)


LORA_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_EXPERTS = ["gate_up_proj", "down_proj"]


def test_lora_on_attention_and_experts(checkpoints):
    """LoRA on the attention projections and, through PEFT's ``target_parameters``, on the fused experts."""
    from peft import LoraConfig, get_peft_model

    path, _, _ = checkpoints[1]
    base = load_diffusion_model(path, dtype=torch.float32, **LOAD)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=LORA_ATTENTION,
                                            target_parameters=[f"mlp.experts.{n}" for n in LORA_EXPERTS],
                                            init_lora_weights=False))
    assert diffusion_block_size(model) == BLOCK and diffusion_config(model).mask_token_id == MASK
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in names) and any("q_proj" in n for n in names)
    ids = _ids(1, 8, seed=17)
    other = ids.clone()
    other[0, 6] += 1
    delta = (_logits(model, other) - _logits(model, ids)).abs().amax(-1)[0]
    # Earlier blocks see nothing of it; float32 grouped-GEMM sums depend on which tokens share an expert (1e-7).
    assert delta[:4].max() < 1e-5 and delta[4:].min() > 1e-3
    model.train()
    model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in model.named_parameters() if p.requires_grad)
