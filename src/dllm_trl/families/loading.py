"""Checkpoint → transformers model of its family (the registry decides which), and a PEFT adapter folder onto it."""

from __future__ import annotations

import os

from ..models.integrity import verify_manifest
from ..models.loading import hub_kwargs, read_raw_config
from .base import family_for_checkpoint, family_of


def load_diffusion_model(
    name_or_path: str,
    mask_token_id: int | None = None,
    logit_shift: bool | None = None,
    sampling: str | None = None,
    block_size: int | None = None,
    verify_checksums: bool = True,
    **from_pretrained_kwargs,
):
    """Load a diffusion LM as a plain transformers model: the family of the checkpoint (the registry,
    :func:`~dllm_trl.families.family_for_checkpoint`) translates and loads it, without ``trust_remote_code``.

    * LLaDA → ``LlamaForCausalLM`` (weights renamed at load), bidirectional.
    * Dream → ``Qwen2ForCausalLM`` (weights unchanged, logits shifted right by one), bidirectional.
    * SDAR / TraDo → ``Qwen3ForCausalLM``, block-causal with blocks of ``block_size`` (required: the checkpoints do
      not record it), mask token 151669 unless ``mask_token_id`` is given.
    * Fast-dLLM v2 → ``Qwen2ForCausalLM``, block-causal with blocks of ``block_size`` (default: the config's
      ``bd_size``), logits shifted right by one, mask token 151665 unless the config or ``mask_token_id`` says
      otherwise.
    * LLaDA2.0 / 2.1 → ``Glm4MoeForCausalLM``, block-causal with blocks of 32 (``block_size`` overrides), mask token
      156895 and EOS 156892 unless ``mask_token_id`` / the config say otherwise; safetensors only.
    * DiffusionGemma → transformers' own ``DiffusionGemmaForBlockDiffusion``, unchanged: uniform-noise diffusion with
      no mask token, so ``mask_token_id`` / ``logit_shift`` / ``sampling`` / ``block_size`` are refused.
    * A checkpoint this package saved (its config carries the diffusion properties), or any other causal-LM
      checkpoint when ``mask_token_id`` is given (``block_size`` makes it block-causal).
    * A family registered by the user (:func:`~dllm_trl.families.register_family`) that claims the checkpoint.

    ``logit_shift`` / ``sampling`` override the family defaults. A local folder saved by this package's trainers
    carries a checksum manifest: its files are verified before loading (``verify_checksums=False`` skips it). Other
    keyword arguments go to ``from_pretrained``.
    """
    if verify_checksums and os.path.isdir(name_or_path):
        verify_manifest(name_or_path, " Save the model again, or load it with verify_checksums=False to skip the check.")
    raw = read_raw_config(name_or_path, **hub_kwargs(from_pretrained_kwargs))
    family = family_for_checkpoint(raw)
    return family.load(name_or_path, raw, mask_token_id=mask_token_id, logit_shift=logit_shift, sampling=sampling,
                       block_size=block_size, **from_pretrained_kwargs)


def load_adapter(base, path: str, merge: bool = True):
    """The PEFT adapter folder ``path`` on top of ``base``: merged into its weights (a plain transformers model again),
    or with ``merge=False`` kept as a ``PeftModel`` (a quantised base cannot take merged weights); the family of
    ``base`` decides how (DiffusionGemma ties its encoder adapters to their decoder twins first)."""
    return family_of(base).load_adapter(base, path, merge)
