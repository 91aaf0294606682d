"""Run a transformers causal-LM class as a bidirectional masked-diffusion LM (SPEC §4).

The diffusion properties of a model live on ``model.config`` so that they survive ``save_pretrained``,
PEFT wrapping and TRL's own handling:

* ``mask_token_id`` – id of the mask token ``M``;
* ``diffusion_logit_shift`` – ``True`` for Dream-style models that predict position ``i`` from the
  hidden state at ``i - 1``;
* ``diffusion_sampling`` – ``"gumbel"`` (LLaDA style) or ``"categorical"`` (Dream style), the default
  way the sampler draws candidates;
* ``diffusion_block_size`` – set on block-diffusion LMs only (SDAR / TraDo, Fast-dLLM v2): attention is causal
  across blocks of this many positions and bidirectional inside one (:mod:`.block_attention`).

Bidirectionality is installed by :func:`make_bidirectional`: every attention module gets
``is_causal = False`` and the decoder receives an explicit 4-D mask (boolean for sdpa, additive 0 /
large-negative for eager attention) built from whatever 2-D padding mask (or none) the caller passed: bidirectional,
or block-causal when the config has a block size. Behaviour without an explicit mask differs across transformers
versions, so we never rely on it. A 4-D mask the caller builds itself (the sampler, the packed forward) passes as is.
"""

from __future__ import annotations

import torch
from torch import nn

from .block_attention import block_causal_mask, column_blocks
from .engines import check_attention_implementation, decoder_of, model_config

_HOOK_ATTR = "_dllm_bidirectional_hook"
SAMPLING_STYLES = ("gumbel", "categorical")


def diffusion_config(model: nn.Module):
    """Return the config that carries the diffusion properties (through DDP / DeepSpeed / FSDP / PEFT wrappers)."""
    config = model_config(model)
    if getattr(config, "mask_token_id", None) is None:
        raise ValueError(
            "This model is not a diffusion LM: `model.config.mask_token_id` is not set. Load it with "
            "`dllm_trl.load_diffusion_model(...)`, or call `dllm_trl.models.set_diffusion_properties(model, "
            "mask_token_id=...)` for any other causal-LM checkpoint."
        )
    return config


def set_diffusion_properties(
    model: nn.Module,
    mask_token_id: int,
    logit_shift: bool = False,
    sampling: str = "gumbel",
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    block_size: int | None = None,
) -> nn.Module:
    """Write the diffusion properties onto ``model.config`` and make the model bidirectional (block-causal with
    blocks of ``block_size`` positions when it is given: a block-diffusion LM)."""
    if sampling not in SAMPLING_STYLES:
        raise ValueError(f"sampling={sampling!r}: expected one of {SAMPLING_STYLES}.")
    if block_size is not None and (isinstance(block_size, bool) or int(block_size) != block_size or block_size < 1):
        raise ValueError(f"block_size={block_size!r} must be a positive int (or None for a bidirectional model).")
    config = model_config(model)
    vocab_size = config.get_text_config().vocab_size  # never a weight's shape: ZeRO-3 / FSDP weights are sharded
    if not 0 <= int(mask_token_id) < vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary (config.vocab_size={vocab_size}).")
    config.mask_token_id = int(mask_token_id)
    config.diffusion_logit_shift = bool(logit_shift)
    config.diffusion_sampling = sampling
    if eos_token_id is not None:
        config.eos_token_id = eos_token_id
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    if block_size is not None:
        config.diffusion_block_size = int(block_size)
    elif hasattr(config, "diffusion_block_size"):
        del config.diffusion_block_size
    return make_bidirectional(model)


def diffusion_block_size(model_or_config) -> int | None:
    """The attention block size of a block-diffusion LM (``config.diffusion_block_size``); ``None`` when the model
    attends bidirectionally. Takes a model (through any engine wrapper) or a config."""
    config = model_or_config if not isinstance(model_or_config, nn.Module) else model_config(model_or_config)
    return getattr(config, "diffusion_block_size", None)


