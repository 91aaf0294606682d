"""Load LLaDA-, Dream-, SDAR-, Fast-dLLM-v2-, LLaDA2- and plain causal-LM checkpoints as transformers models running
as diffusion LMs (SPEC §4, §7, §8).

No ``trust_remote_code``: LLaDA checkpoints map onto ``LlamaForCausalLM`` (config keys translated, weights
renamed at load time through ``from_pretrained(key_mapping=...)``), Dream checkpoints onto
``Qwen2ForCausalLM`` (weights unchanged). The block-diffusion families keep their base model's weight names:
SDAR / TraDo (``model_type: "sdar"``, Qwen3 layout) load onto ``Qwen3ForCausalLM``, Fast-dLLM v2
(``model_type: "Fast_dLLM_Qwen"``, Qwen2.5 layout) onto ``Qwen2ForCausalLM``, both block-causal. LLaDA2.0 / 2.1
(``model_type: "llada2_moe"``, MoE) load onto ``Glm4MoeForCausalLM``, block-causal, through a state dict renamed and
split from the checkpoint's safetensors files (:func:`llada2_state_dict`). Everything
``from_pretrained`` accepts (``dtype``, ``device_map``, ``quantization_config``, ``attn_implementation`` …) passes
through.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DiffusionGemmaForBlockDiffusion,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import cached_file

from .bidirectional import set_diffusion_properties
from .integrity import verify_manifest

# LLaDA (OLMo-derived) weight names -> Llama names. Regex patterns, mutually exclusive.
LLADA_KEY_MAPPING = {
    r"^model\.transformer\.wte\.": "model.embed_tokens.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.": r"model.layers.\1.input_layernorm.",
    r"^model\.transformer\.blocks\.(\d+)\.q_proj\.": r"model.layers.\1.self_attn.q_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.k_proj\.": r"model.layers.\1.self_attn.k_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.v_proj\.": r"model.layers.\1.self_attn.v_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_out\.": r"model.layers.\1.self_attn.o_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.": r"model.layers.\1.post_attention_layernorm.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.": r"model.layers.\1.mlp.gate_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.up_proj\.": r"model.layers.\1.mlp.up_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_out\.": r"model.layers.\1.mlp.down_proj.",
    r"^model\.transformer\.ln_f\.": "model.norm.",
    r"^model\.transformer\.ff_out\.": "lm_head.",
}

LLADA_DEFAULTS = {"mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081}
DREAM_DEFAULTS = {"mask_token_id": 151666, "eos_token_id": 151643, "pad_token_id": 151643}
SDAR_MASK_TOKEN_ID = 151669
"""``<|MASK|>`` of the SDAR / TraDo tokenizer (the public sampling code's ``mask_token_id``); not in their config."""
FAST_DLLM_V2_MASK_TOKEN_ID = 151665
"""``|<MASK>|`` of the Fast-dLLM v2 tokenizer (the default of its ``generate``), unless the config says otherwise."""
LLADA2_DEFAULTS = {"mask_token_id": 156895, "eos_token_id": 156892, "block_size": 32}
"""LLaDA2.0 / 2.1: the defaults of the official ``generate`` (``mask_id``, ``eos_id``, ``block_length``); not in the
config, which has only ``pad_token_id`` (= EOS)."""
BLOCK_FAMILIES = ("sdar", "fast_dllm_v2", "llada2")
REMOTE_CODE_KEYS = ("architectures", "auto_map", "model_type", "transformers_version", "bd_size", "fuse_cross_entropy")
"""Keys of the official configs that only their remote code reads (``bd_size``: Fast-dLLM v2's training block)."""


def _looks_local(name_or_path: str) -> bool:
    """A path, not a Hub name (``org/name``): starts like one, or has more than one separator."""
    return name_or_path.startswith((".", "/", "~", os.sep)) or name_or_path.count("/") > 1 or os.sep in name_or_path


def read_raw_config(name_or_path: str, **hub_kwargs) -> dict:
    """The checkpoint's ``config.json`` as a dict (local folder or hub name), without resolving its class."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{name_or_path!r} has no config.json.")
    elif _looks_local(name_or_path):
        raise FileNotFoundError(
            f"{name_or_path!r}: no such folder (from {os.getcwd()}). Pass an existing model folder, or a Hub name "
            "such as 'GSAI-ML/LLaDA-8B-Instruct'."
        )
    else:
        path = cached_file(name_or_path, "config.json", **hub_kwargs)
    with open(path) as f:
        return json.load(f)


def checkpoint_family(raw: dict) -> str:
    """``"llada"``, ``"dream"``, ``"sdar"``, ``"fast_dllm_v2"``, ``"llada2"``, ``"diffusion_gemma"`` or ``"causal"``
    from the config's model type / architectures."""
    model_type = str(raw.get("model_type", "")).lower()
    architectures = [a.lower() for a in raw.get("architectures") or []]
    if model_type == "diffusion_gemma" or any(a.startswith("diffusiongemma") for a in architectures):
        return "diffusion_gemma"
    if model_type.startswith("llada2") or any(a.startswith("llada2") for a in architectures):
        return "llada2"
    if model_type == "llada" or any(a.startswith("llada") for a in architectures):
        return "llada"
    if model_type == "dream" or any(a.startswith("dream") for a in architectures):
        return "dream"
    if model_type.startswith("sdar") or any(a.startswith("sdar") for a in architectures):
        if "moe" in model_type or any("moe" in a for a in architectures):
            raise ValueError(
                "SDAR mixture-of-experts checkpoints (SDAR-30B-A3B) are not supported yet: only the dense SDAR / TraDo "
                "models (Qwen3 layout) map onto a transformers class here."
            )
        return "sdar"
    if model_type == "fast_dllm_qwen" or any(a.startswith("fast_dllm_qwen") for a in architectures):
        return "fast_dllm_v2"
    return "causal"


# LLaDA2 (``LLaDA2MoeModelLM``) weight names -> Glm4Moe names. Regex patterns, mutually exclusive; the per-expert
# ``mlp.experts.E.{gate,up,down}_proj`` keep their names (transformers' own glm4_moe conversion fuses them) and the
# fused ``attention.query_key_value`` is split by :func:`llada2_state_dict`.
LLADA2_KEY_MAPPING = {
    r"^model\.word_embeddings\.": "model.embed_tokens.",
    r"^model\.layers\.(\d+)\.attention\.query_layernorm\.": r"model.layers.\1.self_attn.q_norm.",
    r"^model\.layers\.(\d+)\.attention\.key_layernorm\.": r"model.layers.\1.self_attn.k_norm.",
    r"^model\.layers\.(\d+)\.attention\.dense\.": r"model.layers.\1.self_attn.o_proj.",
    r"^model\.layers\.(\d+)\.mlp\.gate\.expert_bias$": r"model.layers.\1.mlp.gate.e_score_correction_bias",
}
_LLADA2_QKV = re.compile(r"^model\.layers\.(\d+)\.attention\.query_key_value\.(weight|bias)$")
LLADA2_PASSED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "attention_dropout", "initializer_range",
    "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id", "num_experts_per_tok", "n_group",
    "topk_group", "routed_scaling_factor", "moe_intermediate_size", "first_k_dense_replace",
)
"""Keys of the official LLaDA2 config that ``Glm4MoeConfig`` reads with the same meaning: passed as they are (with
the keys every transformers config has, ``PretrainedConfig().to_dict()``)."""
LLADA2_ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "rope_scaling", "rope_parameters", "rotary_dim")
"""RoPE keys: the official code's ``rope_theta`` / ``partial_rotary_factor`` (``rotary_dim`` = their product with
``head_dim``), ``rope_scaling`` (transformers 4.x: ``null`` for plain RoPE), ``rope_parameters`` (transformers 5.x
writes it beside them); all read into one ``rope_parameters`` (:func:`llada2_rope_parameters`)."""
LLADA2_REMOTE_CODE_KEYS = REMOTE_CODE_KEYS + (
    "dtype", "torch_dtype", "output_router_logits", "max_window_layers", "sliding_window", "norm_softmax",
    "router_dtype", "moe_router_enable_expert_bias", "use_cache", "mask_token_id", "mtp_loss_scaling_factor",
)
"""Keys of the official LLaDA2 config read only by the remote code, or that change nothing here (``router_dtype``:
Glm4Moe routes in float32 too; ``sliding_window`` / ``max_window_layers`` only with ``use_sliding_window``;
``mtp_loss_scaling_factor`` only in training with next-token-prediction layers, refused below)."""
LLADA2_TRANSLATED_KEYS = ("num_experts", "num_shared_experts", "use_qkv_bias", "use_qk_norm")
"""Keys under another name in Glm4Moe (``n_routed_experts``, ``n_shared_experts``, ``attention_bias``, ``use_qk_norm``)."""
LLADA2_DEFAULT_ROPE = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
"""The official ``LLaDA2MoeConfig``'s defaults, for a config that leaves them out."""


