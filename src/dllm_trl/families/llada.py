"""LLaDA (SPEC §4): an OLMo-derived bidirectional masked-diffusion LM, loaded onto ``LlamaForCausalLM`` without
``trust_remote_code`` (config keys translated, weights renamed at load through ``from_pretrained(key_mapping=...)``);
Gumbel-max sampling, no logit shift, mask token 126336."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from .base import is_model_type, register_family
from .masked import MaskedDiffusionFamily, refuse_block_size

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


@register_family
class LLaDAFamily(MaskedDiffusionFamily):
    """LLaDA checkpoints (``model_type: "llada"``, ``LLaDAModelLM``)."""

    name = "llada"

    def matches_checkpoint(self, raw_config: dict) -> bool:
        return is_model_type(raw_config, "llada") and not is_model_type(raw_config, "llada2")

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        refuse_block_size(self, block_size)
        model = LlamaForCausalLM.from_pretrained(name_or_path, config=llada_to_llama_config(raw_config),
                                                 key_mapping=LLADA_KEY_MAPPING, **from_pretrained_kwargs)
        _forget_llada_renaming(model)
        mask = raw_config.get("mask_token_id", LLADA_DEFAULTS["mask_token_id"])
        return self.finish_loading(model, mask_token_id=mask if mask_token_id is None else mask_token_id,
                                   logit_shift=bool(logit_shift), sampling=sampling or "gumbel", block_size=None)
