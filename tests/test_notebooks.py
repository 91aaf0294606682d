"""notebooks/: both are valid notebooks; the quickstart executes on CPU with tiny settings; the Colab notebook's
imports resolve and its calls use keyword arguments that exist (it needs a GPU, so it is not executed)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
QUICKSTART = NOTEBOOKS / "quickstart.ipynb"
COLAB = NOTEBOOKS / "llada_8b_qlora_colab.ipynb"


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


def test_quickstart_executes(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    notebook = nbformat.read(QUICKSTART, as_version=4)
    parameters = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameters) == 1 and "MAX_STEPS" in parameters[0].source
    parameters[0].source = "MAX_STEPS = 3\nEVAL_SIZE = 32"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits the environment
    resources = {"metadata": {"path": str(tmp_path)}}  # the working directory of the kernel
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "step 0: ________" in text and re.search(r"accuracy \d\.\d+ -> \d\.\d+ after 3 RLDF steps", text)
    assert any("image/png" in o.get("data", {}) for o in outputs), "the reward plot"
