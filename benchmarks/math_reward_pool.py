"""Throughput of the math reward's worker pool: answer pairs per second through the structural / sympy stage.

    python benchmarks/math_reward_pool.py                                  # this checkout's pool
    git worktree add --detach /tmp/main-rewards main
    python benchmarks/math_reward_pool.py --baseline /tmp/main-rewards     # and another checkout's, same run
    python benchmarks/math_reward_pool.py --pebble       # and a pebble ProcessPool (needs: pip install pebble)
    python benchmarks/math_reward_pool.py --reward --baseline /tmp/main-rewards   # math_reward itself, both checkouts

``--reward`` measures ``math_reward`` end to end (extraction, the worker's cleanup and comparison) on the answer
table's rows as written (``\\boxed{pred}`` completions against their golds, cycled to ``--pairs``; no slow or
pathological pairs), two ways: one pair per call (``math_reward([c], [g])`` in a loop, as a per-sample scorer does)
and batched (one ``math_reward`` call for all pairs: ``--workers`` threads and worker processes). Each is
reported in pairs per second, best round.

The pairs are the rows of ``tests/math_answer_table.py`` that reach the worker (their normalised strings differ),
cycled to ``--pairs``, with ``--slow`` slow-but-finishing sympy comparisons (polynomial expansion, nested
radicals: 0.1-0.5 s each) and ``--timeouts`` pathological ones (``9^{9^{9^9}}``, stopped by the time bound after
``--timeout`` s) spread through the batch. They go through a thread pool of ``--workers`` threads,
as ``math_reward`` sends them, to ``--workers`` worker processes. Every pool is started and warmed (workers
running, sympy imported) before its clock starts; the pools (and the baseline checkout's, in a subprocess) are
measured one after the other, ``--rounds`` times in alternation, and the best round of each is reported with the
number of pairs on which a pool's answers differ from the first one's.

``--pebble`` runs the same comparison (``_math_worker.heavy_equal`` in the worker's main thread, per-task timeout
``timeout + 1``) on ``pebble.ProcessPool`` with the multiprocessing start method ``--pebble-context``. The worker
processes' resident memory is reported too (``--parent-torch`` imports torch in this process first, as a
trainer has: a forked worker then carries it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))

SLOW = [
    (r"(x+1)^{12}", r"x^{12}+12x^{11}+66x^{10}+220x^{9}+495x^{8}+792x^{7}+924x^{6}+792x^{5}+495x^{4}+220x^{3}"
                    r"+66x^{2}+12x+1"),
    (r"\sqrt{2}+\sqrt{3}+\sqrt{5}", r"\sqrt{10+2\sqrt{6}+2\sqrt{10}+2\sqrt{15}}"),
    (r"(x+y)^{8}-(x-y)^{8}", r"16x^7y+112x^5y^3+112x^3y^5+16xy^7"),
    (r"\cos\frac{\pi}{7}-\cos\frac{2\pi}{7}+\cos\frac{3\pi}{7}", r"\frac12"),
]
TIMES_OUT = (r"9^{9^{9^{9}}}", "1")


def _table_rows():
    path = os.path.join(HERE, "..", "tests", "math_answer_table.py")
    spec = importlib.util.spec_from_file_location("math_answer_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MATH_TABLE


def make_pairs(n_pairs: int, n_slow: int, n_timeouts: int, seed: int = 0) -> list[tuple[str, str]]:
    from dllm_trl.rewards.math import extract_gold_answer, normalize_math_answer

    heavy = []
    for pred, gold, _, _ in _table_rows():
        g = extract_gold_answer(gold)
        a, b = normalize_math_answer(pred), normalize_math_answer(g) if g is not None else ""
        if a and b and a != b:
            heavy.append((a, b))
    pairs = [heavy[i % len(heavy)] for i in range(n_pairs)]
    extra = [tuple(normalize_math_answer(s) for s in SLOW[i % len(SLOW)]) for i in range(n_slow)]
    extra += [tuple(normalize_math_answer(s) for s in TIMES_OUT)] * n_timeouts
    rng = random.Random(seed)
    for pair in extra:
        pairs.insert(rng.randrange(len(pairs) + 1), pair)
    return pairs


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class HandWritten:
    """The checkout's own pool (``dllm_trl.rewards.math._Pool``)."""

    name = "hand-written pool"

    def __init__(self, workers: int):
        from dllm_trl.rewards import math as m

        self.pool = m._Pool(workers)
        for w in self.pool._all:
            w.ensure_ready()

    def compare(self, pred: str, gold: str, timeout: float) -> tuple[bool, str]:
        return self.pool.compare(pred, gold, timeout)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.pool._all if w.proc is not None]

    def close(self) -> None:
        self.pool.close()