def llada2_rope_parameters(raw: dict) -> dict:
    """Glm4Moe's ``rope_parameters`` from the RoPE keys of an official LLaDA2 config (:data:`LLADA2_ROPE_KEYS`).
    A quantity given in several places (``rope_theta`` beside ``rope_parameters["rope_theta"]`` …) must agree
    everywhere; scaled RoPE is refused (the released checkpoints use plain RoPE, and scaling is not checked against
    the official code here)."""
    nested = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"LLaDA2 config has {key}={value!r}: expected a dict or null.")
        rope_type = value.get("rope_type", value.get("type", "default"))
        unknown = sorted(set(value) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if rope_type != "default" or unknown:
            raise ValueError(f"LLaDA2 config has {key}={value!r}, which is not supported: the released checkpoints use "
                             "plain RoPE (rope_type 'default', rope_theta, partial_rotary_factor); scaled RoPE is not "
                             "checked against the official code here.")
        nested[key] = value
    rope = {"rope_type": "default"}
    for name, default in LLADA2_DEFAULT_ROPE.items():
        given = {} if raw.get(name) is None else {name: raw[name]}
        given.update({f"{key}[{name!r}]": value[name] for key, value in nested.items() if value.get(name) is not None})
        if len({float(v) for v in given.values()}) > 1:
            stated = ", ".join(f"{where}={value!r}" for where, value in given.items())
            raise ValueError(f"LLaDA2 config disagrees with itself: {stated}. Fix config.json so that they agree.")
        rope[name] = float(next(iter(given.values()), default))
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary_dim = raw.get("rotary_dim")
    if rotary_dim is not None and int(rotary_dim) != int(head_dim * rope["partial_rotary_factor"]):
        raise ValueError(f"LLaDA2 config disagrees with itself: rotary_dim={rotary_dim} but head_dim={head_dim} × "
                         f"partial_rotary_factor={raw.get('partial_rotary_factor', rope['partial_rotary_factor'])!r} = "
                         f"{int(head_dim * rope['partial_rotary_factor'])}. Fix config.json so that they agree.")
    return rope


def llada2_to_glm4_moe_config(raw: dict) -> Glm4MoeConfig:
    """Translate an official LLaDA2.0 / 2.1 ``config.json`` (``model_type: "llada2_moe"``, as the official code saves
    it under transformers 4.x or 5.x) into a ``Glm4MoeConfig`` (SPEC §8): ``num_experts`` → ``n_routed_experts``,
    ``num_shared_experts`` → ``n_shared_experts``, ``use_qkv_bias`` → ``attention_bias``, RoPE keys →
    ``rope_parameters`` (:func:`llada2_rope_parameters`). Settings Glm4Moe cannot honour, and keys not known here,
    are refused with their name."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts", "vocab_size")
               if k not in raw]
    if missing:
        raise ValueError(f"LLaDA2 config is missing {missing}; is this an official LLaDA2.0 / 2.1 checkpoint?")
    refusals = {
        "score_function": (raw.get("score_function", "sigmoid") != "sigmoid",
                           "only the sigmoid router maps onto Glm4Moe"),
        "use_bias": (bool(raw.get("use_bias")), "Glm4Moe's o_proj has no bias"),
        "norm_topk_prob": (raw.get("norm_topk_prob", True) is False and raw.get("num_experts_per_tok", 1) > 1,
                           "the official router renormalises the chosen experts' scores whatever this key says"),
        "norm_head": (bool(raw.get("norm_head")), "a normalised LM head has no Glm4Moe counterpart"),
        "use_rmsnorm": (raw.get("use_rmsnorm", True) is not True, "Glm4Moe normalises with RMSNorm"),
        "use_sliding_window": (bool(raw.get("use_sliding_window")), "Glm4Moe attends over the whole sequence"),
        "num_nextn_predict_layers": (bool(raw.get("num_nextn_predict_layers")),
                                     "the multi-token-prediction layers are not loaded here"),
        "embedding_dropout": (bool(raw.get("embedding_dropout")), "Glm4Moe has no dropout after the embedding"),
        "output_dropout": (bool(raw.get("output_dropout")), "Glm4Moe has no dropout on the block outputs"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"LLaDA2 config has {key}={raw[key]!r}, which is not supported: {why}.")
    rope = llada2_rope_parameters(raw)
    generic = set(PretrainedConfig().to_dict()) - {"dtype"}
    known = (set(LLADA2_PASSED_KEYS) | set(LLADA2_ROPE_KEYS) | set(LLADA2_REMOTE_CODE_KEYS)
             | set(LLADA2_TRANSLATED_KEYS) | set(refusals) | generic)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"LLaDA2 config has {unknown}, keys not known here (they may change the model): a checkpoint "
                         "of another version of the official code? Not supported; remove them from config.json only "
                         "if the official code ignores them.")
    keys = {k: v for k, v in raw.items() if k in LLADA2_PASSED_KEYS or (k in generic and k not in REMOTE_CODE_KEYS)}
    heads = raw["num_attention_heads"]
    keys.setdefault("head_dim", raw["hidden_size"] // heads)
    keys.setdefault("eos_token_id", raw.get("pad_token_id", LLADA2_DEFAULTS["eos_token_id"]))
    return Glm4MoeConfig(
        **keys,
        n_routed_experts=raw["num_experts"],
        n_shared_experts=raw.get("num_shared_experts") or 0,
        attention_bias=bool(raw.get("use_qkv_bias", False)),
        use_qk_norm=bool(raw.get("use_qk_norm", True)),
        norm_topk_prob=True,
        rope_parameters=rope,
        num_nextn_predict_layers=0,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),  # what ``dtype="auto"`` loads in
    )


def _safetensors_files(name_or_path: str, **hub_kwargs) -> list[str]:
    """The checkpoint's safetensors files (one, or the shards its index names), local or from the Hub cache."""
    def resolve(filename):
        if os.path.isdir(name_or_path):
            path = os.path.join(name_or_path, filename)
            return path if os.path.isfile(path) else None
        return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)

    index = resolve("model.safetensors.index.json")
    if index is not None:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [resolve(shard) for shard in shards]
    single = resolve("model.safetensors")
    if single is None:
        raise FileNotFoundError(
            f"{name_or_path!r} has no model.safetensors(.index.json): LLaDA2 checkpoints load from safetensors."
        )
    return [single]


