"""Training settings of the toys: the example scripts' no-argument run, and RLDF settings that improve the addition and
Sudoku toys on CPU (the main job's, the estimator and trust-region benchmarks')."""

from __future__ import annotations

import os

import torch

from .model import sudoku_generation_config, toy_generation_config

TOY_TRAINING_DEFAULTS = dict(
    max_steps=2, max_completion_length=8, block_length=4, per_device_train_batch_size=4, num_generations=4,
    num_sampled_timesteps=4, learning_rate=1e-4, beta=0.01, temperature=1.0, logging_steps=1, report_to="none",
)
"""Training arguments of the scripts' no-argument run: two RLDF steps of the toy model on CPU. Saving is TRL's
default: checkpoints every ``save_steps`` and at the last step, and the final model in ``output_dir``."""


def toy_training_defaults(output_dir: str, **overrides) -> dict:
    """:data:`TOY_TRAINING_DEFAULTS` for a script writing to ``output_dir``: bf16 where the GPU has it natively, or
    where the accelerate config asks for it (a DeepSpeed config's bf16 must agree with the training arguments')."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    native_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    bf16 = launcher == "bf16" if launcher else native_bf16
    return {**TOY_TRAINING_DEFAULTS, "output_dir": output_dir, "bf16": bf16, **overrides}


def toy_rldf_config(output_dir: str, **overrides):
    """RLDF settings that improve the toy model on CPU (the estimator benchmark's):
    the toy sampler settings, 4 prompts x 8 generations per step, k = 4, β = 0, constant lr 3e-5."""
    from ..trainers import RLDFConfig  # imports TRL's trainers and PEFT: only for the scripts that train

    gen = toy_generation_config()
    values = dict(
        output_dir=output_dir, max_completion_length=gen.gen_length, block_length=gen.block_length,
        unmasking_threshold=gen.threshold, cache_mode="dual", temperature=1.0, num_generations=8,
        per_device_train_batch_size=32, num_sampled_timesteps=4, beta=0.0, learning_rate=3e-5,
        lr_scheduler_type="constant", max_steps=60, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False,
    )
    values.update(overrides)
    return RLDFConfig(**values)


def sudoku_rldf_settings(output_dir: str, **overrides) -> dict:
    """The keyword arguments of :func:`sudoku_rldf_config` (for a parser's defaults: the main job's)."""
    gen = sudoku_generation_config()
    values = dict(
        output_dir=output_dir, max_completion_length=gen.gen_length, block_length=gen.block_length,
        unmasking=gen.unmasking, diffusion_steps=gen.steps, cache_mode="dual", temperature=1.0, num_generations=8,
        per_device_train_batch_size=32, num_sampled_timesteps=4, beta=0.0, learning_rate=1e-4,
        lr_scheduler_type="constant", max_steps=150, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, dataloader_pin_memory=False,
    )
    values.update(overrides)
    return values


def sudoku_rldf_config(output_dir: str, *, config_class=None, **overrides):
    """RLDF settings of the main job on the Sudoku toy (and the base of the Sudoku benchmarks): the toy's sampler
    (20 positions in one block, one cell per step, dual cache) at temperature 1, 4 puzzles x 8 generations per step,
    k = 4, β = 0, constant learning rate (see docs/main_job.md for the sweep).

    ``config_class`` is :class:`~dllm_trl.trainers.RLDFConfig` by default; a subclass (``DPPOMaskConfig``) takes the
    same settings plus its own fields from ``overrides``."""
    from ..trainers import RLDFConfig

    return (config_class or RLDFConfig)(**sudoku_rldf_settings(output_dir, **overrides))


def sudoku_diffusion_gemma_rldf_settings(output_dir: str, **overrides) -> dict:
    """The keyword arguments of :func:`sudoku_diffusion_gemma_rldf_config`."""
    from .model import SUDOKU_GEN_LENGTH

    values = dict(
        output_dir=output_dir, max_completion_length=SUDOKU_GEN_LENGTH, block_length=SUDOKU_GEN_LENGTH,
        num_generations=8, per_device_train_batch_size=32, num_sampled_timesteps=4, beta=0.0, learning_rate=1e-4,
        lr_scheduler_type="constant", max_steps=100, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, dataloader_pin_memory=False,
    )
    values.update(overrides)
    return values


def sudoku_diffusion_gemma_rldf_config(output_dir: str, *, config_class=None, **overrides):
    """RLDF settings for the DiffusionGemma Sudoku toy (``load_sudoku_diffusion_gemma``): one canvas of 20 tokens (so
    ``block_length`` = ``max_completion_length`` = 20, the canvas), 4 puzzles × 8 rollouts per step with the toy's
    sampler (:func:`~dllm_trl.toy.sudoku_diffusion_gemma_sampler_config`), k = 4 of each rollout's recorded steps,
    β = 0, constant learning rate. Train with ``sampler=DiffusionGemmaSampler(sudoku_diffusion_gemma_sampler_config())``
    and ``loss=DiffusionGemmaRLDFLoss(args)`` (docs/diffusion_gemma.md).

    ``config_class``: :class:`~dllm_trl.trainers.RLDFConfig` by default, or ``DPPOMaskConfig`` for the trust-region
    loss (``DiffusionGemmaTrustRegionLoss``)."""
    from ..trainers import RLDFConfig

    return (config_class or RLDFConfig)(**sudoku_diffusion_gemma_rldf_settings(output_dir, **overrides))
