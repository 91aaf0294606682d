"""Clean-state (x_0) vs next-state (x_{t−1}) targets with a KL penalty: what paper 1 §6.2 reports (Fig. 4, Table 4).

Paper 1 does not claim an ordering of the policy estimators. Its evidence for RLDF's x̂_0 targets over the x_{t−1}
targets (``sequential``) is the training dynamics with β > 0: higher rollout reward, and no spikes in the KL term or
the policy loss, which it attributes to the few tokens x_{t−1} supervises per state (~2 % of the response against
~15 %). This benchmark measures exactly that on the Sudoku toy, with the estimator study's harness
(``benchmarks/estimators.py --task sudoku``: same checkpoint, sampler, rollouts per step, evaluation):

* ``rldf`` and ``sequential`` at each ``--betas`` value, on paired ``--seeds`` (same puzzles, same first rollout);
* per run: the rollout reward per step, the logged KL and loss per step, target tokens per state, held-out greedy
  solve rate after training;
* spikes, defined on each run's own series (so a run is compared with itself, whatever its scale):
  a **KL spike** is a step whose KL exceeds ``--kl-spike-factor`` (4) × the run's median KL over steps 2+ (step 1 is
  on the reference, KL 0); a **loss spike** is a step whose loss lies more than ``--loss-spike-z`` (5) robust standard
  deviations (1.4826 × MAD) from the run's median loss;
* the report: mean ± std over seeds and the paired (same-seed) difference rldf − sequential of each figure::

    python benchmarks/target_stability.py                       # β 0.01 and 0.04, seeds 0-4, 40 steps, one thread
    python benchmarks/target_stability.py --quick               # 3 steps, seed 0, β 0.04, into a temporary folder
    python benchmarks/target_stability.py --report-only         # rewrite the table and plot from the JSON
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("rldf", "sequential")


def estimators_module():
    spec = importlib.util.spec_from_file_location("estimators_benchmark", REPO / "benchmarks" / "estimators.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--betas", type=float, nargs="+", default=[0.01, 0.04],
                        help="KL coefficients (paper 1 uses 0.01 and 0.04 for LLaDA / Dream).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=40, help="Optimizer steps per run (the estimator study's 40).")
    parser.add_argument("--learning-rate", type=float, default=3e-5,
                        help="Constant lr; 3e-5 is the rate the estimator study tuned for both rldf and sequential.")
    parser.add_argument("--kl-spike-factor", type=float, default=4.0,
                        help="A KL spike is a step above this multiple of the run's median KL (steps 2+).")
    parser.add_argument("--loss-spike-z", type=float, default=5.0,
                        help="A loss spike is a step this many robust standard deviations from the run's median.")
    parser.add_argument("--eval-size", type=int, default=100, help="Held-out test puzzles for the greedy solve rate.")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--output-dir", default=str(REPO / "docs" / "results"), help="Where the JSON, table and plot go.")
    parser.add_argument("--name", default="estimators_sudoku_targets", help="Stem of the output files.")
    parser.add_argument("--quick", action="store_true", help="Smoke test: 3 steps, seed 0, β 0.04, 20 puzzles.")
    parser.add_argument("--report-only", action="store_true", help="Only rewrite the table and plot from the JSON.")
    args = parser.parse_args(argv)
    if any(beta <= 0 for beta in args.betas):
        raise SystemExit("--betas: every value must be > 0 (the KL term is what this benchmark watches)")
    if args.quick:
        args.steps, args.seeds, args.betas, args.eval_size = 3, [0], [0.04], 20
        if args.output_dir == str(REPO / "docs" / "results"):
            args.output_dir = os.path.join(tempfile.gettempdir(), "dllm_trl_target_stability_quick")
        args.name = f"{args.name}_quick"
    return args


# ----------------------------------------------------------------------------------------------------- spikes


def kl_spikes(kl: list[float], factor: float) -> int:
    """Steps 2+ whose KL exceeds ``factor`` × the median KL of steps 2+ (step 1 is on the reference: KL 0)."""
    later = [value for value in kl[1:] if value is not None]
    if len(later) < 2:
        return 0
    median = statistics.median(later)
    return sum(value > factor * median for value in later) if median > 0 else sum(value > 0 for value in later)


def loss_spikes(losses: list[float], z: float) -> int:
    """Steps whose loss is more than ``z`` robust standard deviations (1.4826 × median absolute deviation) from the
    run's median loss."""
    values = [value for value in losses if value is not None]
    if len(values) < 3:
        return 0
    median = statistics.median(values)
    scale = 1.4826 * statistics.median(abs(value - median) for value in values)
    if scale == 0:
        return sum(value != median for value in values)
    return sum(abs(value - median) > z * scale for value in values)


def summary_of(run: dict, args) -> dict:
    """The per-run figures of the report."""
    later_kl = [value for value in run["kl"][1:] if value is not None]
    rewards = run["rewards"]
    return dict(
        reward_mean=statistics.fmean(rewards),
        reward_last10=statistics.fmean(rewards[-10:]),
        solve=run["accuracy"],
        kl_median=statistics.median(later_kl) if later_kl else 0.0,
        kl_max=max(later_kl, default=0.0),
        kl_spikes=kl_spikes(run["kl"], args.kl_spike_factor),
        loss_std=statistics.pstdev(v for v in run["losses"] if v is not None),
        loss_spikes=loss_spikes(run["losses"], args.loss_spike_z),
        target_tokens=run["target_tokens_per_state"],
    )


FIGURES = [
    ("reward_mean", "rollout reward, mean of all steps", 3),
    ("reward_last10", "rollout reward, last 10 steps", 3),
    ("solve", "held-out greedy solve rate", 3),
    ("kl_median", "KL, median of steps 2+", 4),
    ("kl_max", "KL, max", 4),
    ("kl_spikes", "KL spikes (steps)", 1),
    ("loss_std", "loss, std over steps", 4),
    ("loss_spikes", "loss spikes (steps)", 1),
    ("target_tokens", "target tokens per state", 2),
]