def llada2_state_dict(name_or_path: str, config: Glm4MoeConfig, files: ExitStack, **hub_kwargs) -> dict:
    """The checkpoint's tensors under Glm4Moe's names, lazily: every tensor is a safetensors slice read when
    ``from_pretrained`` places it (the files stay open in ``files``), except the fused ``query_key_value`` weight
    and bias, read now and split into ``q_proj`` / ``k_proj`` / ``v_proj`` rows ``[H·d, KV·d, KV·d]``.

    transformers (pinned 5.17) has no conversion op that splits one tensor into unequal parts, so the split
    happens here, before ``from_pretrained`` sees the keys; its own glm4_moe conversion then fuses the per-expert
    weights as it does for GLM-4.5 checkpoints.
    """
    from safetensors import safe_open

    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    state = {}
    for path in _safetensors_files(name_or_path, **hub_kwargs):
        handle = files.enter_context(safe_open(path, framework="pt"))
        for key in handle.keys():
            fused = _LLADA2_QKV.match(key)
            if fused:
                layer, kind = fused.groups()
                q, k, v = handle.get_tensor(key).split([q_rows, kv_rows, kv_rows], dim=0)
                for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    state[f"model.layers.{layer}.self_attn.{name}.{kind}"] = part.contiguous()
                continue
            name = key
            for pattern, replacement in LLADA2_KEY_MAPPING.items():
                name, hits = re.subn(pattern, replacement, name)
                if hits:
                    break
            state[name] = handle.get_slice(key)
    return state


