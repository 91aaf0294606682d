"""Model families as a registry (:mod:`.base`): one module per family — LLaDA, Dream, SDAR / TraDo, Fast-dLLM v2,
LLaDA2, DiffusionGemma, the generic masked-diffusion LM and the plain causal LM — each saying how its checkpoints are
recognised and loaded, its decoding block, default sampler and losses, and LoRA targets. The trainers, the loader and
the evaluation ask the registry; a user's family is one :class:`ModelFamily` subclass passed to
:func:`register_family`."""

from .base import (
    FAMILY_CONFIG_KEY,
    ModelFamily,
    family_for_checkpoint,
    family_named,
    family_of,
    is_model_type,
    register_family,
    registered_families,
    unregister_family,
)
from .loading import load_adapter, load_diffusion_model
from .masked import MaskedDiffusionFamily, mark_family
from .pretrained import check_trainable, load_model_and_tokenizer, model_init_kwargs, save_trained_model

__all__ = [
    "check_trainable",
    "load_model_and_tokenizer",
    "model_init_kwargs",
    "save_trained_model",
    "FAMILY_CONFIG_KEY",
    "MaskedDiffusionFamily",
    "ModelFamily",
    "family_for_checkpoint",
    "family_named",
    "family_of",
    "is_model_type",
    "load_adapter",
    "load_diffusion_model",
    "mark_family",
    "register_family",
    "registered_families",
    "unregister_family",
]
