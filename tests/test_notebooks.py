"""notebooks/: both are valid notebooks; the quickstart executes on CPU with tiny settings; the Colab notebook's
imports resolve, its calls use keyword arguments that exist, its install cell picks the right source, and its
cells up to the first one tagged ``gpu`` execute on CPU."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
QUICKSTART = NOTEBOOKS / "quickstart.ipynb"
COLAB = NOTEBOOKS / "llada_8b_qlora_colab.ipynb"
FIND_SPEC = importlib.util.find_spec


def code_cells(notebook) -> list[str]:
    """Code cells as Python: IPython magics and shell escapes (``%pip``, ``!ls``) become ``pass``."""
    return [re.sub(r"(?m)^(\s*)[%!].*$", r"\1pass", cell.source) for cell in notebook.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("path", [QUICKSTART, COLAB], ids=lambda p: p.name)
def test_valid_notebook(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    for source in code_cells(notebook):
        ast.parse(source)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "commit without outputs"


def test_colab_imports_resolve_and_calls_use_existing_keywords():
    trees = [ast.parse(source) for source in code_cells(nbformat.read(COLAB, as_version=4))]
    namespace: dict = {}
    imports = [node for tree in trees for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports
    for node in imports:
        exec(compile(ast.Module([node], type_ignores=[]), str(COLAB), "exec"), namespace)
        if isinstance(node, ast.ImportFrom) and node.module.startswith("dllm_trl"):
            assert not any(part.startswith("_") for part in node.module.split(".")), "public API only"
            assert all(not alias.name.startswith("_") for alias in node.names), "public API only"
    used = ("RLDFConfig", "RLDFTrainer", "load_diffusion_model", "load_task_dataset", "evaluate_model", "math_reward")
    assert set(used) <= set(namespace)
    checked = 0
    for tree in trees:
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            target = namespace.get(call.func.id)
            if target is None or not callable(target):
                continue
            keywords = {k.arg: None for k in call.keywords if k.arg is not None}
            inspect.signature(target).bind_partial(**keywords)  # TypeError on a misspelt keyword
            checked += 1
    assert checked >= 6


def execute(notebook, cwd: Path, monkeypatch) -> tuple[str, list]:
    """Run ``notebook`` in a kernel working in ``cwd``, offline; returns its printed text and all outputs."""
    from nbclient import NotebookClient

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits the environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resources = {"metadata": {"path": str(cwd)}}  # the working directory of the kernel
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"], [o for o in outputs if o.output_type == "error"]
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream"), outputs


def test_quickstart_executes(tmp_path, monkeypatch):
    notebook = nbformat.read(QUICKSTART, as_version=4)
    parameters = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameters) == 1 and "MAX_STEPS" in parameters[0].source
    parameters[0].source = "MAX_STEPS = 3\nEVAL_SIZE = 32"
    text, outputs = execute(notebook, tmp_path, monkeypatch)
    assert "step 0: ________" in text and re.search(r"accuracy \d\.\d+ -> \d\.\d+ after 3 RLDF steps", text)
    assert any("image/png" in o.get("data", {}) for o in outputs), "the reward plot"


def test_colab_cells_before_the_first_gpu_cell_run_on_cpu(monkeypatch):
    notebook = nbformat.read(COLAB, as_version=4)
    first_gpu = next(i for i, cell in enumerate(notebook.cells) if "gpu" in cell.metadata.get("tags", []))
    assert first_gpu >= 3 and "torch.cuda" in notebook.cells[first_gpu].source
    notebook.cells = notebook.cells[:first_gpu]
    text, _ = execute(notebook, NOTEBOOKS, monkeypatch)  # from the clone, where dllm-trl is installed already
    assert re.search(r"dllm-trl \S+ from .*dllm_trl", text)


def run_install_cell(monkeypatch, cwd: Path, dllm_trl_value: str = "", installed: bool = False) -> list:
    """Execute the Colab install cell in ``cwd``; returns the pip commands it ran (pip itself is not run)."""
    cell = next(c.source for c in nbformat.read(COLAB, as_version=4).cells if 'DLLM_TRL = ""' in c.source)
    cell = cell.replace('DLLM_TRL = ""', f"DLLM_TRL = {dllm_trl_value!r}")
    def find_spec(name, *args):
        return None if name == "dllm_trl" and not installed else FIND_SPEC(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    commands = []
    monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command))
    monkeypatch.chdir(cwd)
    exec(compile(cell, "install cell", "exec"), {})
    return commands


def test_colab_install_cell(monkeypatch, tmp_path):
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    assert run_install_cell(monkeypatch, NOTEBOOKS) == [pip + ["-e", str(NOTEBOOKS.parent)]]  # from a clone
    url = "git+https://example.org/dllm-trl.git"
    assert run_install_cell(monkeypatch, tmp_path, dllm_trl_value=url) == [pip + [url]]
    assert run_install_cell(monkeypatch, tmp_path, installed=True) == []
    with pytest.raises(SystemExit) as exit_info:
        run_install_cell(monkeypatch, tmp_path)
    message = str(exit_info.value)
    assert message.count(". ") == 0 and message.endswith(".") and "DLLM_TRL" in message, message


def test_colab_states_runtime_and_memory_per_gpu():
    intro = nbformat.read(COLAB, as_version=4).cells[0].source
    rows = [line for line in intro.splitlines() if re.match(r"\| (T4|L4|A100|H100)", line)]
    assert len(rows) == 4 and all(line.count("|") == 5 for line in rows)
    assert "GPU-SUITE" in intro  # where the measured figures go
