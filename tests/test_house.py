"""The house (docs/architecture.md): the import graph of ``src/dllm_trl`` and of ``benchmarks/`` has no circle, and no
arrow runs back up the package's layers. Read from the source with :mod:`ast`, every import counted (module level,
function-local and relative), except those under ``if TYPE_CHECKING:``, which never run.

``python tests/test_house.py`` prints the counts (modules, rooms, circles, upward arrows, lines).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dllm_trl"

# The package's layers, lowest first: a module may import its own layer and the layers below it, never one above.
# A room is a subpackage or a top-level module; a few modules sit above their room's layer: the command lines.
LAYERS: list[tuple[str, ...]] = [
    ("dllm_trl", "dllm_trl._console", "dllm_trl._lazy"),  # the lazy package root and its plumbing
    ("dllm_trl.models",),  # checkpoint -> transformers model; scoring forwards
    ("dllm_trl.generation",),  # model + prompts -> completions and their trajectory
    ("dllm_trl.losses",),  # trajectory -> loss terms (tensor in, tensor out, and the loss objects)
    ("dllm_trl.rewards", "dllm_trl.data"),  # completions -> rewards; datasets -> prompts + reward columns
    ("dllm_trl.families",),  # the model-family registry: checkpoint loading and each family's sampler and losses
    ("dllm_trl.trainers", "dllm_trl.callbacks", "dllm_trl.prechecks"),  # the GRPOTrainer glue
    ("dllm_trl.evaluation",),  # accuracy grids, reports
    ("dllm_trl.toy",),  # the shipped demo models and tasks
    # the command lines: the only modules that may import the demo package (its checkpoint as the default model)
    ("dllm_trl.__main__", "dllm_trl.evaluation.__main__", "dllm_trl.evaluation.cli", "dllm_trl.evaluation.lm_eval",
     "dllm_trl.toy.__main__"),
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``src/package`` (a package is named by its __init__)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute dotted names that ``module``'s source imports (``from a import b`` gives ``a.b``), anywhere in it but
    under ``if TYPE_CHECKING:``."""
    names: list[str] = []
    here = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            names.extend(f"{origin}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph(modules: dict[str, Path], package_dirs: set[str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (a name resolves to its longest module prefix)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def layer_of(module: str) -> int | None:
    """The layer of ``module``: its own entry in :data:`LAYERS`, else its nearest listed room (not the bare root)."""
    name = module
    while name:
        if name in LAYER and (name == module or name != PACKAGE):
            return LAYER[name]
        name = name.rpartition(".")[0]
    return None


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer into a higher one."""
    placed = [(a, b) for a, targets in graph.items() for b in targets if None not in (layer_of(a), layer_of(b))]
    return sorted((a, b) for a, b in placed if layer_of(a) < layer_of(b))


def benchmark_graph(folder: Path) -> dict[str, set[str]]:
    """The benchmark scripts import each other by bare name (they run with ``benchmarks/`` on the path)."""
    modules = {path.stem: path for path in sorted(folder.glob("*.py"))}
    return import_graph(modules)


def house_counts() -> dict[str, int]:
    modules = module_files(ROOT / "src", PACKAGE)
    graph = import_graph(modules)
    bench = benchmark_graph(ROOT / "benchmarks")
    rooms = {module.split(".")[1] if "." in module else module for module in modules}
    return {
        "modules": len(modules),
        "modules in no layer": sum(layer_of(m) is None for m in modules),
        "rooms": len(rooms),
        "import circles (package)": len(circles(graph)),
        "upward arrows": len(upward_arrows(graph)),
        "import circles (benchmarks)": len(circles(bench)),
        "lines of src/dllm_trl": sum(len(path.read_text().splitlines()) for path in modules.values()),
    }


# -- the checks ---------------------------------------------------------------------------------------------------


def test_every_module_has_a_layer():
    unplaced = [m for m in module_files(ROOT / "src", PACKAGE) if layer_of(m) is None]
    assert not unplaced, f"modules in no layer of tests/test_house.py's LAYERS: {unplaced} (place their room there)"


def test_no_import_circle_in_the_package():
    assert circles(import_graph(module_files(ROOT / "src", PACKAGE))) == []


def test_no_import_runs_back_up_the_layers():
    arrows = upward_arrows(import_graph(module_files(ROOT / "src", PACKAGE)))
    assert arrows == [], "imports into a higher layer (tests/test_house.py LAYERS): " + ", ".join(
        f"{a} -> {b}" for a, b in arrows)


def test_no_import_circle_in_the_benchmarks():
    assert circles(benchmark_graph(ROOT / "benchmarks")) == []


def test_the_checks_find_a_planted_circle_and_arrow(tmp_path):
    """The reader sees relative, function-local and aliased imports, skips TYPE_CHECKING, and both checks fire."""
    pkg = tmp_path / PACKAGE
    for folder in (pkg, pkg / "models", pkg / "generation"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("def f():\n    from ..generation import b as _b\n")
    (pkg / "generation" / "b.py").write_text("from dllm_trl.models.a import f\n")
    (pkg / "generation" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..toy import x\nelse:\n    from . import b\n")
    graph = import_graph(module_files(tmp_path, PACKAGE))
    assert graph["dllm_trl.models.a"] == {"dllm_trl.generation.b"}
    assert graph["dllm_trl.generation.c"] == {"dllm_trl.generation.b"}
    assert circles(graph) == [["dllm_trl.generation.b", "dllm_trl.models.a"]]
    assert upward_arrows(graph) == [("dllm_trl.models.a", "dllm_trl.generation.b")]


if __name__ == "__main__":
    for key, value in house_counts().items():
        print(f"{key}: {value}")
    graph = import_graph(module_files(ROOT / "src", PACKAGE))
    for circle in circles(graph) + circles(benchmark_graph(ROOT / "benchmarks")):
        print("circle:", " <-> ".join(circle))
    for a, b in upward_arrows(graph):
        print("upward:", a, "->", b)
    sys.exit(0)
