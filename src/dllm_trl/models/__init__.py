"""Checkpoint -> bidirectional transformers model carrying its diffusion properties (SPEC §4)."""

from .bidirectional import (
    attention_mask_4d,
    diffusion_config,
    eos_token_ids,
    is_bidirectional,
    make_bidirectional,
    mask_dtype_for,
    set_diffusion_properties,
)
from .loading import (
    LLADA_KEY_MAPPING,
    checkpoint_family,
    dream_to_qwen2_config,
    llada_to_llama_config,
    load_diffusion_model,
    read_raw_config,
)
from .tiny import DREAM_7B_SHAPE, LLADA_8B_SHAPE, build_tiny_dream, build_tiny_llada, tiny_dream_config, tiny_llada_config

__all__ = [
    "DREAM_7B_SHAPE",
    "LLADA_8B_SHAPE",
    "LLADA_KEY_MAPPING",
    "attention_mask_4d",
    "build_tiny_dream",
    "build_tiny_llada",
    "checkpoint_family",
    "diffusion_config",
    "dream_to_qwen2_config",
    "eos_token_ids",
    "is_bidirectional",
    "llada_to_llama_config",
    "load_diffusion_model",
    "make_bidirectional",
    "mask_dtype_for",
    "read_raw_config",
    "set_diffusion_properties",
    "tiny_dream_config",
    "tiny_llada_config",
]
from .scoring import completion_logits, completion_token_logps, selective_log_softmax

__all__ += ["completion_logits", "completion_token_logps", "selective_log_softmax"]
