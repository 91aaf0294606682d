"""Randomly initialised LLaDA-, Dream-, SDAR-, Fast-dLLM-v2-, LLaDA2- and DiffusionGemma-shaped models, small by
default (no download), and the published shapes the benchmarks build at full size on a GPU. For tests, benchmarks and
the toys' pre-training (``scripts/``); not part of the installed package."""

from __future__ import annotations

import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
from transformers import Gemma4VisionConfig

from dllm_trl.models.bidirectional import set_diffusion_properties

# Published shapes (SPEC §4), used by the benchmarks' ``--shape`` option.
LLADA_8B_SHAPE = dict(
    vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=500000.0, mask_token_id=126336, eos_token_id=126081,
)
DREAM_7B_SHAPE = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0, mask_token_id=151666, eos_token_id=151643,
)
SDAR_8B_SHAPE = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, mask_token_id=151669,
    eos_token_id=151643,
)
"""SDAR-8B / TraDo-8B = Qwen3-8B's shape (GQA 32/8, head dim 128, per-head q/k norms, untied head)."""
LLADA2_MINI_SHAPE = dict(
    vocab_size=157184, hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, moe_intermediate_size=512, n_routed_experts=256, num_experts_per_tok=8,
    n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=1, routed_scaling_factor=2.5,
    rms_norm_eps=1e-6, rope_theta=600000.0, mask_token_id=156895, eos_token_id=156892,
)
"""LLaDA2.0-mini (16B total, 1.4B active): its published config.json in Glm4Moe's names."""
DIFFUSION_GEMMA_26B_A4B_SHAPE = dict(
    vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2, sliding_window=1024,
    num_experts=128, top_k_experts=8, moe_intermediate_size=704, canvas_length=256,
)
"""DiffusionGemma-26B-A4B's text shape as we read Gemma 4 26B-A4B's (MoE, 128 experts, 8 active; sliding layers 5:1).
Not checked against the checkpoint's config.json (no hub here): the record-size figures use ``hidden_size`` and
``vocab_size`` only."""


def _config(config_class, rope_theta: float, eos_token_id: int, **fields):
    """``config_class`` with the fields every tiny config shares: default RoPE at ``rope_theta``, EOS as padding."""
    return config_class(rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, eos_token_id=eos_token_id,
                        pad_token_id=eos_token_id, **fields)


def tiny_llada_config(vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                      num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int | None = None,
                      rms_norm_eps: float = 1e-5, rope_theta: float = 500000.0, eos_token_id: int = 1,
                      max_position_embeddings: int = 2048, **_: object) -> LlamaConfig:
    """A small ``LlamaConfig`` with LLaDA's layout: no biases, untied head, SwiGLU, RMSNorm."""
    return _config(
        LlamaConfig, rope_theta, eos_token_id, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads or num_attention_heads,
        rms_norm_eps=rms_norm_eps, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        max_position_embeddings=max_position_embeddings,
    )


def tiny_dream_config(vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                      num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                      rms_norm_eps: float = 1e-6, rope_theta: float = 1000000.0, eos_token_id: int = 1,
                      max_position_embeddings: int = 2048, **_: object) -> Qwen2Config:
    """A small ``Qwen2Config`` with Dream's layout: GQA, qkv bias, untied head."""
    return _config(
        Qwen2Config, rope_theta, eos_token_id, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=False, max_position_embeddings=max_position_embeddings, use_sliding_window=False,
        bos_token_id=eos_token_id,
    )


def tiny_sdar_config(vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                     num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                     head_dim: int | None = None, rms_norm_eps: float = 1e-6, rope_theta: float = 1000000.0,
                     eos_token_id: int = 1, max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                     **_: object) -> Qwen3Config:
    """A small ``Qwen3Config`` with SDAR's layout: GQA, per-head q/k RMSNorm, no biases."""
    return _config(
        Qwen3Config, rope_theta, eos_token_id, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads, rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings, attention_bias=False, max_position_embeddings=max_position_embeddings,
        use_sliding_window=False, bos_token_id=eos_token_id,
    )


def tiny_llada2_config(
    vocab_size: int = 128,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    moe_intermediate_size: int = 32,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    n_group: int = 4,
    topk_group: int = 2,
    first_k_dense_replace: int = 1,
    routed_scaling_factor: float = 2.5,
    rms_norm_eps: float = 1e-6,
    rope_theta: float = 600000.0,
    eos_token_id: int = 1,
    max_position_embeddings: int = 2048,
    **_: object,
) -> Glm4MoeConfig:
    """A small ``Glm4MoeConfig`` with LLaDA2's layout (what ``load_diffusion_model`` makes of an official LLaDA2
    config): GQA, per-head q/k RMSNorm, half rotary, sigmoid group-limited router, one shared expert, the first
    ``first_k_dense_replace`` layers dense, untied head, no biases."""
    return Glm4MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim or hidden_size // num_attention_heads,
        moe_intermediate_size=moe_intermediate_size, n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok, n_shared_experts=n_shared_experts, n_group=n_group,
        topk_group=topk_group, first_k_dense_replace=first_k_dense_replace, routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=False, rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, max_position_embeddings=max_position_embeddings, num_nextn_predict_layers=0,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id,
    )


def _diffusion_lm(model_class, config, mask_token_id: int | None, seed: int, dtype: torch.dtype | None,
                  attn_implementation: str, **diffusion_properties):
    """A ``model_class`` with random weights drawn from ``seed`` (the global RNG untouched), in eval mode, carrying
    the diffusion properties (mask = the last vocabulary id unless given)."""
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    if dtype is not None:
        model = model.to(dtype)
    mask = config.vocab_size - 1 if mask_token_id is None else mask_token_id
    return set_diffusion_properties(model.eval(), mask_token_id=mask, **diffusion_properties)


