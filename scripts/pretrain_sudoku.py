"""Pre-train the Sudoku toys (4×4 Sudoku, :mod:`dllm_trl.toy.sudoku`) and write them to the package assets.

    python scripts/pretrain_sudoku.py                        # rewrites src/dllm_trl/assets/sudoku (diffusion)
    python scripts/pretrain_sudoku.py --model-kind causal    # rewrites src/dllm_trl/assets/sudoku_causal
    python scripts/pretrain_sudoku.py --model-kind diffusion_gemma
                                                             # rewrites src/dllm_trl/assets/sudoku_diffusion_gemma
    python scripts/pretrain_sudoku.py --model-kind diffusion_gemma --relabel-fraction 0.5 --target-accuracy 0.6 \
        --threads 1                                          # rewrites .../sudoku_diffusion_gemma_noisy_teacher
    python scripts/pretrain_sudoku.py --relabel-fraction 0.5 --target-accuracy 0.6 --threads 1
                                                             # rewrites src/dllm_trl/assets/sudoku_noisy_teacher
    python scripts/pretrain_sudoku.py --output-dir /tmp/sudoku --target-accuracy 0.5

Diffusion: paper 1 Eq. (2) on the response (grid ⊕ EOS), the prompt never masked. Causal: next-token
cross-entropy on the grid and its EOS. DiffusionGemma: uniform-noise denoising of the response as one canvas, half
the rows self-conditioned (``scripts/toy_pretraining.py``'s uniform_noise_denoising_loss). Deterministic (fixed seeds,
deterministic algorithms, 2 CPU threads), so on the same software stack it reproduces the shipped checkpoints; training stops at the first evaluation whose greedy
validation solve rate reaches --target-accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: scripts/ and tests/tiny_models.py

from scripts.toy_pretraining import SudokuPretrainConfig, pretrain_sudoku, pretraining_cli  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "src" / "dllm_trl" / "assets"


def default_output(config: SudokuPretrainConfig) -> Path:
    if config.model_kind == "diffusion_gemma":
        return ASSETS / ("sudoku_diffusion_gemma_noisy_teacher" if config.relabel_fraction > 0
                         else "sudoku_diffusion_gemma")
    if config.model_kind == "causal":
        if config.relabel_fraction > 0:  # no shipped causal noisy-teacher checkpoint to rewrite
            raise SystemExit("a causal noisy-teacher toy is not shipped: pass --output-dir for it.")
        return ASSETS / "sudoku_causal"
    return ASSETS / ("sudoku_noisy_teacher" if config.relabel_fraction > 0 else "sudoku")


if __name__ == "__main__":
    pretraining_cli(__doc__, SudokuPretrainConfig, pretrain_sudoku, default_output)