def llada_to_llama_config(raw: dict) -> LlamaConfig:
    """Translate an official LLaDA ``config.json`` into a ``LlamaConfig`` (SPEC §4)."""
    missing = [k for k in ("d_model", "n_layers", "n_heads", "mlp_hidden_size") if k not in raw]
    if missing:
        raise ValueError(f"LLaDA config is missing {missing}; is this an official LLaDA checkpoint?")
    if raw.get("include_bias") or raw.get("include_qkv_bias"):
        raise ValueError("LLaDA checkpoints with biases are not supported (LLaDA-8B has none).")
    vocab = raw.get("embedding_size") or raw["vocab_size"]
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=raw["d_model"],
        intermediate_size=raw["mlp_hidden_size"],
        num_hidden_layers=raw["n_layers"],
        num_attention_heads=raw["n_heads"],
        num_key_value_heads=raw.get("n_kv_heads") or raw["n_heads"],
        max_position_embeddings=raw.get("max_sequence_length", 4096),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 500000.0))},
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        eos_token_id=raw.get("eos_token_id", LLADA_DEFAULTS["eos_token_id"]),
        pad_token_id=raw.get("pad_token_id", LLADA_DEFAULTS["pad_token_id"]),
        bos_token_id=raw.get("bos_token_id"),
    )


