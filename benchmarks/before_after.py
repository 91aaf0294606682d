"""Before/after harness: one measurement per fresh Python process, against this checkout's ``dllm_trl`` or
against the code of a baseline commit, so that both sides run the same benchmark code, shapes and seeds in one
run and every figure (peak memory included) comes from a clean process.

A benchmark opts in with a worker entry point that measures one ``spec`` (a dict) and returns a dict::

    from before_after import Side, run_interleaved, worker_main

    def measure(spec): ...                     # runs in the fresh process; imports dllm_trl inside
    if __name__ == "__main__":
        if worker_main(measure):               # `script.py --measure '<json>'`: measure, print, exit
            raise SystemExit
        sides = [Side.baseline("898cab5"), Side.current()]
        results = run_interleaved(__file__, specs, sides, repeats=3)   # {(side.name, i): [result, ...]}

The baseline's ``src/`` is exported once (``git archive``) into the ignored folder ``.bench/<commit>/`` and put
first on the worker's ``PYTHONPATH``; each result records which ``dllm_trl`` it imported and the process's peak
resident set size (``peak_rss_mib``, from ``ru_maxrss``). Repeats are interleaved (every spec and side once,
then again, in rotated order) so that a slow phase of a shared machine hits all of them.
"""

from __future__ import annotations

import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE_COMMIT = "898cab5"
"""main before the in-place KV cache (issue 10)."""
RESULT_PREFIX = "BEFORE_AFTER_RESULT "


@dataclass(frozen=True)
class Side:
    """Which ``dllm_trl`` a worker imports: ``src`` None = this checkout's (whatever is installed)."""

    name: str
    src: Path | None = None

    @classmethod
    def current(cls, name: str = "new") -> Side:
        return cls(name, REPO / "src")

    @classmethod
    def baseline(cls, commit: str = BASELINE_COMMIT, name: str = "main") -> Side:
        return cls(name, export_commit(commit) / "src")


def export_commit(commit: str) -> Path:
    """``src/`` of ``commit`` under ``.bench/<commit>/`` (exported once; the folder is git-ignored)."""
    target = REPO / ".bench" / commit
    if not (target / "src" / "dllm_trl" / "__init__.py").exists():
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", commit, "src"], check=True, capture_output=True
        ).stdout
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
    return target


def worker_main(measure) -> bool:
    """If this process was started as a worker (``--measure '<json>'``), run ``measure(spec)``, print its result
    (plus ``dllm_trl_path`` and ``peak_rss_mib``) and return True."""
    if len(sys.argv) != 3 or sys.argv[1] != "--measure":
        return False
    result = measure(json.loads(sys.argv[2]))
    import dllm_trl

    result["dllm_trl_path"] = str(Path(dllm_trl.__file__).resolve().parent)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return True


def run_worker(script: str | Path, spec: dict, side: Side, timeout: float | None = None) -> dict:
    """Run ``script --measure spec`` in a fresh process importing ``side``'s ``dllm_trl``; its result dict."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if side.src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(side.src), *filter(None, [env.get("PYTHONPATH")])])
    threads = spec.get("threads")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--measure", json.dumps(spec)], env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed ({side.name}, {spec}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    if side.src is not None and Path(result["dllm_trl_path"]) != (side.src / "dllm_trl").resolve():
        raise RuntimeError(f"side {side.name} imported {result['dllm_trl_path']}, not {side.src}")
    result["process_seconds"] = time.perf_counter() - started
    return result


def run_interleaved(script, specs: list[dict], sides: list[Side], repeats: int = 3, timeout: float | None = None,
                    save: Path | None = None, log=print) -> dict[tuple[str, int], list[dict]]:
    """Every (spec, side) ``repeats`` times, interleaved; results keyed by ``(side.name, spec index)``.

    With ``save``, results already in that JSON-lines file are reused and each new one is appended as it
    arrives, so a long run that is stopped resumes where it was."""
    jobs = [(side, index) for index in range(len(specs)) for side in sides]
    results: dict[tuple[str, int], list[dict]] = {(side.name, index): [] for side, index in jobs}
    if save is not None and Path(save).exists():
        for line in Path(save).read_text().splitlines():
            record = json.loads(line)
            if record["spec"] in specs and (record["side"], specs.index(record["spec"])) in results:
                results[(record["side"], specs.index(record["spec"]))].append(record["result"])
    for repeat in range(repeats):
        shift = repeat % len(jobs)
        for side, index in jobs[shift:] + jobs[:shift]:
            if len(results[(side.name, index)]) > repeat:
                continue
            result = run_worker(script, specs[index], side, timeout)
            results[(side.name, index)].append(result)
            if save is not None:
                with open(save, "a") as file:
                    file.write(json.dumps({"side": side.name, "spec": specs[index], "result": result}) + "\n")
            if log is not None:
                figures = {k: round(v, 3) for k, v in result.items() if isinstance(v, (int, float))}
                log(f"[{repeat + 1}/{repeats}] {side.name} batch {specs[index].get('batch')} {specs[index].get('cache')}"
                    f" -> {figures}  load {os.getloadavg()[0]:.1f}")
    return results


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)
