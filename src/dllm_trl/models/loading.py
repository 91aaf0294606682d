"""Load LLaDA-, Dream- and plain causal-LM checkpoints as bidirectional transformers models (SPEC §4).

No ``trust_remote_code``: LLaDA checkpoints map onto ``LlamaForCausalLM`` (config keys translated, weights
renamed at load time through ``from_pretrained(key_mapping=...)``), Dream checkpoints onto
``Qwen2ForCausalLM`` (weights unchanged). Everything ``from_pretrained`` accepts (``dtype``,
``device_map``, ``quantization_config``, ``attn_implementation`` …) passes through.
"""

from __future__ import annotations

import json
import os

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import cached_file

from .bidirectional import set_diffusion_properties

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


def read_raw_config(name_or_path: str, **hub_kwargs) -> dict:
    """The checkpoint's ``config.json`` as a dict (local folder or hub name), without resolving its class."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{name_or_path!r} has no config.json.")
    else:
        path = cached_file(name_or_path, "config.json", **hub_kwargs)
    with open(path) as f:
        return json.load(f)


def checkpoint_family(raw: dict) -> str:
    """``"llada"``, ``"dream"`` or ``"causal"`` from the config's model type / architectures."""
    model_type = str(raw.get("model_type", "")).lower()
    architectures = [a.lower() for a in raw.get("architectures") or []]
    if model_type == "llada" or any(a.startswith("llada") for a in architectures):
        return "llada"
    if model_type == "dream" or any(a.startswith("dream") for a in architectures):
        return "dream"
    return "causal"


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


def dream_to_qwen2_config(raw: dict) -> Qwen2Config:
    """Translate an official Dream ``config.json`` (Qwen2 keys) into a ``Qwen2Config``."""
    keys = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type", "transformers_version")}
    rope_theta = keys.pop("rope_theta", 1000000.0)
    rope_scaling = keys.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope.update(rope_scaling)
        rope["rope_theta"] = float(rope_theta)
    keys.setdefault("rope_parameters", rope)
    return Qwen2Config(**keys)


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
    **from_pretrained_kwargs,
):
    """Load a masked-diffusion LM as a plain, bidirectional transformers model.

    * LLaDA-format checkpoints -> ``LlamaForCausalLM`` (weights renamed at load).
    * Dream-format checkpoints -> ``Qwen2ForCausalLM`` (weights unchanged, logits shifted right by one).
    * Any other causal-LM checkpoint, when ``mask_token_id`` is given (or already on its config, e.g. a
      checkpoint saved by this function).

    ``logit_shift`` / ``sampling`` override the family defaults. Other keyword arguments go to
    ``from_pretrained``.
    """
    hub_kwargs = {k: from_pretrained_kwargs[k] for k in ("revision", "token", "cache_dir") if k in from_pretrained_kwargs}
    raw = read_raw_config(name_or_path, **hub_kwargs)
    family = checkpoint_family(raw)
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
    return set_diffusion_properties(
        model,
        mask_token_id=mask_token_id if mask_token_id is not None else defaults["mask"],
        logit_shift=defaults["shift"] if logit_shift is None else logit_shift,
        sampling=sampling or defaults["sampling"],
    )
