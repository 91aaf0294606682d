"""Policy estimators and RLDF ablations on the toy task (SPEC §2.4, paper 1 App. A and §6), side by side.

Every run starts from the same toy checkpoint, trains :class:`~dllm_trl.RLDFTrainer` for the same number of
optimizer steps with the same seed list, the same prompts per step, the same group size and the same rollout
settings (the toy's sampler: 8 positions, blocks of 4, dynamic threshold 0.9, dual cache, temperature 1), and
only the loss side changes:

* estimators: ``rldf`` (k sampled states, clipped clean targets), ``sequential`` (x_{t−1}: targets I_t),
  ``all_masking`` (d1; also with 15% prompt masking), ``random_masking`` (ELBO-style; also the complementary pair);
* RLDF ablations (paper 1 §6), one factor at a time from the base (k = 4, τ = 1, c = 0.2, x_0, token norm):
  k ∈ {1, 4, 16}, τ ∈ {0.5, 1, ∞} (at k = 1: toy completions have ≈ 3 decoding steps, so at k = 4 there is
  nothing to choose), c ∈ {0, 0.2, 0.6}, x_0 vs x_{t−1} (= ``sequential``), token vs sample normalisation.

Per run: held-out greedy accuracy after training, the mean rollout reward per step, seconds per optimizer step,
model calls per step and sequence forwards per completion (rollout NFE; the no-grad π_old pass; the loss
forwards), target tokens per state. Results go to a JSON file (runs already there are skipped, so an interrupted
grid resumes), a Markdown table and a PNG plot::

    python benchmarks/estimators.py                       # 4 estimators + 2 variants + ablations, 3 seeds, 60 steps
    python benchmarks/estimators.py --quick               # 2 steps, 1 seed, 3 configurations: a smoke test
    python benchmarks/estimators.py --steps 40 --seeds 0 1 2 3 4 --only main
    python benchmarks/estimators.py --checkpoint /tmp/toy  # a checkpoint from scripts/pretrain_toy.py
    python benchmarks/estimators.py --model block --only main --name estimators_block   # the toy block model

``--model block`` runs the same grid on the toy block-diffusion model (SDAR layout, blocks of 4,
``dllm_trl.toy.block``): its states are scored in packed forwards, and only the trajectory estimators (``rldf``,
``sequential`` and the RLDF ablations) have a block form, so the masking estimators are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASE = dict(policy_estimator="rldf", num_sampled_timesteps=4, timestep_temperature=1.0, clean_target_threshold=0.2,
            loss_normalization="token")
MAIN = {
    "rldf": {},
    "sequential": dict(policy_estimator="sequential"),
    "all_masking": dict(policy_estimator="all_masking"),
    "all_masking+prompt0.15": dict(policy_estimator="all_masking", prompt_mask_prob=0.15),
    "random_masking": dict(policy_estimator="random_masking"),
    "random_masking+pair": dict(policy_estimator="random_masking", complementary_masking=True),
}
# Toy completions take ≈ 3 decoding steps, so at k = 4 almost every row trains on all of its steps and τ has
# (almost) nothing to choose from: the τ ablation runs at k = 1, where the choice of the state is everything.
ABLATIONS = {
    "rldf k=1": dict(num_sampled_timesteps=1),
    "rldf k=16": dict(num_sampled_timesteps=16),
    "rldf k=1 tau=0.5": dict(num_sampled_timesteps=1, timestep_temperature=0.5),
    "rldf k=1 tau=inf": dict(num_sampled_timesteps=1, timestep_temperature=math.inf),
    "rldf c=0": dict(clean_target_threshold=0.0),
    "rldf c=0.6": dict(clean_target_threshold=0.6),
    "rldf sample-norm": dict(loss_normalization="sample"),
}
ABLATION_GROUPS = [
    ("k (sampled states)", ["rldf k=1", "rldf", "rldf k=16"]),
    ("τ (timestep temperature), k = 1", ["rldf k=1 tau=0.5", "rldf k=1", "rldf k=1 tau=inf"]),
    ("c (clean threshold)", ["rldf c=0", "rldf", "rldf c=0.6"]),
    ("target", ["rldf", "sequential"]),
    ("normalisation", ["rldf", "rldf sample-norm"]),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="Optimizer steps per run.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", choices=["all", "main", "ablations"], default="all")
    parser.add_argument("--configs", nargs="+", default=None, help="Run only these configuration names.")
    parser.add_argument("--quick", action="store_true", help="Smoke test: 2 steps, seed 0, 3 configurations, 40 eval.")
    parser.add_argument("--model", choices=["diffusion", "block"], default="diffusion",
                        help="The toy diffusion LM or the toy block-diffusion LM.")
    parser.add_argument("--checkpoint", default=None, help="Toy checkpoint (default: the shipped one).")
    parser.add_argument("--learning-rate", type=float, default=3e-5,
                        help="Constant learning rate (3e-4 made RLDF diverge on the shipped checkpoint).")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--eval-size", type=int, default=200, help="Held-out problems for greedy accuracy.")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--output-dir", default=str(REPO / "docs"), help="Where the table and plot go.")
    parser.add_argument("--name", default="estimators", help="Stem of the output files.")
    parser.add_argument("--fresh", action="store_true", help="Ignore runs already in the JSON file.")
    parser.add_argument("--report-only", action="store_true", help="Only rewrite the table and plot from the JSON file.")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.eval_size = 2, [0], 40
        args.configs = args.configs or ["rldf", "all_masking", "random_masking+pair"]
        if args.name == "estimators":
            args.name = "estimators_quick"
        if args.output_dir == str(REPO / "docs"):
            args.output_dir = os.path.join(tempfile.gettempdir(), "dllm_trl_estimators_quick")
    return args


def selected_configs(args) -> dict[str, dict]:
    configs = {}
    if args.only in ("all", "main"):
        configs.update(MAIN)
    if args.only in ("all", "ablations"):
        configs.update({"rldf": {}, "sequential": MAIN["sequential"], **ABLATIONS})
    if args.configs:
        known = {**MAIN, **ABLATIONS}
        unknown = [name for name in args.configs if name not in known]
        if unknown:
            raise SystemExit(f"unknown configurations {unknown}; known: {list(known)}")
        configs = {name: known[name] for name in args.configs}
    if args.model == "block":  # only the trajectory estimators have a block-diffusion form
        configs = {name: c for name, c in configs.items()
                   if c.get("policy_estimator", "rldf") in ("rldf", "sequential")}
    return configs


def toy_model(args):
    """``(load(path=...) -> (model, tokenizer), shipped folder, greedy evaluation config)`` of ``args.model``."""
    if args.model == "block":
        from dllm_trl.toy.block import load_toy_block, toy_block_assets_dir, toy_block_generation_config

        return load_toy_block, toy_block_assets_dir(), toy_block_generation_config()
    from dllm_trl.toy import load_toy, toy_assets_dir, toy_generation_config

    return load_toy, toy_assets_dir(), toy_generation_config()


class ForwardCounter:
    """Counts model calls and the rows they carry, split into rollout / no-grad scoring / loss (with grad)."""

    def __init__(self):
        self.phase = "train"
        self.calls = {"rollout": 0, "score": 0, "loss": 0}
        self.rows = {"rollout": 0, "score": 0, "loss": 0}

    def hook(self, module, args, kwargs):
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        phase = "rollout" if self.phase == "rollout" else ("loss" if torch.is_grad_enabled() else "score")
        self.calls[phase] += 1
        self.rows[phase] += 0 if ids is None else int(ids.shape[0])

    def snapshot(self):
        return {"calls": dict(self.calls), "rows": dict(self.rows)}


def run_one(name, overrides, seed, args, checkpoint):
    import torch
    from transformers import TrainerCallback

    from dllm_trl.toy import evaluate_accuracy, toy_dataset, toy_reward
    from dllm_trl.cli import toy_rldf_config
    from dllm_trl.trainers import RLDFTrainer

    torch.set_num_threads(args.threads)
    load, _, eval_config = toy_model(args)
    model, tokenizer = load(path=checkpoint)
    settings = {**BASE, **overrides}
    completions_per_step = args.num_generations * args.prompts_per_step
    with tempfile.TemporaryDirectory() as output_dir:
        config = toy_rldf_config(
            output_dir,
            num_generations=args.num_generations,
            per_device_train_batch_size=completions_per_step,
            beta=args.beta,
            learning_rate=args.learning_rate,
            max_steps=args.steps,
            seed=seed,
            disable_tqdm=True,
            **settings,
        )
        trainer = RLDFTrainer(model=model, reward_funcs=toy_reward, args=config, train_dataset=toy_dataset("train"),
                              processing_class=tokenizer)
        counter = ForwardCounter()
        # The decoder: the sampler calls it directly (its cached steps skip the LM head's module), the loss through
        # the full model.
        handle = trainer.model.get_decoder().register_forward_pre_hook(counter.hook, with_kwargs=True)
        generate = trainer._generate_single_turn

        def counted_generate(*a, **kw):
            counter.phase = "rollout"
            try:
                return generate(*a, **kw)
            finally:
                counter.phase = "train"

        trainer._generate_single_turn = counted_generate
        step_times = []

        class Timer(TrainerCallback):
            def on_step_begin(self, *a, **kw):
                self.start = time.perf_counter()

            def on_step_end(self, *a, **kw):
                step_times.append(time.perf_counter() - self.start)

        trainer.add_callback(Timer())
        start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - start
        handle.remove()
        trainer._generate_single_turn = generate
    after = evaluate_accuracy(trainer.model, tokenizer, toy_dataset("test", size=args.eval_size), eval_config)
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    mean = lambda key: statistics.fmean(e[key] for e in logs if key in e) if any(key in e for e in logs) else None  # noqa: E731
    counts = counter.snapshot()
    steps = max(len(step_times), 1)
    completions = steps * completions_per_step
    return dict(
        name=name,
        seed=seed,
        settings={k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in settings.items()},
        steps=len(step_times),
        accuracy=after["accuracy"],
        rewards=[e["reward"] for e in logs],
        seconds_per_step=statistics.fmean(step_times) if step_times else None,
        train_seconds=train_seconds,
        rollout_seconds_per_step=mean("rldf/rollout_time"),
        loss_seconds_per_step=mean("rldf/loss_time"),
        model_calls_per_step={k: v / steps for k, v in counts["calls"].items()},
        forwards_per_completion={k: v / completions for k, v in counts["rows"].items()},
        states_per_completion=mean("rldf/sampled_steps"),
        target_tokens_per_state=mean("rldf/target_tokens_per_step"),
        token_utility=mean("rldf/token_utility"),
    )


# ------------------------------------------------------------------------------------------------ reporting
def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs, name):
    rows = [r for r in runs if r["name"] == name]
    acc = [r["accuracy"] for r in rows]
    tail = [statistics.fmean(r["rewards"][-max(1, len(r["rewards"]) // 3) :]) for r in rows if r["rewards"]]
    first = [r["rewards"][0] for r in rows if r["rewards"]]
    return dict(
        name=name,
        seeds=[r["seed"] for r in rows],
        accuracy=_mean_std(acc),
        accuracy_runs=acc,
        reward_first=_mean_std(first),
        reward_tail=_mean_std(tail),
        seconds_per_step=_mean_std([r["seconds_per_step"] for r in rows]),
        calls=_mean_std([sum(r["model_calls_per_step"].values()) for r in rows])[0],
        fwd_rollout=_mean_std([r["forwards_per_completion"]["rollout"] for r in rows])[0],
        fwd_score=_mean_std([r["forwards_per_completion"]["score"] for r in rows])[0],
        fwd_loss=_mean_std([r["forwards_per_completion"]["loss"] for r in rows])[0],
        targets=_mean_std([r["target_tokens_per_state"] for r in rows])[0],
        utility=_mean_std([r["token_utility"] for r in rows])[0],
    )


HEADER = (
    "| configuration | seeds | held-out accuracy | per seed | Δ vs rldf (paired) | reward step 1 | reward last third "
    "| s / step | model calls / step | fwd/compl. rollout | fwd/compl. π_old pass | fwd/compl. loss | targets / state "
    "| token utility |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _paired_delta(runs, name, seeds):
    acc = {(r["name"], r["seed"]): r["accuracy"] for r in runs}
    deltas = [acc[name, s] - acc["rldf", s] for s in seeds if (name, s) in acc and ("rldf", s) in acc]
    if not deltas or name == "rldf":
        return "—"
    mean, std = _mean_std(deltas)
    return f"{mean:+.3f} ± {std:.3f}"


def _row(runs, name, seeds):
    rows = [r for r in runs if r["name"] == name and r["seed"] in seeds]
    s = summarise(rows, name)
    per_seed = ", ".join(f"{a:.3f}" for a in s["accuracy_runs"])
    return (
        f"| {name} | {len(s['seeds'])} | {s['accuracy'][0]:.3f} ± {s['accuracy'][1]:.3f} | [{per_seed}] "
        f"| {_paired_delta(rows + [r for r in runs if r['name'] == 'rldf'], name, s['seeds'])} "
        f"| {s['reward_first'][0]:.3f} ± {s['reward_first'][1]:.3f} | {s['reward_tail'][0]:.3f} ± {s['reward_tail'][1]:.3f} "
        f"| {s['seconds_per_step'][0]:.2f} ± {s['seconds_per_step'][1]:.2f} | {s['calls']:.1f} "
        f"| {s['fwd_rollout']:.2f} | {s['fwd_score']:.2f} | {s['fwd_loss']:.2f} | {s['targets']:.2f} "
        f"| {s['utility']:.3f} |"
    )


def markdown(runs, baseline, args, order):
    steps = sorted({r["steps"] for r in runs})
    seeds_of = {}
    for r in runs:
        seeds_of.setdefault(r["name"], set()).add(r["seed"])
    lines = [
        f"Toy task{' on the toy block-diffusion model' if args.model == 'block' else ''}, "
        f"{', '.join(map(str, steps))} optimizer steps per run, {args.prompts_per_step} prompts × "
        f"{args.num_generations} generations per step, lr {args.learning_rate:g} constant, β {args.beta:g}. Held-out "
        f"greedy accuracy of the starting checkpoint on the same {args.eval_size} problems: **{baseline:.3f}**.",
        "",
        "Accuracy and rewards: mean ± sample std over seeds (per-seed values in brackets). Δ vs rldf: per-seed "
        "difference to the rldf run of the same seed (same prompts, same first rollout), mean ± std. Reward = mean "
        "rollout reward (temperature 1) of the first step / over the last third of the steps. Forwards per "
        "completion: sequence forwards (rows through the model; rollout = NFE with the dual cache) divided by "
        "completions; the loss skips groups whose rewards are all equal. s / step: wall time on a shared 2-core CPU "
        "(other jobs ran alongside: compare forwards, not seconds, across tables).",
        "",
        "### Estimators",
        "",
        HEADER,
    ]
    main_names = [n for n in order if n in MAIN and n in seeds_of]
    for name in main_names:
        lines.append(_row(runs, name, seeds_of[name]))
    ablation_names = list(dict.fromkeys(n for _, group in ABLATION_GROUPS for n in group if n in seeds_of))
    if any(n in ABLATIONS for n in ablation_names):
        common = set.intersection(*(seeds_of[n] for n in ablation_names))
        lines += ["", f"### RLDF ablations (seeds {sorted(common)}, the same for every row)", ""]
        for title, group in ABLATION_GROUPS:
            present = [n for n in group if n in seeds_of]
            if len(present) < 2:
                continue
            lines += [f"**{title}**", "", HEADER]
            lines += [_row(runs, name, common) for name in present]
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(runs, baseline, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values, window):
        return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]

    def curves(ax, names, title):
        window = 1
        for name in names:
            rows = [r for r in runs if r["name"] == name and r["rewards"]]
            if not rows:
                continue
            n = min(len(r["rewards"]) for r in rows)
            window = max(1, n // 6)
            per_seed = [smooth(r["rewards"][:n], window) for r in rows]
            mean = [statistics.fmean(c[i] for c in per_seed) for i in range(n)]
            low = [min(c[i] for c in per_seed) for i in range(n)]
            high = [max(c[i] for c in per_seed) for i in range(n)]
            x = range(1, n + 1)
            (line,) = ax.plot(x, mean, label=name)
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.12)
        ax.set_title(f"{title}; trailing mean over {window} steps", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean rollout reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    def bars(ax, names, title):
        present = [n for n in names if any(r["name"] == n for r in runs)]
        for i, name in enumerate(present):
            acc = [r["accuracy"] for r in runs if r["name"] == name]
            ax.bar(i, statistics.fmean(acc), color="C0", alpha=0.6)
            ax.scatter([i] * len(acc), acc, color="k", s=10, zorder=3)
        ax.axhline(baseline, color="r", ls="--", lw=1, label="start checkpoint")
        ax.set_xticks(range(len(present)), present, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")

    seeds_of = {}
    for r in runs:
        seeds_of.setdefault(r["name"], set()).add(r["seed"])
    ablation_names = list(dict.fromkeys(n for _, group in ABLATION_GROUPS for n in group if n in seeds_of))
    common = set.intersection(*(seeds_of[n] for n in ablation_names)) if ablation_names else set()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    curves(axes[0, 0], list(MAIN), "estimators: reward (mean over seeds, band = min–max)")
    bars(axes[0, 1], list(MAIN), "estimators: final held-out accuracy (dots = seeds)")
    all_runs, runs = runs, [r for r in runs if r["seed"] in common]
    curves(axes[1, 0], [n for n in ablation_names if n != "sequential"], f"RLDF ablations (seeds {sorted(common)}): reward")
    bars(axes[1, 1], ablation_names, f"RLDF ablations (seeds {sorted(common)}): final held-out accuracy")
    runs = all_runs
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    import torch

    from dllm_trl.toy import evaluate_accuracy, toy_dataset

    torch.set_num_threads(args.threads)
    load, shipped, eval_config = toy_model(args)
    checkpoint = args.checkpoint or str(shipped)
    if not (Path(checkpoint) / "config.json").is_file():
        raise SystemExit(f"no toy checkpoint at {checkpoint}: run scripts/pretrain_toy.py (--output-dir) first")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.name}.json"
    store = {} if args.fresh or not results_path.is_file() else json.loads(results_path.read_text())
    setup = dict(steps=args.steps, learning_rate=args.learning_rate, num_generations=args.num_generations,
                 prompts_per_step=args.prompts_per_step, beta=args.beta, eval_size=args.eval_size,
                 checkpoint="shipped" if args.checkpoint is None else os.path.abspath(checkpoint),
                 **({"model": "block"} if args.model == "block" else {}))
    if store.get("setup") != setup:
        store = {"setup": setup, "runs": []}
    if "baseline_accuracy" not in store:
        model, tokenizer = load(path=checkpoint)
        store["baseline_accuracy"] = evaluate_accuracy(
            model, tokenizer, toy_dataset("test", size=args.eval_size), eval_config
        )["accuracy"]
    configs = selected_configs(args)
    done = {(r["name"], r["seed"]) for r in store["runs"]}
    todo = [(name, seed) for name in configs for seed in args.seeds if (name, seed) not in done]
    if args.report_only:
        todo = []
    print(f"start checkpoint accuracy {store['baseline_accuracy']:.3f}; {len(todo)} runs to do", flush=True)
    start = time.perf_counter()
    for n, (name, seed) in enumerate(todo, 1):
        result = run_one(name, configs[name], seed, args, checkpoint)
        store["runs"].append(result)
        results_path.write_text(json.dumps(store, indent=1) + "\n")
        print(
            f"[{n}/{len(todo)}] {name:24s} seed {seed}: accuracy {result['accuracy']:.3f}, reward "
            f"{result['rewards'][0]:.3f} -> {statistics.fmean(result['rewards'][-5:]):.3f}, "
            f"{result['seconds_per_step']:.2f} s/step ({time.perf_counter() - start:.0f} s so far)",
            flush=True,
        )
    runs = store["runs"]  # every run of this setup in the file, whatever this invocation ran
    order = list(MAIN) + [n for n in ABLATIONS]
    table = markdown(runs, store["baseline_accuracy"], args, order)
    (out / f"{args.name}_table.md").write_text(table)
    plot(runs, store["baseline_accuracy"], out / f"{args.name}.png")
    print("\n" + table)
    print(f"wrote {results_path}, {out / (args.name + '_table.md')}, {out / (args.name + '.png')}")
    return store


if __name__ == "__main__":
    sys.exit(main() and 0)
