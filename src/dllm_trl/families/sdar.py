"""SDAR / TraDo (SPEC §7): block-diffusion LMs in the Qwen3 layout, loaded onto ``Qwen3ForCausalLM`` (same weight
names), block-causal with blocks of ``block_size`` positions — a run setting of the public code, not a config key, so
it must be given — categorical sampling, mask token ``<|MASK|>`` = 151669."""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3ForCausalLM

from .base import checkpoint_names, is_model_type, register_family
from .masked import MaskedDiffusionFamily, qwen_config, refuse_sliding_window

SDAR_MASK_TOKEN_ID = 151669
"""``<|MASK|>`` of the SDAR / TraDo tokenizer (the public sampling code's ``mask_token_id``); not in their config."""


def sdar_to_qwen3_config(raw: dict) -> Qwen3Config:
    """Translate an official SDAR / TraDo ``config.json`` (``model_type: "sdar"``, Qwen3 keys) into a
    ``Qwen3Config``: same layout (GQA, per-head q/k RMSNorm, ``attention_bias`` on q/k/v/o), same weight names."""
    refuse_sliding_window(raw, "SDAR")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in raw]
    if missing:
        raise ValueError(f"SDAR config is missing {missing}; is this an official SDAR / TraDo checkpoint?")
    return qwen_config(raw, Qwen3Config, 10000.0)


@register_family
class SDARFamily(MaskedDiffusionFamily):
    """SDAR / TraDo checkpoints (``model_type: "sdar"``; the mixture-of-experts SDAR-30B-A3B is refused)."""

    name = "sdar"

    def matches_checkpoint(self, raw_config: dict) -> bool:
        if not is_model_type(raw_config, "sdar"):
            return False
        if any("moe" in name for name in checkpoint_names(raw_config)):
            raise ValueError(
                "SDAR mixture-of-experts checkpoints (SDAR-30B-A3B) are not supported yet: only the dense SDAR / TraDo "
                "models (Qwen3 layout) map onto a transformers class here."
            )
        return True

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        if block_size is None:
            raise ValueError(
                f"{name_or_path!r} is an SDAR / TraDo checkpoint: its block size is a run setting of the public code, "
                "not a config key. Pass `block_size=`: the block size the checkpoint was trained with (SDAR's and "
                "TraDo's public RL configs use 4; the b8/b16/b32/b64 checkpoints say theirs in their name)."
            )
        model = Qwen3ForCausalLM.from_pretrained(name_or_path, config=sdar_to_qwen3_config(raw_config),
                                                 **from_pretrained_kwargs)
        mask = raw_config.get("mask_token_id", SDAR_MASK_TOKEN_ID)
        return self.finish_loading(model, mask_token_id=mask if mask_token_id is None else mask_token_id,
                                   logit_shift=bool(logit_shift), sampling=sampling or "categorical",
                                   block_size=block_size)
