"""Wall time of the main job (``python -m dllm_trl``, evaluation skipped) alone and beside a CPU-bound process, with
torch's default thread count (every core) and with the job's default (:func:`dllm_trl.__main__.fair_threads`), in one
run on the same machine.

    python benchmarks/main_job_threads.py --steps 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time


def burn(stop_at: float) -> None:
    """A CPU-bound process: pure-Python arithmetic until ``stop_at``."""
    x = 0
    while time.time() < stop_at:
        for i in range(100_000):
            x += i * i


def job_seconds(steps: int, threads: int | None, env: dict) -> float:
    flags = ["--max_steps", str(steps), "--skip_eval", "--output_dir", tempfile.mkdtemp()]
    if threads is not None:
        flags += ["--threads", str(threads)]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dllm_trl", *flags], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = len(os.sched_getaffinity(0))
    rows = []
    for beside in (False, True):
        for label, threads in ((f"torch default ({cores} threads)", cores), ("job default (fair_threads)", None)):
            burner = None
            if beside:
                burner = multiprocessing.Process(target=burn, args=(time.time() + 3600,))
                burner.start()
                time.sleep(65)  # the 1-minute load average sees it
            try:
                seconds = job_seconds(args.steps, threads, env)
            finally:
                if burner is not None:
                    burner.terminate()
                    burner.join()
            rows.append((("beside a CPU-bound process" if beside else "alone"), label, seconds))
            print(rows[-1], flush=True)
    print(f"\n| load | threads | wall time of {args.steps} steps + start-up (s) |\n|---|---|---|")
    for where, label, seconds in rows:
        print(f"| {where} | {label} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
