"""Dream (SPEC §4): a Qwen2.5-initialised bidirectional masked-diffusion LM, loaded onto ``Qwen2ForCausalLM`` with
its weights unchanged; logits shifted right by one (position ``i`` predicted from the hidden state at ``i − 1``),
categorical sampling, mask token 151666."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM

from .base import is_model_type, register_family
from .masked import MaskedDiffusionFamily, qwen_config, refuse_block_size

DREAM_DEFAULTS = {"mask_token_id": 151666, "eos_token_id": 151643, "pad_token_id": 151643}


def dream_to_qwen2_config(raw: dict) -> Qwen2Config:
    """Translate an official Dream ``config.json`` (Qwen2 keys) into a ``Qwen2Config``."""
    return qwen_config(raw, Qwen2Config, 1000000.0)


@register_family
class DreamFamily(MaskedDiffusionFamily):
    """Dream checkpoints (``model_type: "Dream"``, ``DreamModel``)."""

    name = "dream"

    def matches_checkpoint(self, raw_config: dict) -> bool:
        return is_model_type(raw_config, "dream")

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        refuse_block_size(self, block_size)
        model = Qwen2ForCausalLM.from_pretrained(name_or_path, config=dream_to_qwen2_config(raw_config),
                                                 **from_pretrained_kwargs)
        mask = raw_config.get("mask_token_id", DREAM_DEFAULTS["mask_token_id"])
        return self.finish_loading(model, mask_token_id=mask if mask_token_id is None else mask_token_id,
                                   logit_shift=True if logit_shift is None else logit_shift,
                                   sampling=sampling or "categorical", block_size=None)
