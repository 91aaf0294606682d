"""What keeping the processes' forwards in step costs (SPEC §9, issue 30): the shipped Sudoku toy on 2 CPU processes,
one with prompts it is sure of (given grids: a few forwards per rollout, its groups drop as zero-variance) and one
with prompts it is unsure of (10–12 blanks: 12–15 forwards), ``batch`` completions per process, dynamic unmasking.

DDP runs the processes apart (its forwards are local); FSDP2 keeps them in step: the sure process runs idle forwards
(one token, no logits read) while the other decodes, and idle loss chunks while the other backpropagates. The table
gives every forward of the policy per process (rollouts, scoring, loss and idle), the rollout seconds, and the ratios
FSDP2 / DDP, from one run of each::

    python benchmarks/lock_step.py [--batch 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_distributed import launch  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="completions per process (one prompt each)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    args = parser.parse_args(argv)
    options = ("task=sure_unsure", f"batch={args.batch}", f"steps={args.steps}")
    runs = {}
    for name, config, extra in (("DDP", "multi_gpu", ()), ("FSDP2", "fsdp", ("fsdp_on_cpu=1",))):
        start = time.perf_counter()
        result = launch(Path(tempfile.mkdtemp()), *options, *extra, config=config, timeout=900)
        runs[name] = (result, time.perf_counter() - start)
    ddp, fsdp = runs["DDP"][0], runs["FSDP2"][0]
    print(f"Sudoku toy, 2 CPU processes, {args.batch} completions per process, {args.steps} steps; "
          "process 0: sure prompts, process 1: unsure ones.\n")
    print("| process | rollout forwards (per step) | loss chunks (per step) | all forwards DDP | all forwards FSDP2 "
          "| idle forwards | rollout s DDP | rollout s FSDP2 |")
    print("|---|---|---|---|---|---|---|---|")
    for p in range(2):
        idle = fsdp["forwards"][p] - ddp["forwards"][p]
        print(f"| {p} | {ddp['nfe'][p]} | {ddp['loss_chunks'][p]} | {ddp['forwards'][p]} | {fsdp['forwards'][p]} "
              f"| {idle} | {ddp['rollout_seconds'][p]:.2f} | {fsdp['rollout_seconds'][p]:.2f} |")
    print(f"\nall forwards, FSDP2 / DDP: {sum(fsdp['forwards']) / sum(ddp['forwards']):.2f}; "
          f"launch-to-exit seconds DDP {runs['DDP'][1]:.1f}, FSDP2 {runs['FSDP2'][1]:.1f}; "
          f"largest |loss FSDP2 − loss DDP| {max(abs(a - b) for a, b in zip(ddp['losses'], fsdp['losses'])):.1e}")


if __name__ == "__main__":
    main()