def _qwen_config(raw: dict, config_class, default_rope_theta: float):
    """A Qwen2 / Qwen3 config from an official config.json written for the remote code (same keys, RoPE as
    ``rope_theta`` / ``rope_scaling``)."""
    keys = {k: v for k, v in raw.items() if k not in REMOTE_CODE_KEYS}
    rope_theta = keys.pop("rope_theta", default_rope_theta)
    rope_scaling = keys.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope.update(rope_scaling)
        rope["rope_theta"] = float(rope_theta)
    keys.setdefault("rope_parameters", rope)
    return config_class(**keys)


def dream_to_qwen2_config(raw: dict) -> Qwen2Config:
    """Translate an official Dream ``config.json`` (Qwen2 keys) into a ``Qwen2Config``."""
    return _qwen_config(raw, Qwen2Config, 1000000.0)


def _refuse_sliding_window(raw: dict, family: str) -> None:
    if raw.get("use_sliding_window"):
        raise ValueError(
            f"This {family} checkpoint asks for sliding-window attention (use_sliding_window: true), which the "
            "explicit block-causal mask would silently override; only full attention is supported."
        )


def sdar_to_qwen3_config(raw: dict) -> Qwen3Config:
    """Translate an official SDAR / TraDo ``config.json`` (``model_type: "sdar"``, Qwen3 keys) into a
    ``Qwen3Config``: same layout (GQA, per-head q/k RMSNorm, ``attention_bias`` on q/k/v/o), same weight names."""
    _refuse_sliding_window(raw, "SDAR")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in raw]
    if missing:
        raise ValueError(f"SDAR config is missing {missing}; is this an official SDAR / TraDo checkpoint?")
    return _qwen_config(raw, Qwen3Config, 10000.0)


def fast_dllm_v2_to_qwen2_config(raw: dict) -> Qwen2Config:
    """Translate an official Fast-dLLM v2 ``config.json`` (``model_type: "Fast_dLLM_Qwen"``, Qwen2 keys plus its
    training block ``bd_size``) into a ``Qwen2Config`` (Qwen2.5 layout: q/k/v biases, same weight names)."""
    _refuse_sliding_window(raw, "Fast-dLLM v2")
    return _qwen_config(raw, Qwen2Config, 10000.0)


