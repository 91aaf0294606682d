"""The README's main job: RLDF on the embedded toy model raises held-out greedy accuracy (slow, ~5 min)."""

import pytest

from dllm_trl.__main__ import main, moving_average


def test_moving_average_is_a_trailing_mean():
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


@pytest.mark.slow
def test_main_job_improves_toy_accuracy(tmp_path):
    summary = main(["--output-dir", str(tmp_path)])
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.03, summary
