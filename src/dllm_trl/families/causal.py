"""Plain causal LMs: the trust-region trainer's own setting (paper 2), and any checkpoint no other family claims.

A causal LM trains with :class:`~dllm_trl.CausalDPPOMaskTrainer` (TRL's generation, μ captured as sampled). Given a
``mask_token_id``, :func:`~dllm_trl.load_diffusion_model` runs such a checkpoint as a masked-diffusion LM instead
(:class:`~dllm_trl.families.masked.GenericMaskedFamily`).
"""

from __future__ import annotations

from .base import ModelFamily, register_family
from .masked import GenericMaskedFamily


@register_family
class CausalFamily(ModelFamily):
    """Any checkpoint or model no other family recognises (tried last)."""

    name = "causal"
    kind = "causal"
    detection_priority = 100  # it claims anything: tried last

    def matches_checkpoint(self, raw_config: dict) -> bool:
        return True

    def matches_model(self, model) -> bool:
        return True

    def load(self, name_or_path, raw_config, *, mask_token_id=None, **kwargs):
        """As a masked-diffusion LM (``mask_token_id`` is required): see :class:`GenericMaskedFamily`."""
        return GenericMaskedFamily().load(name_or_path, raw_config, mask_token_id=mask_token_id, **kwargs)