def _mean_std(values, digits):
    if not values:
        return "–"
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def _paired(a: dict, b: dict, key: str, digits: int) -> str:
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return "–"
    deltas = [a[s][key] - b[s][key] for s in seeds]
    up = sum(d > 0 for d in deltas)
    down = sum(d < 0 for d in deltas)
    mean = statistics.fmean(deltas)
    spread = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    return f"{mean:+.{digits}f} ± {spread:.{digits}f} ({up} up, {len(deltas) - up - down} tie, {down} down)"


def markdown(store: dict, args) -> str:
    lines = [f"Start: greedy solve rate {store['baseline_accuracy']:.3f}. {args.steps} steps at lr "
             f"{args.learning_rate:g}; spikes: KL > {args.kl_spike_factor:g} × the run's median, loss > "
             f"{args.loss_spike_z:g} robust sd from its median. Mean ± std over seeds; paired = same-seed rldf − "
             f"sequential.", ""]
    for beta in sorted({r["beta"] for r in store["runs"]}):
        by_config = {name: {r["seed"]: summary_of(r, args) for r in store["runs"]
                            if r["beta"] == beta and r["name"] == name} for name in CONFIGS}
        seeds = sorted(set(by_config["rldf"]) | set(by_config["sequential"]))
        lines += [f"**β = {beta:g}** (seeds {', '.join(map(str, seeds))})", "",
                  "| figure | rldf (x̂₀ targets) | sequential (x_{t−1} targets) | paired rldf − sequential |",
                  "|---|---|---|---|"]
        for key, label, digits in FIGURES:
            cells = [_mean_std([s[key] for s in by_config[name].values()], digits) for name in CONFIGS]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} | "
                         f"{_paired(by_config['rldf'], by_config['sequential'], key, digits)} |")
        lines.append("")
    return "\n".join(lines)


def plot(store: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    betas = sorted({r["beta"] for r in store["runs"]})
    figure, axes = plt.subplots(3, len(betas), figsize=(5.5 * len(betas), 9), squeeze=False)
    colours = {"rldf": "tab:blue", "sequential": "tab:orange"}
    for column, beta in enumerate(betas):
        for row, (key, label) in enumerate([("rewards", "rollout reward"), ("kl", "KL"), ("losses", "loss")]):
            ax = axes[row][column]
            for run in store["runs"]:
                if run["beta"] != beta:
                    continue
                series = [math.nan if v is None else v for v in run[key]]
                ax.plot(range(1, len(series) + 1), series, color=colours[run["name"]], alpha=0.5, linewidth=1,
                        label=run["name"] if run["seed"] == min(r["seed"] for r in store["runs"]) else None)
            ax.set_title(f"β = {beta:g}: {label} per step")
            ax.set_xlabel("step")
            if row == 0:
                ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None):
    args = parse_args(argv)
    estimators = estimators_module()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.name}.json"
    store = json.loads(results_path.read_text()) if results_path.is_file() else {}
    setup = dict(steps=args.steps, learning_rate=args.learning_rate, eval_size=args.eval_size, task="sudoku")
    if args.report_only:
        if not store.get("runs"):
            raise SystemExit(f"no runs in {results_path} to report")
    elif store.get("setup") != setup:
        store = {"setup": setup, "runs": []}
    start = time.perf_counter()
    if not args.report_only:
        base = ["--task", "sudoku", "--steps", str(args.steps), "--eval-size", str(args.eval_size),
                "--threads", str(args.threads), "--learning-rates", str(args.learning_rate)]
        if "baseline_accuracy" not in store:
            harness = estimators.parse_args(base)
            load, shipped, _ = estimators.toy_model(harness)
            model, tokenizer = load(path=str(shipped))
            store["baseline_accuracy"] = estimators.task_functions(harness)["evaluate"](model, tokenizer)["accuracy"]
        done = {(r["name"], r["seed"], r["beta"]) for r in store["runs"]}
        todo = [(name, seed, beta) for beta in args.betas for seed in args.seeds for name in CONFIGS
                if (name, seed, beta) not in done]
        print(f"start checkpoint solve rate {store['baseline_accuracy']:.3f}; {len(todo)} runs to do", flush=True)
        for n, (name, seed, beta) in enumerate(todo, 1):
            harness = estimators.parse_args(base + ["--beta", str(beta)])
            _, shipped, _ = estimators.toy_model(harness)
            began = time.perf_counter()
            result = estimators.run_one(name, estimators.MAIN[name], seed, harness, str(shipped), args.learning_rate)
            result.update(beta=beta, run_seconds=time.perf_counter() - began)
            store["runs"].append(result)
            store["wall_seconds"] = store.get("wall_seconds", 0.0) + result["run_seconds"]
            results_path.write_text(json.dumps(store, indent=1) + "\n")
            figures = summary_of(result, args)
            print(f"[{n}/{len(todo)}] β {beta:g} {name:10s} seed {seed}: reward {figures['reward_mean']:.3f}, "
                  f"KL max {figures['kl_max']:.4f} ({figures['kl_spikes']} spikes), loss spikes "
                  f"{figures['loss_spikes']}, solve {figures['solve']:.3f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    table = markdown(store, args)
    (out / f"{args.name}_table.md").write_text(table + "\n")
    plot(store, out / f"{args.name}.png")
    print("\n" + table)
    print(f"wrote {results_path}, {out / (args.name + '_table.md')}, {out / (args.name + '.png')}")
    return store


if __name__ == "__main__":
    sys.exit(main() and 0)
