"""Every engine on the CPU toy, side by side in one run: does it train, does it agree with DDP, what a step costs.

Each row is a real ``accelerate launch`` with 2 processes on CPU (gloo; DeepSpeed with ``DS_ACCELERATOR=cpu``; FSDP2
through the CPU state set-up of ``tests/distributed_rldf.py``) of the same tiny LLaDA checkpoint, seeds and data,
in float32, for ``--steps`` RLDF steps (k = 4 sampled steps, β = 0.01). Columns: seconds per optimizer step (median
over the steps after the first), the Python-level torch.distributed collectives per step (calls and MiB; DeepSpeed
reduces gradients through them, DDP and FSDP2 in C++, so their gradient traffic is not in this count), peak RSS of
a process, and the largest parameter difference to the DDP run::

    python benchmarks/engines.py            # all rows, ~10 minutes on 2 loaded cores
    python benchmarks/engines.py --only ddp zero2-per_step zero2-per_micro_batch
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "distributed_rldf.py"
CONFIGS = ROOT / "examples" / "accelerate_configs"

ROWS = {
    "ddp": ("multi_gpu", ["backward_mode=per_step"]),
    "ddp-per_micro_batch": ("multi_gpu", ["backward_mode=per_micro_batch"]),
    "zero2-per_step": ("deepspeed_zero2", ["backward_mode=per_step"]),
    "zero2-per_micro_batch": ("deepspeed_zero2", ["backward_mode=per_micro_batch"]),
    "zero3-per_step": ("deepspeed_zero3", ["backward_mode=per_step"]),
    "zero3-per_micro_batch": ("deepspeed_zero3", ["backward_mode=per_micro_batch"]),
    "fsdp2-per_step": ("fsdp", ["backward_mode=per_step", "fsdp_on_cpu=1"]),
    "fsdp2-per_micro_batch": ("fsdp", ["backward_mode=per_micro_batch", "fsdp_on_cpu=1"]),
}


def write_checkpoint(folder: Path) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import make_char_tokenizer
    from tests.test_models import llada_raw_config, llada_weights
    from tests.test_models import write_checkpoint as write

    tokenizer = make_char_tokenizer()
    raw = llada_raw_config(
        embedding_size=len(tokenizer), vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, d_model=32, mlp_hidden_size=64,
    )
    return write(folder / "llada", raw, llada_weights(raw, seed=0))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(name: str, checkpoint: str, folder: Path, steps: int) -> dict:
    config, options = ROWS[name]
    out = folder / name
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
               DS_ACCELERATOR="cpu")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{config}.yaml"),
               "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
               str(HARNESS), str(out), f"model={checkpoint}",
               f"steps={steps}", "count_comm=1", *options]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line]
        return {"error": errors[-1] if errors else f"exit code {done.returncode}"}
    return torch.load(out / "result.pt")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="*", choices=list(ROWS), default=list(ROWS))
    args = parser.parse_args()
    names = ["ddp"] + [n for n in args.only if n != "ddp"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checkpoint = write_checkpoint(folder)
        results = {}
        for name in names:
            results[name] = run(name, checkpoint, folder, args.steps)
            print(f"{name}: {'failed: ' + results[name]['error'] if 'error' in results[name] else 'ok'}", flush=True)
    reference = results["ddp"]["params"]
    print(f"\n{args.steps} RLDF steps, 2 CPU processes, tiny LLaDA (float32)\n")
    print("| engine | trains | max abs Δθ vs DDP | s/step | collectives/step | MiB/step | peak RSS MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        r = results[name]
        if "error" in r:
            print(f"| {name} | **no**: {r['error'][:80]} | | | | | |")
            continue
        delta = max((r["params"][k] - v).abs().max().item() for k, v in reference.items())
        later = r["collectives_per_step"][1:] or r["collectives_per_step"]
        calls = statistics.median(c for c, _ in later)
        mib = statistics.median(b for _, b in later) / 2**20
        seconds = statistics.median(t for t in r["step_time"][1:] if t is not None)
        print(f"| {name} | yes | {delta:.1e} | {seconds:.2f} | {calls:.0f} | {mib:.2f} | {r['peak_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
