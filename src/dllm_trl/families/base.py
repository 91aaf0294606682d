"""What a model family is to the trainers, loaders and evaluation, and the registry that finds a checkpoint's or a
model's family.

A family is one module (:mod:`dllm_trl.families.llada`, …) with a :class:`ModelFamily` subclass registered in it: how
to recognise its checkpoints (and its models once loaded), how to load a checkpoint as a transformers model, its
decoding block (or canvas) length, its default sampler, RLDF loss and trust-region loss, and its LoRA targets.
:class:`~dllm_trl.RLDFTrainer`, :func:`~dllm_trl.DPPOMaskTrainer`, :func:`~dllm_trl.load_diffusion_model` and the
evaluation ask the registry (:func:`family_for_checkpoint`, :func:`family_of`), never a family by name, so a new family
(in the package or in a user's own module, :func:`register_family`) touches no trainer.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from ..models.engines import model_config

FAMILY_CONFIG_KEY = "diffusion_family"
"""``model.config`` key naming the family a model was loaded as (it survives ``save_pretrained`` and PEFT wrapping)."""

_REGISTRY: dict[str, ModelFamily] = {}
_USER_ORDER: list[str] = []  # users' families, the latest registration first: tried before the built-in ones
_BUILTIN: dict[str, ModelFamily] = {}  # the package's own, one per module of this package
INFRASTRUCTURE_MODULES = ("base", "loading", "pretrained")
"""Modules of this package that hold no family; every other module holds one."""


class ModelFamily:
    """One model family (module docstring). Subclasses set :attr:`name` and :attr:`kind` and override what differs;
    every method gets the model as the trainer sees it (through engine and PEFT wrappers, :func:`model_config`)."""

    name: ClassVar[str] = ""
    """Registry key, written on the loaded model's config (:data:`FAMILY_CONFIG_KEY`)."""
    kind: ClassVar[str] = "diffusion"
    """``"diffusion"`` (RLDF / :class:`~dllm_trl.DiffusionDPPOMaskTrainer`) or ``"causal"``
    (:class:`~dllm_trl.CausalDPPOMaskTrainer`)."""
    trains_as_causal_lm: ClassVar[bool] = False
    """Whether its model, while it attends causally, is an ordinary causal LM that ``model_kind="causal"`` may train
    (a masked-diffusion family's transformers class is one; DiffusionGemma is not)."""
    lora_target_modules: ClassVar[str | list[str] | None] = None
    """PEFT ``target_modules`` when the user names none (``None``: PEFT's own default for the architecture)."""

    # ------------------------------------------------------------------------------------------- recognising
    def matches_checkpoint(self, raw_config: dict) -> bool:
        """Whether a checkpoint's ``config.json`` (a dict) is this family's."""
        return False

    def matches_model(self, model) -> bool:
        """Whether a loaded model that names no family on its config is this family's (structural test)."""
        return False

    # --------------------------------------------------------------------------------------------------- loading
    def load(self, name_or_path: str, raw_config: dict, *, mask_token_id=None, logit_shift=None, sampling=None,
             block_size=None, **from_pretrained_kwargs):
        """The checkpoint as a transformers model carrying this family's properties (see
        :func:`~dllm_trl.load_diffusion_model` for the arguments)."""
        raise NotImplementedError(f"the {self.name!r} family does not load checkpoints")

    def load_adapter(self, base, path: str, merge: bool = True):
        """The PEFT adapter folder ``path`` on ``base``: merged into its weights, or kept as a ``PeftModel``."""
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, path)
        return model.merge_and_unload() if merge else model

    # ------------------------------------------------------------------------------------------- model set-up
    def check_peft_config(self, peft_config) -> None:
        """Refuse a ``peft_config`` the family's model cannot be wrapped with (before TRL wraps it)."""

    def prepare_model(self, model) -> None:
        """Set the model up for training before the trainer wraps it (whatever loss scores it)."""

    def prepare_wrapped_model(self, model) -> None:
        """Adjust the model once TRL has wrapped it (with ``peft_config``, its adapters exist only now), before the
        engine shards it."""

    # ------------------------------------------------------------------------------------------------- training
    def block_length(self, model, max_completion_length: int) -> int:
        """The decoding block (or canvas) length ``RLDFConfig.block_length=None`` resolves to for completions of
        ``max_completion_length`` tokens."""
        raise NotImplementedError(f"the {self.name!r} family has no decoding block")

    def sampler(self, args, model, block_length: int):
        """The default rollout of a diffusion trainer with ``args`` on ``model``."""
        raise NotImplementedError(f"the {self.name!r} family has no diffusion sampler")

    def rldf_loss(self, args, model):
        """The default loss object of :class:`~dllm_trl.RLDFTrainer`."""
        raise NotImplementedError(f"the {self.name!r} family has no RLDF loss")

    def trust_region_loss(self, args, model):
        """The default loss object of :class:`~dllm_trl.DiffusionDPPOMaskTrainer`."""
        raise NotImplementedError(f"the {self.name!r} family has no diffusion trust-region loss")

    # ----------------------------------------------------------------------------------------------- evaluation
    def sampler_config(self, model, **overrides):
        """The family's decoding settings for evaluation (the model's own defaults, with ``overrides``)."""
        raise NotImplementedError(f"the {self.name!r} family has no sampler settings")

    def sampler_for(self, config):
        """A sampler decoding with ``config`` (a :meth:`sampler_config` result)."""
        raise NotImplementedError(f"the {self.name!r} family has no sampler")

    def length_unit(self, model, config) -> int:
        """Granularity of a completion length: ``gen_length`` must be a multiple of it."""
        return 1

    detection_priority: ClassVar[int] = 0
    """Among the package's families, lower is tried first (a fallback that claims any checkpoint goes last)."""

    greedy_decoding: ClassVar[bool] = True
    """Whether the family's decoding has a greedy mode (temperature 0)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ({self.kind})>"


def checkpoint_names(raw_config: dict) -> list[str]:
    """A checkpoint's ``model_type`` and ``architectures``, lower-cased: what its family is recognised by."""
    return [str(name).lower() for name in [raw_config.get("model_type", ""), *(raw_config.get("architectures") or [])]]


