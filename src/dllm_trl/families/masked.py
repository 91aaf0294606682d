"""Masked diffusion (SPEC §1–2, §4): what every masked-diffusion family shares, and the generic family of a causal-LM
checkpoint run as one (a ``mask_token_id`` given at load, or a checkpoint this package saved, which carries it).

:class:`MaskedDiffusionFamily` is the base of the LLaDA, Dream, SDAR / TraDo, Fast-dLLM v2 and LLaDA2 families:
block-wise masked decoding with a KV cache (:class:`~dllm_trl.generation.MaskedDiffusionSampler`), the RLDF loss
(:class:`~dllm_trl.losses.RLDFLoss`; :class:`~dllm_trl.losses.MoERLDFLoss`, with routing-drift metrics, for a
mixture-of-experts block-diffusion model), the masked trust-region loss, decoding blocks of 32 on a bidirectional
model and of the attention block on a block-diffusion one.
"""

from __future__ import annotations

import math

from transformers import AutoConfig, AutoModelForCausalLM

from ..models.bidirectional import diffusion_block_size, diffusion_config, make_bidirectional, set_diffusion_properties
from ..models.engines import model_config
from ..models.engines import vocab_size as model_vocab_size
from ..models.loading import hub_kwargs
from ..models.routing import router_modules
from .base import FAMILY_CONFIG_KEY, ModelFamily, register_family

DEFAULT_BLOCK_LENGTH = 32
"""Decoding block of a bidirectional masked-diffusion LM when ``block_length`` is not given (LLaDA's and Dream's
published settings), when it divides the completion length."""


def mark_family(model, family: ModelFamily):
    """Write the family's name on the model's config (:data:`~dllm_trl.families.base.FAMILY_CONFIG_KEY`)."""
    setattr(model_config(model), FAMILY_CONFIG_KEY, family.name)
    return model


class MaskedDiffusionFamily(ModelFamily):
    """The trainer-side defaults of masked diffusion (module docstring)."""

    kind = "diffusion"
    trains_as_causal_lm = True

    def finish_loading(self, model, *, mask_token_id, logit_shift, sampling, block_size):
        """Write the diffusion properties (and the family's name) on a loaded model and make it bidirectional."""
        set_diffusion_properties(model, mask_token_id=mask_token_id, logit_shift=logit_shift, sampling=sampling,
                                 block_size=block_size)
        return mark_family(model, self)

    def prepare_model(self, model) -> None:
        """Masked diffusion attends bidirectionally (block-causally for a block-diffusion model)."""
        make_bidirectional(model)

    def block_length(self, model, max_completion_length: int) -> int:
        """The attention block of a block-diffusion model; on a bidirectional one 32 when it divides
        ``max_completion_length``, else the whole completion as one block."""
        block = diffusion_block_size(model)
        if block is not None:
            return block
        return DEFAULT_BLOCK_LENGTH if max_completion_length % DEFAULT_BLOCK_LENGTH == 0 else max_completion_length

    def sampler(self, args, model, block_length: int):
        return self.sampler_for(args.diffusion_generation_config(block_length=block_length))

    def rldf_loss(self, args, model):
        from ..losses import MoERLDFLoss, RLDFLoss

        routed = bool(router_modules(model)) and diffusion_block_size(model) is not None
        return MoERLDFLoss(args) if routed else RLDFLoss(args)

    def trust_region_loss(self, args, model):
        from ..losses import DiffusionTrustRegionLoss

        config = diffusion_config(model)
        usable = model_vocab_size(model) - 1  # the samplers never draw the mask token
        check_top_k(args, usable)
        return DiffusionTrustRegionLoss(args, usable, None, config.mask_token_id,
                                        1 if getattr(config, "diffusion_logit_shift", False) else 0)

    def sampler_config(self, model, **overrides):
        from ..generation import DiffusionGenerationConfig

        block = diffusion_block_size(model)
        defaults = {} if block is None else dict(block_length=block, gen_length=math.lcm(256, block))
        return DiffusionGenerationConfig(**{**defaults, **overrides})

    def sampler_for(self, config):
        from ..generation.samplers import MaskedDiffusionSampler

        return MaskedDiffusionSampler(config)

    def length_unit(self, model, config) -> int:
        return math.lcm(config.block_length, diffusion_block_size(model) or 1)