def build_tiny_llada(mask_token_id: int | None = None, seed: int = 0, dtype: torch.dtype | None = None,
                     attn_implementation: str = "sdpa", **config_kwargs) -> LlamaForCausalLM:
    """A random LLaDA-shaped diffusion LM (mask = last vocabulary id unless given)."""
    return _diffusion_lm(LlamaForCausalLM, tiny_llada_config(**config_kwargs), mask_token_id, seed, dtype,
                         attn_implementation, logit_shift=False, sampling="gumbel")


def build_tiny_dream(mask_token_id: int | None = None, seed: int = 0, dtype: torch.dtype | None = None,
                     attn_implementation: str = "sdpa", **config_kwargs) -> Qwen2ForCausalLM:
    """A random Dream-shaped diffusion LM (logit shift on, categorical sampling)."""
    return _diffusion_lm(Qwen2ForCausalLM, tiny_dream_config(**config_kwargs), mask_token_id, seed, dtype,
                         attn_implementation, logit_shift=True, sampling="categorical")


def build_tiny_sdar(mask_token_id: int | None = None, block_size: int = 4, seed: int = 0,
                    dtype: torch.dtype | None = None, attn_implementation: str = "sdpa",
                    **config_kwargs) -> Qwen3ForCausalLM:
    """A random SDAR-shaped block-diffusion LM (blocks of ``block_size``, no logit shift, categorical sampling)."""
    return _diffusion_lm(Qwen3ForCausalLM, tiny_sdar_config(**config_kwargs), mask_token_id, seed, dtype,
                         attn_implementation, logit_shift=False, sampling="categorical", block_size=block_size)


def build_tiny_fast_dllm_v2(mask_token_id: int | None = None, block_size: int = 4, seed: int = 0,
                            dtype: torch.dtype | None = None, attn_implementation: str = "sdpa",
                            **config_kwargs) -> Qwen2ForCausalLM:
    """A random Fast-dLLM-v2-shaped block-diffusion LM (Qwen2.5 layout, blocks of ``block_size``, logit shift)."""
    return _diffusion_lm(Qwen2ForCausalLM, tiny_dream_config(**config_kwargs), mask_token_id, seed, dtype,
                         attn_implementation, logit_shift=True, sampling="categorical", block_size=block_size)


def build_tiny_llada2(mask_token_id: int | None = None, block_size: int = 4, seed: int = 0,
                      dtype: torch.dtype | None = None, attn_implementation: str = "sdpa",
                      **config_kwargs) -> Glm4MoeForCausalLM:
    """A random LLaDA2-shaped block-diffusion MoE LM (``Glm4MoeForCausalLM``, blocks of ``block_size``, no shift,
    categorical sampling); random router biases so that the selection bias matters."""
    model = _diffusion_lm(Glm4MoeForCausalLM, tiny_llada2_config(**config_kwargs), mask_token_id, seed, dtype,
                          attn_implementation, logit_shift=False, sampling="categorical", block_size=block_size)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.3)
    return model


def tiny_diffusion_gemma_config(
    vocab_size: int = 64, hidden_size: int = 32, intermediate_size: int = 64, num_hidden_layers: int = 2,
    num_attention_heads: int = 2, num_key_value_heads: int = 1, head_dim: int = 16, sliding_window: int = 8,
    num_experts: int = 4, top_k_experts: int = 2, moe_intermediate_size: int = 16, canvas_length: int = 8,
    eos_token_id: int = 1, pad_token_id: int = 0, bos_token_id: int = 2, max_position_embeddings: int = 1024,
    global_head_dim: int | None = None, num_global_key_value_heads: int | None = None, **_: object,
) -> DiffusionGemmaConfig:
    """A small ``DiffusionGemmaConfig``: five sliding-window layers per full-attention one (the last layer full), MoE
    next to the dense MLP as in the 26B-A4B model, a canvas of ``canvas_length`` tokens, and a one-layer vision tower
    of a few thousand weights (``vision_config=None`` would build Gemma 4's full 167M-weight tower). The image / begin- / end-of-image
    ids are the vocabulary's last three. ``global_head_dim`` / ``num_global_key_value_heads``: the full-attention
    layers' own head size and KV heads (default: the sliding layers')."""
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * (num_hidden_layers // 6) + (
        ["sliding_attention"] * (num_hidden_layers % 6 - 1) + ["full_attention"] if num_hidden_layers % 6 else [])
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, global_head_dim=global_head_dim or head_dim,
        num_global_key_value_heads=num_global_key_value_heads,
        sliding_window=sliding_window, layer_types=layer_types, num_experts=num_experts, top_k_experts=top_k_experts,
        moe_intermediate_size=moe_intermediate_size, max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
    )
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length,
                                image_token_id=vocab_size - 1, boi_token_id=vocab_size - 2, eoi_token_id=vocab_size - 3)


def build_tiny_diffusion_gemma(seed: int = 0, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa",
                               **config_kwargs) -> DiffusionGemmaForBlockDiffusion:
    """A random ``DiffusionGemmaForBlockDiffusion`` (transformers' own class: no diffusion properties to set, it has
    no mask token) with weights drawn from ``seed`` (the global RNG untouched), in eval mode. ``config_kwargs``: see
    :func:`tiny_diffusion_gemma_config`."""
    config = tiny_diffusion_gemma_config(**config_kwargs)
    config._attn_implementation = attn_implementation
    config.text_config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
