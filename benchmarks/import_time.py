"""Import time of dllm_trl's entry points, cold and warm, and which heavy libraries each one pulls in.

Each measurement is a fresh interpreter running ``import <module>`` (wall time of the import statement only).

* warm: the files are in the page cache (the median of ``--repeats`` runs after one discarded run);
* cold: before the run, every file of this interpreter's ``site-packages`` and of the ``dllm_trl`` package is
  dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed), so the import reads
  them from disk as after a reboot. Linux only; other systems report warm figures only.

::

    python benchmarks/import_time.py
    python benchmarks/import_time.py --modules dllm_trl.generation --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

HEAVY = ("trl", "peft", "bitsandbytes", "datasets", "accelerate", "transformers", "torch")
MODULES = ("dllm_trl", "dllm_trl.generation", "dllm_trl.models", "dllm_trl.toy", "dllm_trl.trainers")

PROBE = """
import sys, time
start = time.perf_counter()
import {module}
seconds = time.perf_counter() - start
heavy = [name for name in {heavy!r} if name in sys.modules]
print(f"{{seconds:.4f}} {{','.join(heavy)}}")
"""


def package_roots() -> list[Path]:
    """site-packages and the dllm_trl package folder (found without importing it)."""
    package = importlib.util.find_spec("dllm_trl").submodule_search_locations[0]
    return [Path(sysconfig.get_paths()["purelib"]), Path(package)]


def drop_page_cache(roots: list[Path]) -> bool:
    """Ask the kernel to forget the cached pages of every file under ``roots``; False if unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for root in roots:
        for directory, _, files in os.walk(root):
            for name in files:
                try:
                    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return True


def import_once(module: str) -> tuple[float, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, heavy=HEAVY)],
        capture_output=True, text=True, env=env, check=True,
    )
    seconds, _, heavy = done.stdout.strip().splitlines()[-1].partition(" ")
    return float(seconds), [h for h in heavy.split(",") if h]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", default=list(MODULES))
    parser.add_argument("--repeats", type=int, default=3, help="warm runs per module (median reported)")
    args = parser.parse_args(argv)

    roots = package_roots()
    print("| module | cold (s) | warm (s, median) | heavy libraries imported |")
    print("|---|---:|---:|---|")
    for module in args.modules:
        cold = f"{import_once(module)[0]:.2f}" if drop_page_cache(roots) else "n/a"
        import_once(module)  # discarded: refills the page cache
        warm = [import_once(module) for _ in range(args.repeats)]
        heavy = warm[-1][1]
        print(f"| `{module}` | {cold} | {statistics.median(s for s, _ in warm):.2f} | {', '.join(heavy) or '—'} |")


if __name__ == "__main__":
    main()