def _block_size(family: str, raw: dict, block_size: int | None, name_or_path: str) -> int | None:
    """The attention block size of a block-diffusion checkpoint: the argument, else what the checkpoint says."""
    if block_size is not None:
        return block_size
    if family == "fast_dllm_v2":
        return int(raw.get("bd_size", 32))
    if family == "llada2":
        return LLADA2_DEFAULTS["block_size"]
    raise ValueError(
        f"{name_or_path!r} is an SDAR / TraDo checkpoint: its block size is a run setting of the public code, not a "
        "config key. Pass `block_size=`: the block size the checkpoint was trained with (SDAR's and TraDo's public RL "
        "configs use 4; the b8/b16/b32/b64 checkpoints say theirs in their name)."
    )


def _forget_llada_renaming(model) -> None:
    """Keep Llama weight names on ``save_pretrained``.

    transformers >= 5 remembers the ``key_mapping`` used at load time (``model._weight_conversions``) and, by
    default, reverts it when saving. The saved config is a plain ``LlamaConfig``, so LLaDA names in the saved
    weights would make the checkpoint unloadable (every weight "missing", silently re-initialised). Drop the
    LLaDA renamings, keep any other conversion transformers recorded.
    """
    conversions = getattr(model, "_weight_conversions", None)
    if not conversions:
        return
    llada_patterns = set(LLADA_KEY_MAPPING)

    def is_llada(conversion) -> bool:
        patterns = getattr(conversion, "_original_source_patterns", None) or getattr(conversion, "source_patterns", None)
        return bool(patterns) and set(patterns) <= llada_patterns

    model._weight_conversions = [c for c in conversions if not is_llada(c)]


