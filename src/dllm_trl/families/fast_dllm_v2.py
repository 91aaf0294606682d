"""Fast-dLLM v2 (SPEC §7): a block-diffusion LM in the Qwen2.5 layout (q/k/v biases), loaded onto
``Qwen2ForCausalLM`` (same weight names), block-causal with blocks of its config's ``bd_size`` (its training block),
logits shifted right by one, categorical sampling, mask token ``|<MASK>|`` = 151665 unless the config says otherwise."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM

from .base import is_model_type, register_family
from .masked import MaskedDiffusionFamily, qwen_config, refuse_sliding_window

FAST_DLLM_V2_MASK_TOKEN_ID = 151665
"""``|<MASK>|`` of the Fast-dLLM v2 tokenizer (the default of its ``generate``), unless the config says otherwise."""


def fast_dllm_v2_to_qwen2_config(raw: dict) -> Qwen2Config:
    """Translate an official Fast-dLLM v2 ``config.json`` (``model_type: "Fast_dLLM_Qwen"``, Qwen2 keys plus its
    training block ``bd_size``) into a ``Qwen2Config`` (Qwen2.5 layout: q/k/v biases, same weight names)."""
    refuse_sliding_window(raw, "Fast-dLLM v2")
    return qwen_config(raw, Qwen2Config, 10000.0)


@register_family
class FastDLLMv2Family(MaskedDiffusionFamily):
    """Fast-dLLM v2 checkpoints (``model_type: "Fast_dLLM_Qwen"``)."""

    name = "fast_dllm_v2"

    def matches_checkpoint(self, raw_config: dict) -> bool:
        return is_model_type(raw_config, "fast_dllm_qwen")

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        model = Qwen2ForCausalLM.from_pretrained(name_or_path, config=fast_dllm_v2_to_qwen2_config(raw_config),
                                                 **from_pretrained_kwargs)
        mask = raw_config.get("mask_token_id", FAST_DLLM_V2_MASK_TOKEN_ID)
        return self.finish_loading(model, mask_token_id=mask if mask_token_id is None else mask_token_id,
                                   logit_shift=True if logit_shift is None else logit_shift,
                                   sampling=sampling or "categorical",
                                   block_size=int(raw_config.get("bd_size", 32)) if block_size is None else block_size)
