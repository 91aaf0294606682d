"""Every code block of README.md and docs/*.md runs as written, on a CPU and offline.

* Python blocks run in order, one interpreter per file, in a scratch folder with ``HF_HUB_OFFLINE=1``. The hub
  model names are replaced by the embedded toy models' folders, as the README tells a user without a GPU to do (the
  toy's config raised to 1024 positions, as the README says, since the trainers refuse prompts past them).
* Shell commands: setting up the environment (``python3 -m venv``, activating it, ``pip install``) and the test
  suite itself are what ``.ci/run`` does on every run; every other command is checked by its own argument parser
  with ``tests/docs_dry_run.py`` (flags and values, without training for minutes or rewriting committed results).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_trl.toy import toy_assets_dir
from dllm_trl.toy.block import toy_block_assets_dir

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HUB_MODELS = ("GSAI-ML/LLaDA-8B-Instruct", "Dream-org/Dream-v0-Instruct-7B")
BLOCK_HUB_MODELS = ("JetLM/SDAR-8B-Chat", "Gen-Verse/TraDo-8B-Instruct", "Efficient-Large-Model/Fast_dLLM_v2_7B")
"""Block-diffusion checkpoints: replaced by the embedded toy block model's folder."""
SHELLS = ("bash", "sh", "shell", "console")
EXPECTED_WARNINGS = ("max_position_embeddings", "`gradient_checkpointing` is deprecated",
                     "`is_gradient_checkpointing` is deprecated")
"""The toy's 64 positions are fewer than the 8B settings ask for: the sampler says so. Newer transformers (5.24)
deprecate the ``gradient_checkpointing`` argument, which TRL's own ``GRPOConfig`` sets by default (trust_region.md
builds one; our configs pass it under the new name), and the ``is_gradient_checkpointing`` property, which PEFT's
``get_peft_model`` reads (diffusion_gemma.md calls it as a user would; our trainers read it quietly)."""


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, source)`` of every fenced block with a language tag."""
    return re.findall(r"^```(\w+)\n(.*?)^```", path.read_text(), flags=re.M | re.S)


def with_toy_model(text: str, toy: Path | None = None) -> str:
    for name in HUB_MODELS:
        text = text.replace(name, str(toy or toy_assets_dir()))
    for name in BLOCK_HUB_MODELS:
        text = text.replace(name, str(toy_block_assets_dir()))
    return text


def toy_with_positions(folder: Path, positions: int = 1024) -> Path:
    """A copy of the toy whose config allows ``positions`` positions: the README's GSM8K prompts and 256-token
    completions run past the toy's 64, which the trainers refuse (RoPE computes there; the toy learns nothing)."""
    import json
    import shutil

    shutil.copytree(toy_assets_dir(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def shell_commands(text: str) -> list[str]:
    """Commands of a shell text: continuation lines joined, comments dropped, ``&&`` chains split."""
    text = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            commands += [part.strip() for part in line.split("&&")]
    return commands


def ci_commands() -> set[str]:
    return set(shell_commands((ROOT / ".ci" / "run").read_text()))


def is_setup(command: str) -> bool:
    """Building the environment or running the tests: .ci/run does this on every run."""
    words = shlex.split(command)
    return (
        words[:3] == ["python3", "-m", "venv"]
        or words[0] in (".", "source", "deactivate")
        or words[:2] in (["pip", "install"], ["pip", "uninstall"])
        or words[:3] == ["python", "-m", "pytest"]
    )


def offline_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.parametrize("path", [p for p in DOCS if any(lang == "python" for lang, _ in code_blocks(p))],
                         ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path):
    blocks = [source for lang, source in code_blocks(path) if lang == "python"]
    script = tmp_path / f"{path.stem}_blocks.py"
    toy = toy_with_positions(tmp_path / "toy")
    script.write_text("\n\n".join(with_toy_model(block, toy) for block in blocks))
    env = offline_env()  # run from a clone: the blocks may import the repository's tests/tiny_models.py
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    warnings = re.findall(r"^.*\w+Warning: .*$", done.stderr, flags=re.M)
    assert all(any(w in line for w in EXPECTED_WARNINGS) for line in warnings), "\n".join(warnings)


@pytest.mark.parametrize("path", [p for p in DOCS if any(lang in SHELLS for lang, _ in code_blocks(p))],
                         ids=lambda p: p.name)
def test_shell_commands_parse(path):
    commands = [c for lang, source in code_blocks(path) if lang in SHELLS for c in shell_commands(source)]
    setup = [c for c in commands if is_setup(c)]
    assert set(setup) <= ci_commands() | {c for c in setup if c.startswith("pip install -r requirements-cpu.txt")} | {
        "pip uninstall -y torchvision torchaudio torchcodec"}  # the vllm extra's CPU recipe (README)
    for command in (c for c in commands if not is_setup(c)):
        words = shlex.split(with_toy_model(command))
        env = offline_env()
        while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # `NAME=value command ...`
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words[0] in ("python", "python3"):
            arguments = words[1:]
        elif words[:2] == ["accelerate", "launch"]:
            arguments = ["-m", "accelerate.commands.launch", *words[2:]]
        else:
            raise AssertionError(f"{path.name}: teach tests/test_docs.py to check {command!r}")
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_dry_run.py"), *arguments], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "DRY_RUN_PARSED" in done.stdout, f"{command}\n{done.stderr[-3000:]}"
