"""benchmarks/trust_region.py: its direction-disagreement helper against a brute-force reference, and its quick mode
end to end on the causal Sudoku toy."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "trust_region.py"


@pytest.fixture(scope="module")
def trust_region():
    spec = importlib.util.spec_from_file_location("trust_region_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def brute_force_disagreement(div, direction, log_ratio, advantages, delta_low, delta_high):
    """Token by token in plain Python, from SPEC §3: outside iff D > δ (δ_high where A > 0); the predictive direction
    is the sign of g, the ratio direction the sign of r − 1; a mask drops a token iff outside and A·(direction) > 0."""
    sign = lambda x: (x > 0) - (x < 0)
    outside, direction_differs, decision_differs = [], [], []
    for d, g, lr, a in zip(div.tolist(), direction.tolist(), log_ratio.tolist(), advantages.tolist()):
        out = d > (delta_high if a > 0 else delta_low)
        ratio_minus_one = math.exp(lr) - 1.0
        outside.append(out)
        direction_differs.append(out and sign(g) != sign(ratio_minus_one))
        decision_differs.append(out and ((a * g > 0) != (a * ratio_minus_one > 0)))
    return outside, direction_differs, decision_differs


@pytest.mark.parametrize("delta_high", [None, 0.05])
def test_direction_disagreement_matches_brute_force(trust_region, delta_high):
    g = torch.Generator().manual_seed(0)
    n = 4000
    div = torch.rand(n, generator=g, dtype=torch.float64) * 0.3
    direction = torch.randn(n, generator=g, dtype=torch.float64) * 0.1
    log_ratio = torch.randn(n, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    advantages[::7] = 0.0  # zero-advantage tokens: both masks keep them, but their directions can still differ
    delta = 0.15
    parts = trust_region.direction_disagreement(div, direction, log_ratio, advantages, delta, delta_high=delta_high)
    outside, direction_differs, decision_differs = brute_force_disagreement(
        div, direction, log_ratio, advantages, delta, delta if delta_high is None else delta_high
    )
    assert parts["outside"].tolist() == outside
    assert parts["direction"].tolist() == direction_differs
    assert parts["decision"].tolist() == decision_differs
    # The random draw exercises every case: tokens inside and outside, agreeing and disagreeing, A = 0 among them.
    assert 0 < sum(decision_differs) < sum(direction_differs) < sum(outside) < n


def test_quick_mode_writes_the_result_fields(trust_region, tmp_path):
    store = trust_region.main(["--quick", "--models", "causal", "--methods", "predictive_uni", "--eval-size", "50",
                               "--output-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "trust_region_quick.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(store["runs"]))
    assert (tmp_path / "trust_region_quick_table.md").read_text().count("predictive, uniform tail") == 1
    assert (tmp_path / "trust_region_quick.png").stat().st_size > 0
    assert saved["setup"]["steps"] == 3 and saved["setup"]["num_iterations"] == 4 and saved["setup"]["eval_size"] == 50
    assert 0.0 < saved["baseline"]["causal"] <= 1.0
    (run,) = saved["runs"]
    assert (run["model"], run["method"], run["seed"], run["steps"]) == ("causal", "predictive_uni", 0, 3)
    assert 0.0 <= run["solve_rate"] <= 1.0
    # 3 steps with a rollout reused 4 times: one rollout, then two off-policy updates.
    assert run["rollout_steps"] == [0] and len(run["rewards"]) == 1 and len(run["masked_frac_per_step"]) == 3
    # The first update is on-policy (μ is the sampling distribution itself): the mask cannot drop anything there.
    assert run["masked_frac_per_step"][0] == 0.0
    assert run["masked_frac"] == pytest.approx(sum(run["masked_frac_per_step"]) / 3)
    assert run["masked_frac_off_policy"] == pytest.approx(sum(run["masked_frac_per_step"][1:]) / 2)
    assert run["mu_from_rollout"] == 1.0
    assert 0 < run["tokens"] and 0 <= run["masked_tokens"] <= run["outside_tokens"] <= run["tokens"]
    assert 0 <= run["decision_disagree_tokens"] <= run["direction_disagree_tokens"] <= run["outside_tokens"]
    assert run["outside_frac"] == pytest.approx(run["outside_tokens"] / run["tokens"])
    if run["outside_tokens"]:
        share = run["direction_disagree_tokens"] / run["outside_tokens"]
        assert run["disagree_frac_of_outside"] == pytest.approx(share)
    assert 0 <= run["kept_but_ratio_clipped_tokens"] <= run["tokens"] - run["masked_tokens"]
    assert 0 < run["kept_weight_mean"] <= run["kept_weight_max"] <= 20.0  # the importance weight is truncated at C
    assert run["train_seconds"] > 0 and run["eval_seconds"] > 0