def is_model_type(raw_config: dict, prefix: str) -> bool:
    """Whether a checkpoint's ``model_type`` or one of its ``architectures`` starts with ``prefix`` (any case)."""
    return any(name.startswith(prefix) for name in checkpoint_names(raw_config))


def register_family(family: ModelFamily | type[ModelFamily]):
    """Add a family to the registry (a class is instantiated; usable as a class decorator, which returns the class).
    A user's family is tried before the package's own, the latest registered first, so it may claim checkpoints and
    models a built-in family would."""
    instance = family() if isinstance(family, type) else family
    if not instance.name or not isinstance(instance.name, str):
        raise ValueError(f"{type(instance).__name__}.name must be a non-empty string (the registry key).")
    if instance.kind not in ("diffusion", "causal"):
        raise ValueError(f"{type(instance).__name__}.kind={instance.kind!r}: expected 'diffusion' or 'causal'.")
    if type(instance).__module__.startswith(__package__ + "."):  # the package's own
        _BUILTIN[instance.name] = instance
    else:
        if instance.name in _builtin_names():
            raise ValueError(f"{type(instance).__name__}.name={instance.name!r} is a built-in family's name: choose "
                             "another (a user's family is tried before the built-in ones anyway).")
        if instance.name in _USER_ORDER:
            _USER_ORDER.remove(instance.name)
        _USER_ORDER.insert(0, instance.name)
    _REGISTRY[instance.name] = instance
    return family


def unregister_family(name: str) -> None:
    """Remove a user's family from the registry (e.g. at the end of a test)."""
    if name not in _USER_ORDER:
        raise ValueError(f"{name!r} is not a family registered by the user (built-in families stay registered).")
    _USER_ORDER.remove(name)
    del _REGISTRY[name]


def registered_families() -> list[ModelFamily]:
    """The registered families in detection order: the user's (latest first), then the package's own by
    :attr:`~ModelFamily.detection_priority`."""
    _load_builtin_families()
    builtin = sorted(_BUILTIN.values(), key=lambda family: (family.detection_priority, family.name))
    return [_REGISTRY[name] for name in _USER_ORDER] + builtin


def family_named(name: str) -> ModelFamily:
    _load_builtin_families()
    if name not in _REGISTRY:
        raise KeyError(f"no model family named {name!r} is registered; known: {sorted(_REGISTRY)}.")
    return _REGISTRY[name]


def family_for_checkpoint(raw_config: dict) -> ModelFamily:
    """The family of a checkpoint from its ``config.json`` (the first registered family that claims it)."""
    for family in registered_families():
        if family.matches_checkpoint(raw_config):
            return family
    raise ValueError(f"no registered model family recognises this checkpoint (model_type="
                     f"{raw_config.get('model_type')!r}, architectures={raw_config.get('architectures')!r}).")


def family_of(model) -> ModelFamily:
    """The family of a loaded model (through engine and PEFT wrappers): the one its config names when registered,
    else the first registered family that recognises it."""
    families = registered_families()
    named = getattr(model_config(model), FAMILY_CONFIG_KEY, None)
    if named in _REGISTRY:
        return _REGISTRY[named]
    for family in families:
        if family.matches_model(model):
            return family
    raise ValueError(f"no registered model family recognises {type(model).__name__}.")


@functools.cache
def _builtin_names() -> tuple[str, ...]:
    """The modules of this package that hold a family (named as their family); read once."""
    import pkgutil
    from pathlib import Path

    return tuple(module.name for module in pkgutil.iter_modules([str(Path(__file__).parent)])
                 if module.name not in INFRASTRUCTURE_MODULES)


def _load_builtin_families() -> None:
    """Import the package's family modules once (each registers its family when imported)."""
    names = _builtin_names()
    if all(name in _BUILTIN for name in names):
        return
    import importlib

    for name in names:
        importlib.import_module(f".{name}", __package__)
    missing = sorted(set(names) - set(_BUILTIN))
    if missing:
        raise RuntimeError(f"dllm_trl.families modules {missing} register no family of their own name.")
