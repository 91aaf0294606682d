"""Every diffusion trainer under every engine, with processes that really differ (issue 43): the shipped Sudoku toy
on 2 CPU processes (gloo; DeepSpeed with ``DS_ACCELERATOR=cpu``), process 0 given prompts it is sure of (its groups
all drop: no loss chunk of its own) and process 1 unsure ones (``tests/distributed_rldf.py``, ``task=sure_unsure``).

Engines: DDP, ZeRO-2, ZeRO-3 with the shipped config (every toy weight under the persistence threshold: nothing is
gathered), ZeRO-3 gathering every weight at every call (``stage3_param_persistence_threshold: 0``, as a real model
is run), FSDP2 (every decoder layer its own unit, the root the rest; FSDP2 has no persistence threshold, so every
weight is gathered at every call). Each row is one real ``accelerate launch``; a run that does not finish within
``--timeout`` seconds is reported as hung. The table gives each process's rollout forwards, its loss chunks and all
its forwards of the policy (rollouts, scoring, loss and idle partners), and the launch's wall seconds::

    python benchmarks/engine_matrix.py [--trainers rldf dppo] [--options num_iterations=2 ...] [--timeout 600]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_distributed import LaunchHung, launch, zero3_gathering_config  # noqa: E402

ENGINES = {
    "DDP": ("multi_gpu", ()),
    "ZeRO-2": ("deepspeed_zero2", ()),
    "ZeRO-3 default": ("deepspeed_zero3", ()),
    "ZeRO-3 gathering": ("gathering", ()),
    "FSDP2": ("fsdp", ("fsdp_on_cpu=1",)),
}
TRAINERS = {"rldf": "RLDFTrainer", "dppo": "DiffusionDPPOMaskTrainer"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", default=sorted(TRAINERS), choices=sorted(TRAINERS))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--options", nargs="*", default=[], help="more key=value options of distributed_rldf.py")
    parser.add_argument("--timeout", type=int, default=600, help="seconds after which a launch counts as hung")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp())
    gathering = zero3_gathering_config(work / "config")
    print(f"Sudoku toy, 2 CPU processes (process 0 sure: groups dropped; process 1 unsure), options: "
          f"{' '.join(args.options) or 'none'}\n")
    print("| trainer | engine | rollout forwards (p0 / p1, per step) | loss chunks (p0 / p1) | all forwards (p0 / p1) "
          "| seconds | result |")
    print("|---|---|---|---|---|---|---|")
    for trainer in args.trainers:
        for engine in args.engines:
            config, extra = ENGINES[engine]
            config = gathering if config == "gathering" else config
            start = time.perf_counter()
            try:
                result = launch(work / f"{trainer}-{engine.replace(' ', '_')}", "task=sure_unsure",
                                f"trainer={trainer}", *args.options, *extra, config=config, timeout=args.timeout)
                verdict = "ok"
            except (LaunchHung, AssertionError) as error:
                result, verdict = None, "hung" if isinstance(error, LaunchHung) else "failed"
            seconds = time.perf_counter() - start
            if result is None:
                print(f"| {TRAINERS[trainer]} | {engine} | – | – | – | {seconds:.0f} | {verdict} |", flush=True)
                continue
            nfe = " / ".join(str(row) for row in result["nfe"])
            chunks = " / ".join(str(row) for row in result["loss_chunks"])
            forwards = " / ".join(str(n) for n in result["forwards"])
            print(f"| {TRAINERS[trainer]} | {engine} | {nfe} | {chunks} | {forwards} | {seconds:.0f} | {verdict} |",
                  flush=True)


if __name__ == "__main__":
    main()
