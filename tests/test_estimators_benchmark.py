"""benchmarks/estimators.py: the addition task stays the default; the Sudoku study's learning-rate choice and paired
differences on hand-made runs; its quick mode end to end (tuning → evaluation at the chosen rate → an ablation at
rldf's rate), the JSON fields it writes, and that a second call resumes instead of re-running."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "estimators.py"


@pytest.fixture(scope="module")
def estimators():
    spec = importlib.util.spec_from_file_location("estimators_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_addition_stays_the_default(estimators):
    args = estimators.parse_args([])
    assert (args.task, args.steps, args.seeds, args.eval_size, args.name) == ("addition", 60, [0, 1, 2], 200,
                                                                              "estimators")
    assert args.learning_rate == 3e-5 and args.ablation_seeds == [0, 1, 2]
    sudoku = estimators.parse_args(["--task", "sudoku"])
    assert (sudoku.steps, sudoku.seeds, sudoku.eval_size, sudoku.name) == (40, [0, 1, 2, 3, 4], 100,
                                                                           "estimators_sudoku")
    assert sudoku.learning_rates == [3e-5, 1e-4, 2e-4] and sudoku.tune_seeds == [100, 101]
    # τ is ablated at the base k = 4 on Sudoku, at k = 1 on the addition toy.
    assert estimators.SUDOKU_ABLATIONS["rldf tau=0.5"] == {"timestep_temperature": 0.5}
    assert estimators.ABLATIONS["rldf k=1 tau=0.5"]["num_sampled_timesteps"] == 1
    with pytest.raises(SystemExit, match="disjoint"):
        estimators.parse_args(["--task", "sudoku", "--tune-seeds", "0", "7"])


def _run(name, seed, lr, accuracy, rewards):
    return dict(name=name, seed=seed, learning_rate=lr, accuracy=accuracy, rewards=rewards)


def test_lr_choice_and_tie_breaks(estimators):
    runs = [
        # a: 1e-4 has the best mean solve rate (0.35 vs 0.30 / 0.20).
        _run("a", 100, 3e-5, 0.3, [0.5]), _run("a", 101, 3e-5, 0.3, [0.5]),
        _run("a", 100, 1e-4, 0.4, [0.1]), _run("a", 101, 1e-4, 0.3, [0.1]),
        _run("a", 100, 2e-4, 0.2, [0.9]), _run("a", 101, 2e-4, 0.2, [0.9]),
        # b: tie on solve rate between 3e-5 and 2e-4, broken by the last-10-step reward (2e-4).
        _run("b", 100, 3e-5, 0.3, [0.9] + [0.2] * 10), _run("b", 101, 3e-5, 0.3, [0.2]),
        _run("b", 100, 1e-4, 0.1, [0.9]), _run("b", 101, 1e-4, 0.1, [0.9]),
        _run("b", 100, 2e-4, 0.3, [0.0] + [0.4] * 10), _run("b", 101, 2e-4, 0.3, [0.4]),
        # c: a full tie: the smaller rate. d: a tuning run missing: no choice.
        *[_run("c", s, lr, 0.2, [0.5]) for s in (100, 101) for lr in (3e-5, 1e-4, 2e-4)],
        *[_run("d", s, lr, 0.2, [0.5]) for s in (100, 101) for lr in (3e-5, 1e-4)],
    ]
    tuning = estimators.lr_tuning(runs, ["a", "b", "c", "d"], [3e-5, 1e-4, 2e-4], [100, 101])
    assert {n: t["chosen"] for n, t in tuning.items()} == {"a": 1e-4, "b": 2e-4, "c": 3e-5, "d": None}
    assert tuning["a"]["per_lr"][repr(1e-4)]["solve_rate"] == pytest.approx(0.35)
    assert tuning["b"]["per_lr"][repr(3e-5)]["reward_last10"] == pytest.approx(0.2)  # the last 10 steps only
    assert tuning["d"]["per_lr"][repr(2e-4)]["seeds"] == []
    assert estimators.lr_tuning(runs, ["d"], [1e-4], [100, 101])["d"]["chosen"] == 1e-4  # one rate: nothing to tune


def test_paired_differences_pair_by_seed(estimators):
    a = [_run("a", s, 1e-4, acc, [r]) for s, acc, r in ((0, 0.30, 0.6), (1, 0.20, 0.5), (2, 0.25, 0.5), (3, 0.4, 0.1))]
    b = [_run("b", s, 2e-4, acc, [r]) for s, acc, r in ((2, 0.25, 0.7), (1, 0.25, 0.4), (0, 0.10, 0.2))]
    paired = estimators.paired_differences(a, b)
    assert paired["seeds"] == [0, 1, 2]  # seed 3 has no partner
    sr = paired["solve_rate"]
    assert sr["per_seed"] == pytest.approx([0.2, -0.05, 0.0])
    assert (sr["positive"], sr["ties"], sr["negative"]) == (1, 1, 1)
    assert sr["mean"] == pytest.approx(0.05) and sr["std"] == pytest.approx(statistics.stdev([0.2, -0.05, 0.0]))
    assert paired["reward_last10"]["per_seed"] == pytest.approx([0.4, 0.1, -0.2])


def test_sudoku_quick_mode_writes_the_result_fields(estimators, tmp_path):
    store = estimators.main(["--task", "sudoku", "--quick", "--output-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "estimators_sudoku_quick.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(store["runs"]))
    table = (tmp_path / "estimators_sudoku_quick_table.md").read_text()
    assert (tmp_path / "estimators_sudoku_quick.png").stat().st_size > 0
    setup = saved["setup"]
    assert (setup["task"], setup["steps"], setup["eval_size"], setup["tune_seeds"]) == ("sudoku", 2, 20, [100])
    assert setup["learning_rates"] == [3e-5, 2e-4] and setup["train_reward"] == "sudoku_cell_reward"
    assert 0.0 <= saved["baseline_accuracy"] <= 1.0
    runs = {(r["name"], r["seed"], r["learning_rate"]): r for r in saved["runs"]}

    # Tuning: every estimator at every rate on the tuning seed; the chosen rate is the best final solve rate.
    for name in ("rldf", "sequential"):
        tuned = {lr: runs[name, 100, lr] for lr in setup["learning_rates"]}
        best = max(tuned.values(), key=lambda r: (r["accuracy"], statistics.fmean(r["rewards"][-10:]),
                                                  -r["learning_rate"]))
        assert saved["tuning"][name]["chosen"] == best["learning_rate"]
    chosen = {name: saved["tuning"][name]["chosen"] for name in ("rldf", "sequential")}
    # Evaluation seed 0 at each estimator's chosen rate; the ablation (τ = ∞ at k = 4) at rldf's.
    assert ("rldf", 0, chosen["rldf"]) in runs and ("sequential", 0, chosen["sequential"]) in runs
    tau = runs["rldf tau=inf", 0, chosen["rldf"]]
    assert tau["settings"]["timestep_temperature"] == "inf" and tau["settings"]["num_sampled_timesteps"] == 4
    assert ("sequential", 0, chosen["rldf"]) in runs  # x_{t−1} of the ablation table, at rldf's rate
    assert len(saved["runs"]) == 4 + 2 + 1 + (chosen["sequential"] != chosen["rldf"])

    for run in saved["runs"]:
        assert run["steps"] == 2 and len(run["rewards"]) == 2 and 0.0 <= run["accuracy"] <= 1.0
        assert all(0.0 <= r <= 1.0 for r in run["rewards"]) and run["seconds_per_step"] > 0
        fwd = run["forwards_per_completion"]
        assert fwd["rollout"] == 20.0  # the Sudoku sampler: 20 decoding steps (one cell each) of one full forward
        assert fwd["score"] == 0.0  # on-policy: no separate π_old pass
        assert fwd["loss"] == pytest.approx(run["states_per_completion"])  # one loss forward per scored state
        assert 0.0 <= run["states_per_completion"] <= 4.0  # k = 4 of 20 states (groups with equal rewards skipped)
        if run["name"] == "sequential" and run["states_per_completion"] > 0:
            assert run["target_tokens_per_state"] == 1.0  # x_{t−1}: the one cell committed at t

    (pair,) = saved["paired"]  # only rldf and sequential ran: one neighbouring pair
    rldf, seq = runs["rldf", 0, chosen["rldf"]], runs["sequential", 0, chosen["sequential"]]
    assert (pair["a"], pair["b"], pair["seeds"]) == ("rldf", "sequential", [0])
    assert pair["solve_rate"]["per_seed"] == pytest.approx([rldf["accuracy"] - seq["accuracy"]])
    delta = pair["solve_rate"]["per_seed"][0]
    counts = pair["solve_rate"]["positive"], pair["solve_rate"]["ties"], pair["solve_rate"]["negative"]
    assert counts == (int(delta > 0), int(delta == 0), int(delta < 0))
    assert pair["reward_last10"]["per_seed"] == pytest.approx([statistics.fmean(rldf["rewards"][-10:])
                                                               - statistics.fmean(seq["rewards"][-10:])])
    summary = saved["summary"]["main/rldf"]
    assert summary["learning_rate"] == chosen["rldf"] and summary["solve_rates"] == [rldf["accuracy"]]
    assert summary["forwards_per_completion"]["rollout"] == 20.0
    assert saved["summary"]["ablations/rldf tau=inf"]["learning_rate"] == chosen["rldf"]
    assert "rldf − sequential" in table and "τ (timestep temperature), k = 4" in table
    assert saved["wall_seconds"] == pytest.approx(sum(r["run_seconds"] for r in saved["runs"]))

    # A second call finds every run in the JSON and runs none again.
    again = estimators.main(["--task", "sudoku", "--quick", "--output-dir", str(tmp_path)])
    assert again["runs"] == saved["runs"]


def test_diffusion_gemma_arguments(estimators):
    args = estimators.parse_args(["--task", "sudoku", "--model", "diffusion_gemma"])
    assert args.name == "estimators_sudoku_diffusion_gemma" and args.learning_rates == [1e-5, 3e-5, 1e-4]
    assert args.eval_size == 200 and args.sampler_seeds == [0, 1, 2]
    # Only the trajectory estimators and the RLDF ablations: DiffusionGemma has no mask token to build masked states.
    assert set(estimators.selected_configs(args)) == {"rldf", "sequential", *estimators.SUDOKU_ABLATIONS}
    with pytest.raises(SystemExit, match="add --task sudoku"):
        estimators.parse_args(["--model", "diffusion_gemma"])
    with pytest.raises(SystemExit, match="no block model"):
        estimators.parse_args(["--task", "sudoku", "--model", "block"])


def test_diffusion_gemma_quick_mode(estimators, tmp_path):
    """The Sudoku protocol on the DiffusionGemma toy end to end: its sampler and loss, forwards counted on the decoder
    it really calls, the solve rate a mean over sampler seeds."""
    estimators.main(["--task", "sudoku", "--model", "diffusion_gemma", "--quick", "--output-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "estimators_sudoku_diffusion_gemma_quick.json").read_text())
    setup = saved["setup"]
    assert (setup["model"], setup["sampler_seeds"], setup["learning_rates"]) == ("diffusion_gemma", [0], [1e-5, 1e-4])
    table = (tmp_path / "estimators_sudoku_diffusion_gemma_quick_table.md").read_text()
    assert "**not greedy**" in table and "rldf − sequential" in table
    assert {r["name"] for r in saved["runs"]} == {"rldf", "sequential", "rldf tau=inf"}
    for run in saved["runs"]:
        assert run["steps"] == 2 and run["sampler_seed_accuracies"] == [run["accuracy"]]
        calls, fwd = run["model_calls_per_step"], run["forwards_per_completion"]
        # One decoder call per denoising step carries the whole batch of 32 rollouts (at most 16 steps, one canvas).
        assert 1.0 <= fwd["rollout"] <= 16.0 and calls["rollout"] == pytest.approx(fwd["rollout"])
        assert fwd["loss"] == pytest.approx(run["states_per_completion"])  # one replayed decoder row per state
        if run["settings"]["policy_estimator"] == "sequential":
            assert fwd["score"] == 0.0  # targets are the accepted tokens: no π_old pass
        else:
            assert fwd["score"] == pytest.approx(fwd["loss"])  # π_old scores the same states for the clean targets
