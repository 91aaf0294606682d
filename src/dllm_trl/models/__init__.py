"""Checkpoint -> bidirectional transformers model carrying its diffusion properties (SPEC §4)."""

from .bidirectional import (
    attention_mask_4d,
    attention_mask_dtype,
    diffusion_block_size,
    diffusion_config,
    eos_token_ids,
    is_bidirectional,
    make_bidirectional,
    mask_dtype_for,
    set_diffusion_properties,
)
from .block_attention import align_prompt, block_causal_mask
from .loading import (
    LLADA_KEY_MAPPING,
    checkpoint_family,
    dream_to_qwen2_config,
    fast_dllm_v2_to_qwen2_config,
    llada_to_llama_config,
    load_diffusion_model,
    read_raw_config,
    sdar_to_qwen3_config,
)
from .tiny import (
    DREAM_7B_SHAPE,
    LLADA_8B_SHAPE,
    SDAR_8B_SHAPE,
    build_tiny_dream,
    build_tiny_fast_dllm_v2,
    build_tiny_llada,
    build_tiny_sdar,
    tiny_dream_config,
    tiny_llada_config,
    tiny_sdar_config,
)

__all__ = [
    "DREAM_7B_SHAPE",
    "LLADA_8B_SHAPE",
    "LLADA_KEY_MAPPING",
    "SDAR_8B_SHAPE",
    "align_prompt",
    "attention_mask_4d",
    "attention_mask_dtype",
    "block_causal_mask",
    "build_tiny_dream",
    "build_tiny_fast_dllm_v2",
    "build_tiny_llada",
    "build_tiny_sdar",
    "checkpoint_family",
    "diffusion_block_size",
    "diffusion_config",
    "dream_to_qwen2_config",
    "eos_token_ids",
    "fast_dllm_v2_to_qwen2_config",
    "is_bidirectional",
    "llada_to_llama_config",
    "load_diffusion_model",
    "make_bidirectional",
    "mask_dtype_for",
    "read_raw_config",
    "sdar_to_qwen3_config",
    "set_diffusion_properties",
    "tiny_dream_config",
    "tiny_llada_config",
    "tiny_sdar_config",
]
from .scoring import completion_logits, completion_token_logps, selective_log_softmax, token_logps_at

__all__ += ["completion_logits", "completion_token_logps", "selective_log_softmax", "token_logps_at"]
