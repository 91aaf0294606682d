"""The light entry points import neither TRL nor PEFT; the package's names are still all there (loaded lazily)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import dllm_trl
import dllm_trl.models

HEAVY = ("trl", "peft", "bitsandbytes")


@pytest.mark.parametrize("module", ["dllm_trl", "dllm_trl.generation", "dllm_trl.models", "dllm_trl.losses"])
def test_light_import(module):
    probe = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"import {module} imported {done.stdout.strip()}"


@pytest.mark.parametrize("package", [dllm_trl, dllm_trl.models], ids=lambda p: p.__name__)
def test_every_public_name_resolves_to_its_definition(package):
    namespace: dict = {}
    exec(f"from {package.__name__} import *", namespace)
    assert set(package.__all__) <= set(namespace) and set(package.__all__) <= set(dir(package))
    for name in package.__all__:
        assert getattr(package, name) is namespace[name]
    assert dllm_trl.RLDFTrainer is importlib.import_module("dllm_trl.trainers.rldf_trainer").RLDFTrainer
    with pytest.raises(AttributeError, match="no attribute 'RLDFTrainerr'"):
        package.RLDFTrainerr  # noqa: B018
