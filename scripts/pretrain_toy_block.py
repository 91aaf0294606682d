"""Pre-train the toy block-diffusion model (SDAR layout, blocks of 4) and write it to the package assets.

    python scripts/pretrain_toy_block.py                  # rewrites src/dllm_trl/assets/toy_block (the shipped checkpoint)
    python scripts/pretrain_toy_block.py --output-dir /tmp/toy_block --target-accuracy 0.5

Deterministic: fixed seeds, deterministic algorithms and 2 CPU threads, so on the same software stack it
reproduces the shipped checkpoint. Training stops at the first evaluation whose greedy held-out accuracy
reaches --target-accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: scripts/ and tests/tiny_models.py

from scripts.toy_pretraining import ToyBlockPretrainConfig, pretrain_toy_block, pretraining_cli  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "src" / "dllm_trl" / "assets" / "toy_block"

if __name__ == "__main__":
    pretraining_cli(__doc__, ToyBlockPretrainConfig, pretrain_toy_block, DEFAULT_OUTPUT)