REMOTE_CODE_KEYS = ("architectures", "auto_map", "model_type", "transformers_version", "bd_size", "fuse_cross_entropy")
"""Keys of the official configs that only their remote code reads (``bd_size``: Fast-dLLM v2's training block)."""


def qwen_config(raw: dict, config_class, default_rope_theta: float):
    """A Qwen2 / Qwen3 config from an official config.json written for the remote code (same keys, RoPE as
    ``rope_theta`` / ``rope_scaling``)."""
    keys = {k: v for k, v in raw.items() if k not in REMOTE_CODE_KEYS}
    rope_theta = keys.pop("rope_theta", default_rope_theta)
    rope_scaling = keys.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope.update(rope_scaling)
        rope["rope_theta"] = float(rope_theta)
    keys.setdefault("rope_parameters", rope)
    return config_class(**keys)


def refuse_sliding_window(raw: dict, family: str) -> None:
    if raw.get("use_sliding_window"):
        raise ValueError(
            f"This {family} checkpoint asks for sliding-window attention (use_sliding_window: true), which the "
            "explicit block-causal mask would silently override; only full attention is supported."
        )


def refuse_block_size(family: ModelFamily, block_size) -> None:
    """A bidirectional family's checkpoints take no attention block size."""
    if block_size is not None:
        raise ValueError(
            f"block_size={block_size}: {family.name} checkpoints are trained with bidirectional attention; block_size "
            "applies to block-diffusion checkpoints (SDAR / TraDo, Fast-dLLM v2, LLaDA2, or a plain causal LM with "
            "mask_token_id=)."
        )


def check_top_k(args, vocab_size: int) -> None:
    """The trust-region mask's top-K fits in the tokens the policy can sample."""
    if args.divergence_top_k > vocab_size:
        raise ValueError(
            f"divergence_top_k={args.divergence_top_k} exceeds the {vocab_size} tokens the policy can sample; lower it."
        )


@register_family
class GenericMaskedFamily(MaskedDiffusionFamily):
    """A causal-LM checkpoint saved by this package as a diffusion LM (its config carries ``mask_token_id`` and the
    diffusion marks): loaded with its transformers class, its saved properties (overridable) restored."""

    name = "masked"
    detection_priority = 90  # after the families whose official formats it could be mistaken for

    def matches_model(self, model) -> bool:
        """Any model carrying a mask token that names no family (e.g. built with ``set_diffusion_properties``)."""
        return getattr(model_config(model), "mask_token_id", None) is not None

    def matches_checkpoint(self, raw_config: dict) -> bool:
        return raw_config.get("mask_token_id") is not None and "diffusion_logit_shift" in raw_config

    def load(self, name_or_path, raw_config, *, mask_token_id=None, logit_shift=None, sampling=None, block_size=None,
             **from_pretrained_kwargs):
        config = AutoConfig.from_pretrained(name_or_path, **hub_kwargs(from_pretrained_kwargs))
        model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)
        saved = model.config
        if mask_token_id is None and getattr(saved, "mask_token_id", None) is None:
            raise ValueError(
                f"{name_or_path!r} is not a checkpoint of a known diffusion family; pass `mask_token_id=` (the id of "
                "the mask token in its vocabulary) to use it as a masked-diffusion LM."
            )
        named = getattr(saved, FAMILY_CONFIG_KEY, None)  # the family it was loaded as before it was saved
        set_diffusion_properties(
            model,
            mask_token_id=mask_token_id if mask_token_id is not None else saved.mask_token_id,
            logit_shift=getattr(saved, "diffusion_logit_shift", False) if logit_shift is None else logit_shift,
            sampling=sampling or getattr(saved, "diffusion_sampling", None) or "gumbel",
            block_size=block_size if block_size is not None else getattr(saved, "diffusion_block_size", None),
        )
        if named is None:
            mark_family(model, self)
        return model