def eos_token_ids(config) -> list[int]:
    """EOS ids of a config as a list (configs store an int or a list)."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def attention_mask_4d(
    key_padding_mask: torch.Tensor | None,
    batch_size: int,
    query_length: int,
    key_length: int,
    device: torch.device,
    additive_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Bidirectional 4-D mask ``(B, 1, q, k)`` from a per-key padding mask (1 = real key).

    Boolean (True = attend) for sdpa/flex kernels; additive (0 / ``finfo.min``) in ``additive_dtype`` for
    eager attention, which adds the mask to the scores.
    """
    if key_padding_mask is None:
        keep = torch.ones(batch_size, key_length, dtype=torch.bool, device=device)
    else:
        if key_padding_mask.shape != (batch_size, key_length):
            raise ValueError(
                f"attention_mask has shape {tuple(key_padding_mask.shape)}, expected ({batch_size}, {key_length}) "
                "(one entry per key, cached keys included)."
            )
        keep = key_padding_mask.to(device=device, dtype=torch.bool)
    keep = keep[:, None, None, :].expand(batch_size, 1, query_length, key_length)
    if additive_dtype is None:
        return keep
    return torch.zeros(keep.shape, dtype=additive_dtype, device=device).masked_fill(
        ~keep, torch.finfo(additive_dtype).min
    )


def mask_dtype_for(model_or_decoder: nn.Module, dtype: torch.dtype) -> torch.dtype | None:
    """``None`` (boolean mask) unless the model runs eager attention, which needs an additive mask."""
    implementation = getattr(model_config(model_or_decoder), "_attn_implementation", None) or "eager"
    if implementation != "eager":
        return None
    if not dtype.is_floating_point:  # quantised embeddings: use the compute dtype
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else torch.float32
    return dtype


def attention_mask_dtype(model: nn.Module) -> torch.dtype | None:
    """:func:`mask_dtype_for` the model's own weights: the dtype of the 4-D masks its callers build."""
    return mask_dtype_for(model, decoder_of(model).embed_tokens.weight.dtype)


def _bidirectional_pre_hook(module, args, kwargs):
    if len(args) > 1:
        raise TypeError("Call the decoder of a diffusion LM with keyword arguments (attention_mask=...).")
    check_attention_implementation(module.config)  # the implementation can be switched after loading
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() == 4:
        return args, kwargs
    inputs_embeds = kwargs.get("inputs_embeds")
    reference = inputs_embeds if inputs_embeds is not None else kwargs.get("input_ids", args[0] if args else None)
    batch_size, query_length = reference.shape[:2]
    past = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers ≥ 5.24 calls it `cache`
    past_length = past.get_seq_length() if past is not None else 0
    key_length = past_length + query_length
    if attention_mask is not None and attention_mask.shape[-1] != key_length:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} keys but the call sees {key_length} "
            f"({past_length} cached + {query_length} new)."
        )
    dtype = inputs_embeds.dtype if inputs_embeds is not None else module.embed_tokens.weight.dtype
    additive_dtype = mask_dtype_for(module, dtype)
    kwargs = dict(kwargs)
    block_size = diffusion_block_size(module.config)
    if block_size is None:
        kwargs["attention_mask"] = attention_mask_4d(
            attention_mask, batch_size, query_length, key_length, reference.device, additive_dtype
        )
        return args, kwargs
    device = reference.device
    keys = torch.ones(batch_size, key_length, dtype=torch.bool, device=device) if attention_mask is None else attention_mask
    queries = torch.arange(past_length, key_length, device=device)
    kwargs["attention_mask"] = block_causal_mask(
        keys, column_blocks(0, key_length, block_size, device), queries // block_size, queries,
        additive_dtype=additive_dtype,
    )
    return args, kwargs


def make_bidirectional(model: nn.Module) -> nn.Module:
    """Make ``model`` attend bidirectionally (block-causally for a block-diffusion LM), whatever mask its callers
    pass. Idempotent."""
    check_attention_implementation(diffusion_config(model))
    decoder = decoder_of(model)
    for sub in decoder.modules():
        if hasattr(sub, "is_causal"):
            sub.is_causal = False
    if getattr(decoder, _HOOK_ATTR, None) is None:
        handle = decoder.register_forward_pre_hook(_bidirectional_pre_hook, with_kwargs=True)
        setattr(decoder, _HOOK_ATTR, handle)
    return model


def is_bidirectional(model: nn.Module) -> bool:
    return getattr(decoder_of(model), _HOOK_ATTR, None) is not None
