"""LLaDA2.0 / 2.1 (SPEC §8): mixture-of-experts block-diffusion LMs (``model_type: "llada2_moe"``), loaded onto
``Glm4MoeForCausalLM`` through a state dict renamed and split from the checkpoint's safetensors files
(:func:`llada2_state_dict`), block-causal with blocks of 32, categorical sampling, mask token 156895 and EOS 156892
(the official ``generate``'s). Its default RLDF loss measures routing drift (:class:`~dllm_trl.losses.MoERLDFLoss`)."""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack

from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, PretrainedConfig
from transformers.utils import cached_file

from ..models.loading import hub_kwargs
from .base import is_model_type, register_family
from .masked import REMOTE_CODE_KEYS, MaskedDiffusionFamily

LLADA2_DEFAULTS = {"mask_token_id": 156895, "eos_token_id": 156892, "block_size": 32}
"""LLaDA2.0 / 2.1: the defaults of the official ``generate`` (``mask_id``, ``eos_id``, ``block_length``); not in the
config, which has only ``pad_token_id`` (= EOS)."""
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
_LLADA2_DENSE_BIAS = re.compile(r"^model\.layers\.\d+\.attention\.dense\.bias$")
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
LLADA2_IGNORED_KEYS = ("score_function", "norm_topk_prob", "norm_head", "use_rmsnorm", "use_sliding_window",
                       "embedding_dropout", "output_dropout", "use_qk_norm", "use_bias")
"""Keys of the official LLaDA2 config (its ``LLaDA2MoeConfig`` writes them, with defaults such as
``embedding_dropout=0.1``, ``use_bias=True``) that the official modeling code never reads, or reads where the result
is what Glm4Moe computes: it routes with a sigmoid and renormalises the chosen experts whatever ``score_function`` /
``norm_topk_prob`` say, has a plain LM head (``norm_head``), RMSNorm only, no sliding window and no dropout after
the embedding or on the block outputs, and always norms q and k (``use_qk_norm``). ``use_bias`` gives the attention
output a bias: the checkpoint's tensors decide (:func:`llada2_state_dict` drops an all-zero one and refuses any
other)."""
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
    refusals = {  # keys the official code reads where Glm4Moe would compute something else
        "num_nextn_predict_layers": (bool(raw.get("num_nextn_predict_layers")),
                                     "the multi-token-prediction layers are not loaded here"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"LLaDA2 config has {key}={raw[key]!r}, which is not supported: {why}.")
    rope = llada2_rope_parameters(raw)
    generic = set(PretrainedConfig().to_dict()) - {"dtype"}
    known = (set(LLADA2_PASSED_KEYS) | set(LLADA2_ROPE_KEYS) | set(LLADA2_REMOTE_CODE_KEYS)
             | set(LLADA2_TRANSLATED_KEYS) | set(LLADA2_IGNORED_KEYS) | set(refusals) | generic)
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
        use_qk_norm=True,  # the official attention norms q and k whatever use_qk_norm says
        norm_topk_prob=True,
        rope_parameters=rope,
        num_nextn_predict_layers=0,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),  # what ``dtype="auto"`` loads in
    )


def _safetensors_files(name_or_path: str, **hub) -> list[str]:
    """The checkpoint's safetensors files (one, or the shards its index names), local or from the Hub cache."""
    def resolve(filename):
        if os.path.isdir(name_or_path):
            path = os.path.join(name_or_path, filename)
            return path if os.path.isfile(path) else None
        return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False, **hub)

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


def llada2_state_dict(name_or_path: str, config: Glm4MoeConfig, files: ExitStack, **hub) -> dict:
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
    for path in _safetensors_files(name_or_path, **hub):
        handle = files.enter_context(safe_open(path, framework="pt"))
        for key in handle.keys():
            fused = _LLADA2_QKV.match(key)
            if fused:
                layer, kind = fused.groups()
                q, k, v = handle.get_tensor(key).split([q_rows, kv_rows, kv_rows], dim=0)
                for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    state[f"model.layers.{layer}.self_attn.{name}.{kind}"] = part.contiguous()
                continue
            if _LLADA2_DENSE_BIAS.match(key):
                if handle.get_tensor(key).any():
                    raise ValueError(f"LLaDA2 checkpoint has a nonzero {key} (use_bias=true), which is not supported: "
                                     "Glm4Moe's o_proj has no bias.")
                continue  # a zero bias adds nothing
            name = key
            for pattern, replacement in LLADA2_KEY_MAPPING.items():
                name, hits = re.subn(pattern, replacement, name)
                if hits:
                    break
            state[name] = handle.get_slice(key)
    return state


@register_family
class LLaDA2Family(MaskedDiffusionFamily):
    """LLaDA2.0 / 2.1 checkpoints (``model_type: "llada2_moe"``), as the official code saves them under
    transformers 4.x or 5.x."""

    name = "llada2"

    def matches_checkpoint(self, raw_config: dict) -> bool:
        return is_model_type(raw_config, "llada2")

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        config = llada2_to_glm4_moe_config(raw_config)
        with ExitStack() as files:
            state_dict = llada2_state_dict(name_or_path, config, files, **hub_kwargs(from_pretrained_kwargs))
            model = Glm4MoeForCausalLM.from_pretrained(None, config=config, state_dict=state_dict,
                                                       **from_pretrained_kwargs)
        mask = raw_config.get("mask_token_id", LLADA2_DEFAULTS["mask_token_id"])
        return self.finish_loading(model, mask_token_id=mask if mask_token_id is None else mask_token_id,
                                   logit_shift=bool(logit_shift), sampling=sampling or "categorical",
                                   block_size=LLADA2_DEFAULTS["block_size"] if block_size is None else block_size)
