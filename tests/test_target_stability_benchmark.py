"""benchmarks/target_stability.py: the spike definitions against hand-made series, the paired report, and its quick
mode end to end (the KL and loss series it records are TRL's logged values, and a second call runs nothing again)."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "target_stability.py"


@pytest.fixture(scope="module")
def stability():
    spec = importlib.util.spec_from_file_location("target_stability_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kl_spikes_count_steps_above_a_multiple_of_the_median(stability):
    # Step 1 (KL 0 on the reference) is left out; the median of the rest is 0.01.
    kl = [0.0, 0.01, 0.01, 0.009, 0.05, 0.01, 0.041, 0.04, 0.01, 0.011]
    assert stability.kl_spikes(kl, 4.0) == 2  # 0.05 and 0.041 are above 0.04; 0.04 itself is not
    assert stability.kl_spikes(kl, 10.0) == 0
    assert stability.kl_spikes([0.0, None, 0.02, 0.02, 0.3], 4.0) == 1  # missing values are not steps
    assert stability.kl_spikes([0.0, 0.0, 0.0, 0.1], 4.0) == 1  # a median of 0: every non-zero step is a spike
    assert stability.kl_spikes([0.0, 0.2], 4.0) == 0  # too short to have a median to compare with


def test_loss_spikes_use_a_robust_scale(stability):
    losses = [0.1, -0.1, 0.05, -0.05, 0.0, 0.08, -0.08, 2.0]
    median = statistics.median(losses)
    mad = statistics.median(abs(v - median) for v in losses)
    brute = sum(abs(v - median) > 5 * 1.4826 * mad for v in losses)
    assert stability.loss_spikes(losses, 5.0) == brute == 1
    assert stability.loss_spikes(losses, 50.0) == 0
    assert stability.loss_spikes([0.3, 0.3, 0.3, 0.3, -1.0], 5.0) == 1  # a MAD of 0: any step off the median


def test_betas_must_be_positive(stability):
    with pytest.raises(SystemExit, match="--betas"):
        stability.parse_args(["--betas", "0.0"])


def _run(name, seed, beta, rewards, kl, losses, accuracy=0.3, tokens=5.0):
    return dict(name=name, seed=seed, beta=beta, rewards=rewards, kl=kl, losses=losses, accuracy=accuracy,
                target_tokens_per_state=tokens)


def test_report_pairs_by_seed(stability):
    args = stability.parse_args(["--seeds", "0", "1"])
    store = {"baseline_accuracy": 0.25, "runs": [
        _run("rldf", 0, 0.04, [0.5, 0.7], [0.0, 0.01, 0.01], [0.1, 0.1, 0.1], accuracy=0.3),
        _run("rldf", 1, 0.04, [0.4, 0.6], [0.0, 0.02, 0.02], [0.1, 0.1, 0.1], accuracy=0.2),
        _run("sequential", 0, 0.04, [0.5, 0.5], [0.0, 0.01, 0.2], [0.1, 0.1, 0.1], accuracy=0.3, tokens=1.0),
        _run("sequential", 1, 0.04, [0.5, 0.4], [0.0, 0.02, 0.02], [0.1, 0.1, 0.1], accuracy=0.1, tokens=1.0),
    ]}
    table = stability.markdown(store, args)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("|")}
    # Reward means: rldf 0.6 and 0.5; sequential 0.5 and 0.45 → paired +0.1 and +0.05.
    assert rows["rollout reward, mean of all steps"][3].startswith("+0.075 ± 0.035 (2 up, 0 tie, 0 down)")
    assert rows["held-out greedy solve rate"][3].startswith("+0.050 ± 0.071 (1 up, 1 tie, 0 down)")
    assert rows["KL, max"][2] == "0.1100 ± 0.1273"
    assert rows["target tokens per state"][1:3] == ["5.00 ± 0.00", "1.00 ± 0.00"]


def test_quick_mode_records_the_logged_series_and_resumes(stability, tmp_path):
    store = stability.main(["--quick", "--output-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "estimators_sudoku_targets_quick.json").read_text())
    assert (tmp_path / "estimators_sudoku_targets_quick.png").stat().st_size > 0
    assert "paired rldf − sequential" in (tmp_path / "estimators_sudoku_targets_quick_table.md").read_text()
    runs = {(r["name"], r["seed"]): r for r in saved["runs"]}
    assert set(runs) == {("rldf", 0), ("sequential", 0)}
    for run in saved["runs"]:
        assert run["beta"] == 0.04 and run["settings"]["policy_estimator"] == run["name"]
        assert len(run["kl"]) == len(run["losses"]) == len(run["rewards"]) == 3
        assert all(value is not None and value >= 0 for value in run["kl"])  # β > 0: TRL logs the KL every step
        assert run["kl"][0] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference
        assert all(value is not None for value in run["losses"])
    assert runs["sequential", 0]["target_tokens_per_state"] in (None, 1.0)
    again = stability.main(["--quick", "--output-dir", str(tmp_path)])
    assert again["runs"] == json.loads(json.dumps(store["runs"]))
