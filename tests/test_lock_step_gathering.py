"""Lock-step under ZeRO-3 as a real model meets it (issue 43): 2 CPU processes that really differ, launched for real
(see test_distributed.py). ZeRO-3 gathers a weight at each call of its module only when the weight is above
``stage3_param_persistence_threshold`` (1e5 elements by default, above every toy weight); ``zero3_gathering_config``
sets it to 0, so that every call gathers, as a real model's do. A process with less to do (its groups dropped, fewer
decoding steps) partners the busier one's calls with the same code on a stand-in input (SPEC §9): were the module
calls or their order to differ, ZeRO-3's gathers and trace checks would wait on each other forever, which here is
reported as :class:`~tests.test_distributed.LaunchHung` after a bounded time."""

from __future__ import annotations

import os

import pytest
import torch

from .test_distributed import AGREEMENT, LaunchHung, launch, zero3_gathering_config

HANG = int(os.environ.get("DLLM_TRL_HANG_SECONDS", "300"))
"""Seconds after which a launch counts as hung (a passing one takes well under a minute alone)."""


def assert_trains_as_ddp(result, ddp):
    assert result["sharded"] and result["nfe"] == ddp["nfe"] and result["loss_chunks"] == ddp["loss_chunks"]
    assert result["losses"] == pytest.approx(ddp["losses"], abs=1e-6)
    for name, value in ddp["params"].items():
        torch.testing.assert_close(result["params"][name], value, **AGREEMENT, msg=name)


def assert_processes_differ(result):
    (sure_nfe, unsure_nfe), (sure_chunks, unsure_chunks) = result["nfe"], result["loss_chunks"]
    assert all(a < b for a, b in zip(sure_nfe, unsure_nfe)), result["nfe"]
    assert sure_chunks == [0, 0] and all(n > 0 for n in unsure_chunks), result["loss_chunks"]


def test_trust_region_trainer_with_one_process_dropping_every_group_under_zero3(tmp_path):
    """DiffusionDPPOMaskTrainer, process 0's groups all dropped: its loss chunks partner process 1's trust-region
    chunks (which call ``support_at``), with the shipped ZeRO-3 config. It deadlocked when the partner was a separate
    zero path (head + entropy, no support)."""
    zero3 = launch(tmp_path / "zero3", "task=sure_unsure", "trainer=dppo", config="deepspeed_zero3", timeout=HANG)
    assert zero3["sharded"]
    assert_processes_differ(zero3)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["rldf", "dppo"])
@pytest.mark.parametrize("engine", ["zero3", "zero3_gathering", "fsdp2"])
def test_every_trainer_under_every_sharding_engine_trains_as_ddp(tmp_path, trainer, engine):
    """The full matrix (``benchmarks/engine_matrix.py`` prints it with forwards and seconds): processes that differ,
    each trainer, each engine whose forwards are collectives; the parameters after two steps equal DDP's."""
    ddp = launch(tmp_path / "ddp", "task=sure_unsure", f"trainer={trainer}", timeout=HANG)
    assert_processes_differ(ddp)
    config, options = {"zero3": ("deepspeed_zero3", ()), "fsdp2": ("fsdp", ("fsdp_on_cpu=1",)),
                       "zero3_gathering": (zero3_gathering_config(tmp_path / "config"), ())}[engine]
    result = launch(tmp_path / engine, "task=sure_unsure", f"trainer={trainer}", *options, config=config,
                    timeout=HANG)
    assert_trains_as_ddp(result, ddp)


@pytest.mark.parametrize("option", ["num_iterations=2", pytest.param("is_correction=1", marks=pytest.mark.slow)])
def test_old_policy_pass_with_the_sampling_view_under_gathering_zero3(tmp_path, option):
    """An old-policy pass (``num_iterations=2``) or the mismatch correction scores π_old with the sampler's view (an
    extra head call per forward) on the busy process only; under ZeRO-3 gathering every weight, the idle partner
    must make that call too (it aborted on a gather size mismatch, resp. deadlocked)."""
    config = zero3_gathering_config(tmp_path / "config")
    result = launch(tmp_path / "zero3", "task=sure_unsure", option, config=config, timeout=HANG)
    assert result["sharded"] and result["partitioned_at_load"]
    assert_processes_differ(result)


@pytest.mark.slow
@pytest.mark.xfail(raises=LaunchHung, strict=True, reason="issue 43: still hangs under ZeRO-3 after the fix, before "
                   "any 'Loading weights' bar or training step is printed (DDP runs it in seconds); not diagnosed")
def test_rollout_idle_forward_on_the_addition_toy_with_per_process_thresholds_under_zero3(tmp_path):
    """The addition toy with its own sampler settings (dual cache), process 0's threshold so low that each block
    commits in one step, process 1's so high that it commits one token per step: process 0's idle forwards must
    partner process 1's cached decoding steps (it hung in the rollout under the shipped ZeRO-3 config)."""
    result = launch(tmp_path / "zero3", "task=toy_thresholds", config="deepspeed_zero3", timeout=HANG)
    fast, slow = result["nfe"]
    assert all(a < b for a, b in zip(fast, slow)), result["nfe"]
