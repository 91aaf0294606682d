"""For tests and benchmarks, not for training: tiny random models of every family the library loads, and
full-vocabulary oracles for its truncated estimators. (The toys' pre-training starts from the same random models.)

* :mod:`.tiny_models`: ``build_tiny_llada`` / ``build_tiny_dream`` / ``build_tiny_sdar`` / ``build_tiny_fast_dllm_v2`` /
  ``build_tiny_llada2`` / ``build_tiny_diffusion_gemma`` (random weights from a seed, diffusion properties set where
  the family has them), their ``tiny_*_config`` and the published shapes;
* :mod:`.oracles`: ``full_kl``, ``full_tv``, ``kl_direction_full``, ``tv_direction_full`` and ``mask_metrics``.
"""

from .oracles import full_kl, full_tv, kl_direction_full, mask_metrics, tv_direction_full
from .tiny_models import (
    DIFFUSION_GEMMA_26B_A4B_SHAPE,
    DREAM_7B_SHAPE,
    LLADA2_MINI_SHAPE,
    LLADA_8B_SHAPE,
    SDAR_8B_SHAPE,
    build_tiny_diffusion_gemma,
    build_tiny_dream,
    build_tiny_fast_dllm_v2,
    build_tiny_llada,
    build_tiny_llada2,
    build_tiny_sdar,
    tiny_diffusion_gemma_config,
    tiny_dream_config,
    tiny_llada2_config,
    tiny_llada_config,
    tiny_sdar_config,
)

__all__ = [
    "DIFFUSION_GEMMA_26B_A4B_SHAPE",
    "DREAM_7B_SHAPE",
    "LLADA2_MINI_SHAPE",
    "LLADA_8B_SHAPE",
    "SDAR_8B_SHAPE",
    "build_tiny_diffusion_gemma",
    "build_tiny_dream",
    "build_tiny_fast_dllm_v2",
    "build_tiny_llada",
    "build_tiny_llada2",
    "build_tiny_sdar",
    "full_kl",
    "full_tv",
    "kl_direction_full",
    "mask_metrics",
    "tiny_diffusion_gemma_config",
    "tiny_dream_config",
    "tiny_llada2_config",
    "tiny_llada_config",
    "tiny_sdar_config",
    "tv_direction_full",
]
