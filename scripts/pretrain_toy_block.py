"""Pre-train the toy block-diffusion model (SDAR layout, blocks of 4) and write it to the package assets.

    python scripts/pretrain_toy_block.py                  # rewrites src/dllm_trl/assets/toy_block (the shipped checkpoint)
    python scripts/pretrain_toy_block.py --output-dir /tmp/toy_block --target-accuracy 0.5

Deterministic: fixed seeds, deterministic algorithms and 2 CPU threads, so on the same software stack it
reproduces the shipped checkpoint. Training stops at the first evaluation whose greedy held-out accuracy
reaches --target-accuracy.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import torch

from dllm_trl.toy.block import ToyBlockPretrainConfig, pretrain_toy_block

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "src" / "dllm_trl" / "assets" / "toy_block"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results depend on it)")
    for f in fields(ToyBlockPretrainConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ToyBlockPretrainConfig(**{f.name: getattr(args, f.name) for f in fields(ToyBlockPretrainConfig)})
    summary = pretrain_toy_block(args.output_dir, config)
    size = sum(p.stat().st_size for p in args.output_dir.glob("*.safetensors")) / 2**20
    print(
        f"saved {args.output_dir} ({size:.2f} MB of weights) after {summary['steps']} steps in "
        f"{summary['seconds']:.0f} s; held-out greedy accuracy {summary['test_accuracy']:.3f}"
    )


if __name__ == "__main__":
    main()