def _pebble_init():
    import resource

    from dllm_trl.rewards import _math_worker

    cap = int(os.environ.get("DLLM_TRL_MATH_WORKER_MEM_BYTES", str(4 << 30)))  # the hand-written worker's cap
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    _math_worker._backends()


def _pebble_probe():
    time.sleep(0.2)  # long enough that the warm-up tasks land on different workers
    return os.getpid(), "torch" in sys.modules


class Pebble:
    """pebble.ProcessPool running the worker's comparison function, per-task timeout = timeout + grace."""

    def __init__(self, workers: int, context: str):
        import multiprocessing

        import pebble

        self.name = f"pebble {pebble.__version__} ProcessPool ({context})"
        self.pool = pebble.ProcessPool(max_workers=workers, initializer=_pebble_init,
                                       context=multiprocessing.get_context(context))
        probes = [self.pool.schedule(_pebble_probe) for _ in range(2 * workers)]
        seen = dict(f.result() for f in probes)
        self.pids = list(seen)
        self.torch_in_worker = any(seen.values())

    def compare(self, pred: str, gold: str, timeout: float) -> tuple[bool, str]:
        from concurrent.futures import TimeoutError as FutureTimeout

        from pebble import ProcessExpired

        from dllm_trl.rewards import _math_worker

        future = self.pool.schedule(_math_worker.heavy_equal, args=(pred, gold, timeout), timeout=timeout + 1.0)
        try:
            return future.result()
        except FutureTimeout:
            return False, "hard-timeout"
        except ProcessExpired:
            return False, "worker-died"

    def worker_pids(self) -> list[int]:
        return self.pids

    def close(self) -> None:
        self.pool.stop()
        self.pool.join()


