"""The loss and sampler interfaces are written down (``DiffusionLoss``, ``RolloutSampler``): every member a diffusion
trainer calls is declared there, and every shipped loss object and sampler has each member, with the declared
parameters under the same names."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import dllm_trl.trainers.dppo_mask_trainer as dppo_module
import dllm_trl.trainers.rldf_trainer as rldf_module
from dllm_trl.generation import DiffusionGemmaSampler, MaskedDiffusionSampler, RolloutSampler
from dllm_trl.losses import (
    DiffusionGemmaRLDFLoss,
    DiffusionGemmaTrustRegionLoss,
    DiffusionLoss,
    DiffusionTrustRegionLoss,
    MoERLDFLoss,
    RLDFLoss,
)

LOSSES = (RLDFLoss, MoERLDFLoss, DiffusionTrustRegionLoss, DiffusionGemmaRLDFLoss, DiffusionGemmaTrustRegionLoss)
SAMPLERS = (MaskedDiffusionSampler, DiffusionGemmaSampler)
DIFFUSION_TRAINERS = ((rldf_module, "RLDFTrainer"), (dppo_module, "DiffusionDPPOMaskTrainer"))


def members(protocol) -> set[str]:
    return {name for name in dir(protocol) if not name.startswith("_") or name == "__call__"} - set(dir(object)) | (
        set(getattr(protocol, "__annotations__", {})) | ({"__call__"} if "__call__" in vars(protocol) else set())
    )


def attributes_used(module, class_name: str, holder: str) -> set[str]:
    """Every ``self.<holder>.<name>`` read in the class's source."""
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    used = set()
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == holder
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
            used.add(node.attr)
    return used


@pytest.mark.parametrize("module, class_name", DIFFUSION_TRAINERS)
def test_every_member_the_trainers_call_is_declared(module, class_name):
    loss_members, sampler_members = members(DiffusionLoss), members(RolloutSampler)
    assert attributes_used(module, class_name, "loss") <= loss_members, "declare it in DiffusionLoss"
    assert attributes_used(module, class_name, "sampler") <= sampler_members, "declare it in RolloutSampler"
    if class_name == "RLDFTrainer":  # the scan sees the calls (the check cannot pass vacuously)
        assert {"sample_states", "chunk_loss", "bind_sampler"} <= attributes_used(module, class_name, "loss")
        assert {"config", "check_model"} <= attributes_used(module, class_name, "sampler")


def _parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("implementation, protocol", [(cls, DiffusionLoss) for cls in LOSSES]
                         + [(cls, RolloutSampler) for cls in SAMPLERS], ids=lambda x: getattr(x, "__name__", x))
def test_every_shipped_object_has_each_member_with_the_declared_parameters(implementation, protocol):
    for name in members(protocol):
        assert hasattr(implementation, name) or name in _instance_attributes(implementation), (
            f"{implementation.__name__} lacks {name}")
        declared = inspect.getattr_static(protocol, name, None)
        if not callable(declared) or isinstance(declared, property):
            continue
        given = _parameters(getattr(implementation, name))
        expected = _parameters(getattr(protocol, name))
        missing = [p for p in expected if p not in given]
        assert not missing, f"{implementation.__name__}.{name}{tuple(given)} lacks {missing} of {expected}"
        assert given[: len(expected)] == expected, f"{implementation.__name__}.{name}: parameters out of order"


def _instance_attributes(cls) -> set[str]:
    """Attributes set in ``__init__`` (``self.config = ...``)."""
    source = inspect.getsource(cls.__init__)
    tree = ast.parse(inspect.cleandoc("\n" + source) if source.startswith(" ") else source)
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}
