"""setup.cfg's install floors are true: transformers' floor is at least the release that introduced every transformers
name the package imports (and the release whose behaviour it needs), and no floor is below the one TRL (pinned) itself
requires."""

from __future__ import annotations

import ast
import configparser
import importlib
import importlib.metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

TRANSFORMERS_SINCE = {
    # (module, name) -> the first transformers release that has it. Measured by importing each name under the
    # released wheels (5.0.0, 5.1.0, 5.2.0, 5.11.0, 5.12.0): a name absent from 5.0.0 carries the release it arrived in.
    ("transformers", "AutoConfig"): "5.0.0",
    ("transformers", "AutoModelForCausalLM"): "5.0.0",
    ("transformers", "AutoTokenizer"): "5.0.0",
    ("transformers", "DiffusionGemmaForBlockDiffusion"): "5.11.0",
    ("transformers", "DynamicCache"): "5.0.0",
    ("transformers", "Glm4MoeConfig"): "5.0.0",
    ("transformers", "Glm4MoeForCausalLM"): "5.0.0",
    ("transformers", "LlamaConfig"): "5.0.0",
    ("transformers", "LlamaForCausalLM"): "5.0.0",
    ("transformers", "LogitsProcessor"): "5.0.0",
    ("transformers", "PreTrainedTokenizerFast"): "5.0.0",
    ("transformers", "PretrainedConfig"): "5.0.0",
    ("transformers", "Qwen2Config"): "5.0.0",
    ("transformers", "Qwen2ForCausalLM"): "5.0.0",
    ("transformers", "Qwen3Config"): "5.0.0",
    ("transformers", "Qwen3ForCausalLM"): "5.0.0",
    ("transformers", "TrainerCallback"): "5.0.0",
    ("transformers.cache_utils", "Cache"): "5.0.0",
    ("transformers.cache_utils", "CacheLayerMixin"): "5.0.0",
    ("transformers.generation.logits_process", "MinPLogitsWarper"): "5.0.0",
    ("transformers.generation.logits_process", "TopKLogitsWarper"): "5.0.0",
    ("transformers.generation.logits_process", "TopPLogitsWarper"): "5.0.0",
    ("transformers.integrations", "get_available_reporting_integrations"): "5.0.0",
    ("transformers.models.diffusion_gemma.modeling_diffusion_gemma", "DiffusionGemmaModelOutputWithPast"): "5.12.0",
    ("transformers.trainer_callback", "PrinterCallback"): "5.0.0",
    ("transformers.trainer_callback", "ProgressCallback"): "5.0.0",
    ("transformers.trainer_utils", "rotate_checkpoints"): "5.2.0",
    ("transformers.utils", "cached_file"): "5.0.0",
    ("transformers.utils", "logging"): "5.0.0",
}

TRANSFORMERS_BEHAVIOUR_SINCE = {
    # what the package needs beyond a name -> the first release that does it (measured the same way: the test named
    # run under each released wheel)
    "DiffusionGemma decoding (tests/test_diffusion_gemma_generation.py): 5.12.x's decoder mask builder reads a "
    "top-level `sliding_window` that DiffusionGemmaConfig does not have": "5.13.0",
}


def install_requires() -> dict[str, Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    return {Requirement(line).name: Requirement(line) for line in lines}


def floor(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    return max(floors, default=None)


def transformers_imports() -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from transformers… import name`` in the package (at any depth)."""
    found = set()
    for path in (ROOT / "src" / "dllm_trl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            top = (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) and not node.level else None
            if top == "transformers":
                found.update((node.module, alias.name) for alias in node.names)
    return found


def test_the_table_lists_every_transformers_name_the_package_imports():
    imported = transformers_imports()
    assert imported - set(TRANSFORMERS_SINCE) == set(), "add these to TRANSFORMERS_SINCE with their first release"
    assert set(TRANSFORMERS_SINCE) - imported == set(), "no longer imported: drop them from TRANSFORMERS_SINCE"
    for module, name in imported:  # and the installed transformers has them all
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_the_transformers_floor_has_what_the_package_needs():
    since = {f"{m}.{n}": v for (m, n), v in TRANSFORMERS_SINCE.items()} | TRANSFORMERS_BEHAVIOUR_SINCE
    needed = max(Version(v) for v in since.values())
    declared = floor(install_requires()["transformers"]) or Version("0")
    later = [what for what, v in since.items() if Version(v) > declared]
    assert declared >= needed, f"setup.cfg says transformers>={declared}, but {needed} is needed for: {later}"


def test_no_floor_is_below_trls_own():
    """TRL is pinned; a dependency it shares with us cannot install below TRL's floor, so ours says at least that."""
    ours = install_requires()
    for line in importlib.metadata.requires("trl") or []:
        theirs = Requirement(line)
        if theirs.marker is None and theirs.name in ours and floor(theirs) is not None:
            assert floor(ours[theirs.name]) >= floor(theirs), f"TRL needs {theirs}; setup.cfg: {ours[theirs.name]}"