def measure(pool, pairs, workers: int, timeout: float) -> tuple[float, list[bool]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as ex:
        results = list(ex.map(lambda p: pool.compare(p[0], p[1], timeout)[0], pairs))
    return time.perf_counter() - t0, results


def reward_pairs(n_pairs: int) -> list[tuple[str, str]]:
    """The answer table's rows as written: (completion with the prediction boxed, gold), cycled to ``n_pairs``."""
    rows = [(f"so the answer is $\\boxed{{{p}}}$.", g) for p, g, _, _ in _table_rows()]
    return [rows[i % len(rows)] for i in range(n_pairs)]


def measure_reward(pairs) -> dict:
    """Seconds for ``math_reward`` one pair per call, then batched (workers started and warm before the clock)."""
    from dllm_trl.rewards import math_reward

    math_reward([pairs[0][0]] * 4, [pairs[0][1]] * 4)  # start the worker processes
    t0 = time.perf_counter()
    single = [math_reward([c], [g])[0] for c, g in pairs]
    t1 = time.perf_counter()
    batched = math_reward([c for c, _ in pairs], [g for _, g in pairs])
    t2 = time.perf_counter()
    differ = sum(a != b for a, b in zip(single, batched))
    return {"single": t1 - t0, "batched": t2 - t1, "scores": single, "differ": differ}


def run_here(args, rounds: int) -> dict:
    if args.parent_torch:
        import torch  # noqa: F401

    import dllm_trl

    if args.reward:
        pairs = reward_pairs(args.pairs)
        out = {"source": os.path.dirname(dllm_trl.__file__), "pairs": len(pairs), "reward": {}}
        for _ in range(rounds):
            r = measure_reward(pairs)
            for key in ("single", "batched"):
                out["reward"].setdefault(key, []).append(r[key])
            out["reward"]["scores"], out["reward"]["differ"] = r["scores"], r["differ"]
        return out
    pairs = make_pairs(args.pairs, args.slow, args.timeouts)
    makers = [lambda: HandWritten(args.workers)]
    if args.pebble:
        makers.append(lambda: Pebble(args.workers, args.pebble_context))
    out = {"source": os.path.dirname(dllm_trl.__file__), "pairs": len(pairs), "pools": {}}
    for _ in range(rounds):
        for make in makers:
            t0 = time.perf_counter()
            pool = make()
            start = time.perf_counter() - t0
            try:
                seconds, results = measure(pool, pairs, args.workers, args.timeout)
                rss = [_rss_mb(pid) for pid in pool.worker_pids()]
            finally:
                pool.close()
            entry = out["pools"].setdefault(pool.name, {"seconds": [], "start": [], "results": results})
            entry["seconds"].append(seconds)
            entry["start"].append(start)
            entry["worker_rss_mb"] = rss
            entry["torch_in_worker"] = getattr(pool, "torch_in_worker", None)
    return out


def run_baseline(args) -> dict:
    """One round in a subprocess that imports dllm_trl from ``args.baseline`` (its pool only)."""
    argv = [a for a in sys.argv[1:] if a != "--pebble"]
    i = argv.index("--baseline")
    del argv[i:i + 2]
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.abspath(args.baseline), "src")}
    done = subprocess.run([sys.executable, __file__, *argv, "--rounds", "1", "--json"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _merge(total: dict | None, part: dict) -> dict:
    if total is None:
        return part
    if "reward" in part:
        for key in ("single", "batched"):
            total["reward"][key] += part["reward"][key]
        return total
    for name, e in part["pools"].items():
        for key in ("seconds", "start"):
            total["pools"][name][key] += e[key]
    return total


def report(label: str, out: dict, reference: list[bool] | None) -> list[bool] | None:
    print(f"{label}: dllm_trl from {out['source']}, {out['pairs']} pairs")
    if "reward" in out:
        r = out["reward"]
        for key, what in (("single", "math_reward, one pair per call"), ("batched", "math_reward, one batched call")):
            best = min(r[key])
            print(f"  {what:45s} {out['pairs'] / best:7.1f} pairs/s  (best {best:.2f} s of "
                  f"{', '.join(f'{x:.2f}' for x in r[key])})")
        print(f"  {'':45s} scored 1: {sum(x == 1.0 for x in r['scores'])}; batched differs on {r['differ']} pairs")
        return reference
    for name, e in out["pools"].items():
        best = min(e["seconds"])
        rss = ", ".join(f"{r:.0f}" for r in e["worker_rss_mb"])
        extra = "" if e["torch_in_worker"] is None else f", torch in worker: {e['torch_in_worker']}"
        print(f"  {name:45s} {out['pairs'] / best:7.1f} pairs/s  (best {best:.2f} s of "
              f"{', '.join(f'{s:.2f}' for s in e['seconds'])}; start+warm {min(e['start']):.1f} s; "
              f"worker RSS {rss} MB{extra})")
        if reference is None:
            reference = e["results"]
        else:
            differ = sum(a != b for a, b in zip(reference, e["results"]))
            print(f"  {'':45s} results differ from the first pool's on {differ} pairs")
    return reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=300, help="pairs from the answer table (cycled)")
    ap.add_argument("--slow", type=int, default=6, help="slow sympy comparisons added")
    ap.add_argument("--timeouts", type=int, default=1, help="pathological comparisons added (run into the bound)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds per comparison (the worker's soft bound)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pebble", action="store_true", help="also measure pebble.ProcessPool")
    ap.add_argument("--pebble-context", default="forkserver", choices=["fork", "spawn", "forkserver"])
    ap.add_argument("--parent-torch", action="store_true", help="import torch in this process first (as a trainer)")
    ap.add_argument("--baseline", help="another checkout: its pool is measured in a subprocess, same arguments")
    ap.add_argument("--reward", action="store_true", help="measure math_reward itself: one pair per call, batched")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(run_here(args, args.rounds)))
        return
    baseline = here = None
    for _ in range(args.rounds):  # alternate, so that a busy spell of the machine hits both sides
        if args.baseline:
            baseline = _merge(baseline, run_baseline(args))
        here = _merge(here, run_here(args, 1))
    reference = report("baseline", baseline, None) if baseline else None
    report("this checkout", here, reference)

if __name__ == "__main__":
    main()