def load_diffusion_model(
    name_or_path: str,
    mask_token_id: int | None = None,
    logit_shift: bool | None = None,
    sampling: str | None = None,
    block_size: int | None = None,
    verify_checksums: bool = True,
    **from_pretrained_kwargs,
):
    """Load a masked-diffusion LM as a plain transformers model (bidirectional, or block-causal for block diffusion).

    * LLaDA-format checkpoints -> ``LlamaForCausalLM`` (weights renamed at load).
    * Dream-format checkpoints -> ``Qwen2ForCausalLM`` (weights unchanged, logits shifted right by one).
    * SDAR / TraDo checkpoints -> ``Qwen3ForCausalLM``, block-causal with blocks of ``block_size`` (required: the
      checkpoints do not record it), mask token 151669 unless ``mask_token_id`` is given.
    * Fast-dLLM v2 checkpoints -> ``Qwen2ForCausalLM``, block-causal with blocks of ``block_size`` (default: the
      config's ``bd_size``), logits shifted right by one, mask token 151665 unless the config or
      ``mask_token_id`` says otherwise.
    * LLaDA2.0 / 2.1 checkpoints -> ``Glm4MoeForCausalLM``, block-causal with blocks of 32 (``block_size``
      overrides), mask token 156895 and EOS 156892 (the official ``generate``'s) unless ``mask_token_id`` / the
      config say otherwise; safetensors only.
    * DiffusionGemma checkpoints -> transformers' own ``DiffusionGemmaForBlockDiffusion``, unchanged: uniform-noise
      diffusion with no mask token, so ``mask_token_id`` / ``logit_shift`` / ``sampling`` / ``block_size`` are
      refused (decode and train it with ``DiffusionGemmaSampler`` and ``DiffusionGemmaRLDFLoss``).
    * Any other causal-LM checkpoint, when ``mask_token_id`` is given (or already on its config, e.g. a
      checkpoint saved by this function, whose block size, if any, is on its config too; ``block_size`` makes any
      checkpoint block-causal).

    ``logit_shift`` / ``sampling`` override the family defaults. A local folder saved by this package's trainers
    carries a checksum manifest: its files are verified before loading (``verify_checksums=False`` skips it). Other
    keyword arguments go to ``from_pretrained``.
    """
    if verify_checksums and os.path.isdir(name_or_path):
        verify_manifest(name_or_path, " Save the model again, or load it with verify_checksums=False to skip the check.")
    hub_kwargs = {k: from_pretrained_kwargs[k] for k in ("revision", "token", "cache_dir") if k in from_pretrained_kwargs}
    raw = read_raw_config(name_or_path, **hub_kwargs)
    family = checkpoint_family(raw)
    if family == "diffusion_gemma":
        given = {name: value for name, value in (("mask_token_id", mask_token_id), ("logit_shift", logit_shift),
                                                 ("sampling", sampling), ("block_size", block_size)) if value is not None}
        if given:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())}: masked-diffusion properties, and DiffusionGemma is "
                "uniform-noise diffusion (no mask token; its canvas length is config.canvas_length). Load it without "
                "them: load_diffusion_model(path)."
            )
        return DiffusionGemmaForBlockDiffusion.from_pretrained(name_or_path, **from_pretrained_kwargs)
    if block_size is not None and family in ("llada", "dream"):
        raise ValueError(
            f"block_size={block_size}: {family} checkpoints are trained with bidirectional attention; block_size applies "
            "to block-diffusion checkpoints (SDAR / TraDo, Fast-dLLM v2, or a plain causal LM with mask_token_id=)."
        )
    if family == "llada":
        config = llada_to_llama_config(raw)
        model = LlamaForCausalLM.from_pretrained(
            name_or_path, config=config, key_mapping=LLADA_KEY_MAPPING, **from_pretrained_kwargs
        )
        _forget_llada_renaming(model)
        defaults = {"mask": raw.get("mask_token_id", LLADA_DEFAULTS["mask_token_id"]), "shift": False, "sampling": "gumbel"}
    elif family == "dream":
        config = dream_to_qwen2_config(raw)
        model = Qwen2ForCausalLM.from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)
        defaults = {"mask": raw.get("mask_token_id", DREAM_DEFAULTS["mask_token_id"]), "shift": True, "sampling": "categorical"}
    elif family == "sdar":
        block_size = _block_size(family, raw, block_size, name_or_path)
        model = Qwen3ForCausalLM.from_pretrained(name_or_path, config=sdar_to_qwen3_config(raw), **from_pretrained_kwargs)
        defaults = {"mask": raw.get("mask_token_id", SDAR_MASK_TOKEN_ID), "shift": False, "sampling": "categorical"}
    elif family == "llada2":
        block_size = _block_size(family, raw, block_size, name_or_path)
        config = llada2_to_glm4_moe_config(raw)
        with ExitStack() as files:
            state_dict = llada2_state_dict(name_or_path, config, files, **hub_kwargs)
            model = Glm4MoeForCausalLM.from_pretrained(
                None, config=config, state_dict=state_dict, **from_pretrained_kwargs
            )
        defaults = {"mask": raw.get("mask_token_id", LLADA2_DEFAULTS["mask_token_id"]), "shift": False,
                    "sampling": "categorical"}
    elif family == "fast_dllm_v2":
        block_size = _block_size(family, raw, block_size, name_or_path)
        config = fast_dllm_v2_to_qwen2_config(raw)
        model = Qwen2ForCausalLM.from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)
        defaults = {"mask": raw.get("mask_token_id", FAST_DLLM_V2_MASK_TOKEN_ID), "shift": True, "sampling": "categorical"}
    else:
        config = AutoConfig.from_pretrained(name_or_path, **hub_kwargs)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)
        saved_mask = getattr(model.config, "mask_token_id", None)
        if mask_token_id is None and saved_mask is None:
            raise ValueError(
                f"{name_or_path!r} is neither a LLaDA nor a Dream checkpoint; pass `mask_token_id=` (the id of the "
                "mask token in its vocabulary) to use it as a masked-diffusion LM."
            )
        defaults = {
            "mask": saved_mask,
            "shift": getattr(model.config, "diffusion_logit_shift", False),
            "sampling": getattr(model.config, "diffusion_sampling", "gumbel"),
        }
        if block_size is None:
            block_size = getattr(model.config, "diffusion_block_size", None)
    return set_diffusion_properties(
        model,
        mask_token_id=mask_token_id if mask_token_id is not None else defaults["mask"],
        logit_shift=defaults["shift"] if logit_shift is None else logit_shift,
        sampling=sampling or defaults["sampling"],
        block_size=block_size,
    )
