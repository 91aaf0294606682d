"""One process's failure stops every process, launched for real on 2 CPU processes (see test_distributed.py): a
reward that raises on one process raises on both (``stop_together``), a collective whose partner hangs is reported
when ``ddp_timeout`` runs out, and the hung process honours the launcher's SIGTERM (it exits 143 with its stacks after
``DLLM_TRL_SIGTERM_GRACE_SECONDS`` instead of waiting for the SIGKILL)."""

from __future__ import annotations

import re
import time

import pytest

from .test_distributed import LaunchHung, launch

RAISED = (r"The reward function '\w+' raised on 1 of 2 processes \(process 1: RuntimeError: reward service "
          r"unreachable on process 1\); every process stops here\.")


def raising_reward_launch(tmp_path, config, *options):
    start = time.perf_counter()
    code, output = launch(tmp_path, "reward_fault=raise@1", *options, config=config, check=False, timeout=300)
    return code, output, time.perf_counter() - start


def assert_both_processes_raised(code, output):
    assert code != 0, output[-3000:]
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: RuntimeError: {RAISED}", output), (rank, output[-5000:])


def test_a_reward_raising_on_one_process_stops_both_with_its_error_under_ddp(tmp_path):
    code, output, seconds = raising_reward_launch(tmp_path, "multi_gpu")
    assert_both_processes_raised(code, output)
    assert seconds < 120, seconds


@pytest.mark.slow
@pytest.mark.parametrize("config, options", [("deepspeed_zero3", ()), ("fsdp", ("fsdp_on_cpu=1",))],
                         ids=["zero3", "fsdp2"])
def test_a_reward_raising_on_one_process_stops_both_with_its_error_under_sharding_engines(tmp_path, config, options):
    code, output, seconds = raising_reward_launch(tmp_path, config, *options)
    assert_both_processes_raised(code, output)
    assert seconds < 180, seconds


@pytest.mark.slow
@pytest.mark.xfail(raises=LaunchHung, strict=True, reason="issue 43, not done: process 0 still waits past "
                   "ddp_timeout=10 s in the reward exchange with the hung process (no timeout error within 300 s)")
def test_a_hung_process_is_reported_by_the_others_timeout_and_honours_sigterm(tmp_path):
    """Process 1's reward never returns: process 0's exchange with it times out after ``ddp_timeout`` (10 s) with
    gloo's timeout error; the launcher then SIGTERMs process 1, which cannot end its step, so it exits 143 after the
    grace period (5 s here) with the stack where it hung, not at the launcher's SIGKILL 30 s later."""
    start = time.perf_counter()
    code, output = launch(tmp_path, "reward_fault=hang@1", "ddp_timeout=10", check=False, timeout=300,
                          env={"DLLM_TRL_SIGTERM_GRACE_SECONDS": "5"})
    seconds = time.perf_counter() - start
    assert code != 0
    assert re.search(r"\[rank0\]:.*(Timed out|timed out|Timeout|timeout)", output), output[-5000:]
    assert "SIGTERM: the step under way did not end within 5 s" in output, output[-5000:]
    assert "in reward_with_fault" in output, output[-5000:]  # the hung process's stack names where it waits
    assert "exitcode  : 143" in output or "exitcode  : 1 " in output, output[-3000:]
    assert seconds < 150, seconds
