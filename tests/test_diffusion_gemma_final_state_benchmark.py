"""benchmarks/diffusion_gemma_final_state.py: its exact reference and the trainer's sampled-steps arm agree when every
recorded step is sampled, and RLDF's clean targets add to the exact targets only where the policy is sure."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "diffusion_gemma_final_state.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("diffusion_gemma_final_state_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_recorded_step_sampled_is_the_exact_gradient(bench):
    # Seed 0's two puzzles × 4 rollouts: rewards differ within a group, so the gradients are not zero.
    args = bench.parse_args(["--seeds", "0", "--puzzles", "2", "--generations", "4", "--recorded-k", "100",
                             "--states", "1"])
    model, tokenizer = bench.load_toy(args)
    result = bench.run_seed(model, tokenizer, args, 0)
    assert result["cosine"]["recorded k=100"] == pytest.approx(1.0, abs=1e-4)  # float32 cosine
    assert -1.0 <= result["cosine"]["final-state k=1"] <= 1.0 and result["self_cosine"] > 0


def test_clean_targets_join_the_accepted_ones_where_the_policy_is_sure(bench):
    from dllm_trl.toy import sudoku_dataset

    model, tokenizer = bench.load_toy(bench.parse_args([]))
    data = sudoku_dataset("train").select(range(1))
    prompt_ids, prompt_mask, output, _, _, advantages = bench.rollout_batch(model, tokenizer, data, 3,
                                                                            torch.Generator().manual_seed(0))
    steps = output.denoising_steps.active
    with torch.no_grad():
        exact, exact_count = bench.recorded_term(model, prompt_ids, prompt_mask, output, steps, advantages)
        never, never_count = bench.recorded_term(model, prompt_ids, prompt_mask, output, steps, advantages, 1.1)
        _, all_count = bench.recorded_term(model, prompt_ids, prompt_mask, output, steps, advantages, 0.0)
        _, some_count = bench.recorded_term(model, prompt_ids, prompt_mask, output, steps, advantages, 0.5)
    assert torch.equal(exact, never) and exact_count == never_count
    record = output.denoising_steps
    rows, slots = steps.nonzero(as_tuple=True)
    valid = output.completion_mask.bool()[rows]  # one canvas: the completion is the canvas
    assert all_count == (record.accept_mask[rows, slots] | valid).sum()
    assert exact_count < some_count < all_count
