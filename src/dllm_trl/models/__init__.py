"""Checkpoint -> bidirectional (or block-causal) transformers model carrying its diffusion properties (SPEC §4, §7).

Names are imported on first use: the sampler needs only :mod:`.bidirectional` and :mod:`.block_attention` (torch),
not transformers' model classes that :mod:`.loading` imports. Random tiny models for tests live in the repository's ``tests/tiny_models.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ["attention_mask_4d", "attention_mask_dtype", "diffusion_block_size", "diffusion_config", "eos_token_ids",
         "is_bidirectional", "make_bidirectional", "mask_dtype_for", "set_diffusion_properties"],
        "bidirectional",
    ),
    **dict.fromkeys(["align_prompt", "block_causal_mask"], "block_attention"),
    **dict.fromkeys(["DIFFUSION_GEMMA_LORA_TARGETS", "is_diffusion_gemma", "merge_tied_adapters", "tie_encoder_adapters"],
                    "diffusion_gemma"),
    "read_raw_config": "loading",
    **dict.fromkeys(["RoutingCapture", "router_modules"], "routing"),
    **dict.fromkeys(
        ["completion_logits", "completion_token_logps", "selective_log_softmax", "token_logps_at"], "scoring"
    ),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
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
    from .diffusion_gemma import (
        DIFFUSION_GEMMA_LORA_TARGETS,
        is_diffusion_gemma,
        merge_tied_adapters,
        tie_encoder_adapters,
    )
    from .loading import read_raw_config
    from .routing import RoutingCapture, router_modules
    from .scoring import completion_logits, completion_token_logps, selective_log_softmax, token_logps_at
