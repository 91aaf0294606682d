"""Trust-region study on the Sudoku toys: paper 2 ("Predictive Divergence Masks") in miniature (SPEC §3).

Five trust regions, each trained from the same checkpoint with the same seeds, prompts per step, group size,
learning rate and rollout settings, in an off-policy stress setting: every rollout batch is reused for
``num_iterations`` optimizer steps (4 by default), so three of every four updates see data from an older policy;
on the diffusion toy the rollout also runs with the dual KV cache, whose approximation makes the recorded
behaviour distribution ``μ`` differ from the training forward even at the first update (SPEC §3.3).

Methods (how each one is expressed; see docs/trust_region.md):

* ``grpo_clip_higher``: TRL's clipped PPO surrogate with ``epsilon = 0.2``, ``epsilon_high = 0.28`` —
  ``trl.GRPOTrainer`` on the causal toy, :class:`~dllm_trl.RLDFTrainer` (its PPO loss) on the diffusion toy;
* ``ppo_ratio_mask``: the same clipped surrogate with a symmetric ``epsilon = 0.2``, i.e. the PPO ratio mask in
  its clipped form (not expressible in ``DPPOMaskConfig``, which has no ratio proximity test);
* ``dppo_topk_kl``: :class:`~dllm_trl.DPPOMaskTrainer`, ``divergence="kl"``, ``mask_direction="ratio"``;
* ``predictive_agg`` / ``predictive_uni``: the same with ``mask_direction="predictive"`` and
  ``tail_estimator="aggregated"`` / ``"uniform"``.

Per run: greedy held-out solve rate of the first ``--eval-size`` test puzzles after training (the start value is
measured once per model), the mean rollout reward per step, the fraction of loss tokens the trust region drops
(``dppo/masked_frac``; ``clip_ratio/region_mean`` for the clipped surrogates), and for the divergence masks the
fraction of tokens outside the trust region (``D > δ``) and, among those, the fraction on which the predictive and
the ratio direction criteria point differently — both directions computed on the same tokens by the trainer.
Results go to a JSON file after every run (runs already there are skipped, so an interrupted study resumes), then a
Markdown table and a PNG plot::

    python benchmarks/trust_region.py                       # 2 models x 5 methods x 5 seeds, 48 steps
    python benchmarks/trust_region.py --quick               # 1 seed, 3 steps: a rehearsal (written to a temp dir)
    python benchmarks/trust_region.py --models causal --methods dppo_topk_kl predictive_uni --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODELS = ("causal", "diffusion")
METHODS = {
    "grpo_clip_higher": dict(kind="clip", epsilon=0.2, epsilon_high=0.28),
    "ppo_ratio_mask": dict(kind="clip", epsilon=0.2),
    "dppo_topk_kl": dict(kind="mask", divergence="kl", mask_direction="ratio"),
    "predictive_agg": dict(kind="mask", divergence="kl", mask_direction="predictive", tail_estimator="aggregated"),
    "predictive_uni": dict(kind="mask", divergence="kl", mask_direction="predictive", tail_estimator="uniform"),
}
LABELS = {
    "grpo_clip_higher": "GRPO clip-higher (ε 0.2 / 0.28)",
    "ppo_ratio_mask": "PPO ratio mask (clip, ε 0.2)",
    "dppo_topk_kl": "DPPO top-K KL (ratio direction)",
    "predictive_agg": "predictive, aggregated tail",
    "predictive_uni": "predictive, uniform tail",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=48,
                        help="Optimizer steps per run (12 rollouts at num_iterations 4).")
    parser.add_argument("--num-iterations", type=int, default=4,
                        help="Optimizer steps per rollout batch (TRL's num_iterations): all but the first off-policy.")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="Constant learning rate (the main job's).")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--delta", type=float, default=0.15, help="δ of the divergence masks (paper main value).")
    parser.add_argument("--top-k", type=int, default=4, help="K of the behaviour top-K (vocabulary of 22 tokens).")
    parser.add_argument("--eval-size", type=int, default=100, help="First N test puzzles for the greedy solve rate.")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--quick", action="store_true", help="Rehearsal: 1 seed, 3 steps, output in a temp dir.")
    parser.add_argument("--output-dir", default=str(REPO / "docs"), help="Where the JSON, table and plot go.")
    parser.add_argument("--name", default="trust_region", help="Stem of the output files.")
    parser.add_argument("--fresh", action="store_true", help="Ignore runs already in the JSON file.")
    parser.add_argument("--report-only", action="store_true", help="Only rewrite the table and plot from the JSON.")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 3, args.seeds[:1]
        if args.name == "trust_region":
            args.name = "trust_region_quick"
        if args.output_dir == str(REPO / "docs"):
            args.output_dir = os.path.join(tempfile.gettempdir(), "dllm_trl_trust_region_quick")
    return args


# ------------------------------------------------------------------------------------------------ token metrics
def direction_disagreement(div, direction, log_ratio, advantages, delta, delta_low=None, delta_high=None) -> dict:
    """Where the predictive and the ratio direction criteria part, among the tokens outside the trust region.

    Returns boolean tensors over the tokens: ``outside`` — the proximity test ``D > δ`` (``δ_high`` where ``A > 0``)
    that both masks share; ``direction`` — outside, and ``sign(g) ≠ sign(r − 1)`` (the two direction criteria point
    differently, whatever the advantage); ``decision`` — the predictive and the DPPO ratio keep-masks differ (the
    same tokens, less those with ``A = 0``, where neither mask drops anything). Library rules only:
    :func:`~dllm_trl.losses.divergence_masks.divergence_proximity`, ``predictive_mask`` and ``dppo_mask``.
    """
    import torch

    from dllm_trl.losses.divergence_masks import divergence_proximity, dppo_mask, predictive_mask

    thresholds = dict(delta=delta, delta_low=delta_low, delta_high=delta_high)
    outside = divergence_proximity(div, advantages, **thresholds)
    decision = predictive_mask(div, direction, advantages, **thresholds) != dppo_mask(div, log_ratio, advantages,
                                                                                       **thresholds)
    return dict(outside=outside, direction=outside & (torch.sign(direction) != torch.sign(log_ratio)),
                decision=decision)


def record_metrics(records, args) -> dict:
    """Token counts of the mask over every loss call of a DPPOMaskTrainer run (``trainer.loss.records``)."""
    import torch

    from dllm_trl.losses.divergence_masks import ppo_mask

    tokens = {name: torch.cat([r[name] for r in records]) for name in ("div", "direction", "log_ratio",
                                                                        "advantages", "keep", "weights")}
    parts = direction_disagreement(tokens["div"], tokens["direction"], tokens["log_ratio"], tokens["advantages"],
                                   args.divergence_threshold, args.divergence_threshold_low,
                                   args.divergence_threshold_high)
    counts = {name: int(value.sum()) for name, value in parts.items()}
    n, outside = tokens["keep"].numel(), counts["outside"]
    keep, weights = tokens["keep"], tokens["weights"].double()
    # What the divergence mask lets through that GRPO clip-higher's ratio rule would have dropped.
    ratio_drops = ~ppo_mask(tokens["log_ratio"], tokens["advantages"], 0.2, 0.28)
    return dict(
        tokens=n,
        masked_tokens=int((~tokens["keep"]).sum()),
        outside_tokens=outside,
        direction_disagree_tokens=counts["direction"],
        decision_disagree_tokens=counts["decision"],
        outside_frac=outside / max(n, 1),
        disagree_frac_of_outside=counts["direction"] / outside if outside else None,
        decision_disagree_frac_of_outside=counts["decision"] / outside if outside else None,
        divergence_mean=float(tokens["div"].double().mean()) if n else None,
        kept_but_ratio_clipped_tokens=int((keep & ratio_drops).sum()),
        kept_weight_mean=float(weights[keep].mean()) if keep.any() else None,
        kept_weight_max=float(weights[keep].max()) if keep.any() else None,
    )


# ------------------------------------------------------------------------------------------------------- runs
def load_model(model_kind):
    from dllm_trl.toy import load_sudoku, load_sudoku_causal

    return (load_sudoku_causal if model_kind == "causal" else load_sudoku)()


def solve_rate(model_kind, model, tokenizer, eval_size) -> float:
    from dllm_trl.toy import (
        SUDOKU_GEN_LENGTH,
        evaluate_accuracy,
        evaluate_causal_accuracy,
        sudoku_dataset,
        sudoku_generation_config,
        sudoku_reward,
    )

    held_out = sudoku_dataset("test", size=eval_size)
    if model_kind == "causal":
        result = evaluate_causal_accuracy(model, tokenizer, held_out, max_new_tokens=SUDOKU_GEN_LENGTH,
                                          batch_size=eval_size, reward=sudoku_reward)
    else:
        result = evaluate_accuracy(model, tokenizer, held_out, sudoku_generation_config(), batch_size=eval_size,
                                   reward=sudoku_reward)
    return result["accuracy"]


def make_trainer(model_kind, method, seed, args, output_dir):
    """The trainer of one run; every method shares the settings below and differs only in its loss."""
    from trl import GRPOConfig, GRPOTrainer

    from dllm_trl.toy import SUDOKU_GEN_LENGTH, sudoku_cell_reward, sudoku_dataset, sudoku_rldf_config
    from dllm_trl.trainers import DPPOMaskConfig, DPPOMaskTrainer, RLDFTrainer

    settings = dict(METHODS[method])
    kind = settings.pop("kind")
    if kind == "mask":
        settings.update(divergence_threshold=args.delta, divergence_top_k=args.top_k, model_kind=model_kind)
    common = dict(
        temperature=1.0, num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        max_completion_length=SUDOKU_GEN_LENGTH,
        beta=0.0, learning_rate=args.learning_rate, lr_scheduler_type="constant", max_steps=args.steps,
        num_iterations=args.num_iterations, seed=seed, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, dataloader_pin_memory=False, disable_tqdm=True,
    )
    model, tokenizer = load_model(model_kind)
    data = dict(reward_funcs=sudoku_cell_reward, train_dataset=sudoku_dataset("train"), processing_class=tokenizer)
    if model_kind == "causal" and kind == "clip":
        config = GRPOConfig(output_dir=output_dir, **common, **settings)
        return GRPOTrainer(model=model, args=config, **data), tokenizer
    if model_kind == "causal":
        config = DPPOMaskConfig(output_dir=output_dir, **common, **settings)
        return DPPOMaskTrainer(model=model, args=config, **data), tokenizer
    if kind == "clip":
        return RLDFTrainer(model=model, args=sudoku_rldf_config(output_dir, **common, **settings), **data), tokenizer
    config = sudoku_rldf_config(output_dir, config_class=DPPOMaskConfig, **common, **settings)
    return DPPOMaskTrainer(model=model, args=config, **data), tokenizer


def run_one(model_kind, method, seed, args) -> dict:
    import torch
    from transformers.trainer_callback import PrinterCallback

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer, tokenizer = make_trainer(model_kind, method, seed, args, output_dir)
        trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a log printer
        masks = METHODS[method]["kind"] == "mask"
        if masks:
            trainer.loss.records = []  # the trainer keeps the per-token mask tensors of every loss call here
        start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    after = solve_rate(model_kind, trainer.model, tokenizer, args.eval_size)
    eval_seconds = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]  # one per optimizer step
    masked_key = "dppo/masked_frac" if masks else "clip_ratio/region_mean"
    masked = [entry.get(masked_key) for entry in logs]
    # Optimizer step i (0-based) is update (i mod num_iterations) of its rollout batch: 0 is on-policy.
    off_policy = [m for i, m in enumerate(masked) if i % args.num_iterations and m is not None]
    result = dict(
        model=model_kind, method=method, seed=seed, steps=len(logs),
        solve_rate=after,
        rewards=[entry["reward"] for entry in logs if "reward" in entry],  # one per rollout batch
        rollout_steps=[i for i, entry in enumerate(logs) if "reward" in entry],
        masked_frac_per_step=masked,
        masked_frac=statistics.fmean(logged) if (logged := [m for m in masked if m is not None]) else None,
        masked_frac_off_policy=statistics.fmean(off_policy) if off_policy else None,
        train_seconds=train_seconds, eval_seconds=eval_seconds,
    )
    if masks:
        result.update(record_metrics(trainer.loss.records, trainer.args))
        result["mu_from_rollout"] = statistics.fmean(e["dppo/mu_from_rollout"] for e in logs
                                                     if "dppo/mu_from_rollout" in e)
    return result


# ---------------------------------------------------------------------------------------------------- report
def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(mean_std, digits=3, percent=False, signed=False):
    mean, std = mean_std
    if mean is None:
        return "—"
    if percent:
        return f"{100 * mean:.{digits}f}% ± {100 * std:.{digits}f}%"
    return f"{mean:{'+' if signed else ''}.{digits}f} ± {std:.{digits}f}"


def collapsed(run, baseline) -> bool:
    """Collapse: the final greedy solve rate fell below half of the starting checkpoint's."""
    return run["solve_rate"] < 0.5 * baseline


def summarise(runs, baseline):
    pooled_out = sum(r.get("outside_tokens", 0) for r in runs)
    pooled_dis = sum(r.get("direction_disagree_tokens", 0) for r in runs)
    masks = any("outside_tokens" in r for r in runs)
    return dict(
        seeds=[r["seed"] for r in runs],
        solve_rate=_mean_std([r["solve_rate"] for r in runs]),
        per_seed=[r["solve_rate"] for r in runs],
        collapses=sum(collapsed(r, baseline) for r in runs),
        masked=_mean_std([r["masked_frac"] for r in runs]),
        masked_off=_mean_std([r["masked_frac_off_policy"] for r in runs]),
        outside=_mean_std([r.get("outside_frac") for r in runs]),
        disagree=_mean_std([r.get("disagree_frac_of_outside") for r in runs]),
        disagree_pooled=(pooled_dis / pooled_out if pooled_out else None) if masks else None,
        pooled_counts=(pooled_dis, pooled_out) if masks else None,
        reward_first=_mean_std([r["rewards"][0] for r in runs]),
        reward_tail=_mean_std([statistics.fmean(r["rewards"][-max(1, len(r["rewards"]) // 4):]) for r in runs]),
        seconds=_mean_std([r["train_seconds"] + r["eval_seconds"] for r in runs]),
    )


HEADER = (
    "| method | seeds | final solve rate | per seed | Δ vs DPPO top-K KL (paired) | collapses "
    "| masked tokens (all steps) | masked tokens (off-policy steps) | tokens with D > δ | disagreement (of D > δ) "
    "| reward, first rollout | reward, last quarter | s / run |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown(store, args) -> str:
    setup = store["setup"]
    intro = (
        f"{setup['steps']} optimizer steps per run, {setup['prompts_per_step']} puzzles × {setup['num_generations']} "
        f"generations per rollout, each rollout reused for num_iterations = {setup['num_iterations']} steps, lr "
        f"{setup['learning_rate']:g} constant, β 0, δ = {setup['delta']:g} (top-K KL, K = {setup['top_k']}). Solve "
        f"rate: greedy, first {setup['eval_size']} puzzles of the test split; mean ± sample std over seeds. "
        "Collapse: final solve rate < ½ × the start. Masked tokens: mean over steps of the share of loss tokens the "
        "trust region drops (clipped surrogates: TRL's clip_ratio/region_mean, the same proximity-and-direction "
        "test). Δ vs DPPO top-K KL: per-seed difference of the final solve rate to the DPPO run of the same seed (same "
        "first rollout), mean ± std. Disagreement: among tokens with D > δ, the share on which the predictive and the "
        "ratio direction point differently, sign(g) ≠ sign(r − 1) (mean over seeds of the per-run share; pooled counts over all runs "
        "in brackets). Reward: mean partial-credit reward of the temperature-1 rollouts, of the first rollout and of "
        "the last quarter of them."
    )
    lines = [intro, ""]
    for model_kind in MODELS:
        runs = [r for r in store["runs"] if r["model"] == model_kind]
        if not runs:
            continue
        baseline = store["baseline"][model_kind]
        lines += [f"### {model_kind} toy (start: solve rate {baseline:.2f})", "", HEADER]
        for method in METHODS:
            rows = [r for r in runs if r["method"] == method]
            if not rows:
                continue
            s = summarise(rows, baseline)
            per_seed = ", ".join(f"{a:.2f}" for a in s["per_seed"])
            reference = {r["seed"]: r["solve_rate"] for r in runs if r["method"] == "dppo_topk_kl"}
            deltas = [r["solve_rate"] - reference[r["seed"]] for r in rows if r["seed"] in reference]
            paired = "—" if method == "dppo_topk_kl" or not deltas else _fmt(_mean_std(deltas), signed=True)
            disagree = _fmt(s["disagree"], 1, percent=True)
            if s["pooled_counts"] is not None:
                dis, out = s["pooled_counts"]
                disagree += f" ({dis}/{out})"
            lines.append(
                f"| {LABELS[method]} | {len(rows)} | {_fmt(s['solve_rate'])} | [{per_seed}] | {paired} | "
                f"{s['collapses']}/{len(rows)} | {_fmt(s['masked'], 2, True)} | {_fmt(s['masked_off'], 2, True)} | "
                f"{_fmt(s['outside'], 2, True)} | {disagree} | {_fmt(s['reward_first'])} | {_fmt(s['reward_tail'])} | "
                f"{s['seconds'][0]:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(store, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r["model"] == m for r in store["runs"])]
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.2 * len(models)), squeeze=False)
    for row, model_kind in zip(axes, models):
        runs = [r for r in store["runs"] if r["model"] == model_kind]
        baseline = store["baseline"][model_kind]
        present = [m for m in METHODS if any(r["method"] == m for r in runs)]
        for i, method in enumerate(present):
            rows = [r for r in runs if r["method"] == method]
            n = min(len(r["rewards"]) for r in rows)
            mean = [statistics.fmean(r["rewards"][j] for r in rows) for j in range(n)]
            window = 3
            smooth = [statistics.fmean(mean[max(0, j - window + 1): j + 1]) for j in range(n)]
            row[0].plot([step + 1 for step in rows[0]["rollout_steps"][:n]], smooth, label=LABELS[method],
                        color=f"C{i}", marker=".")
            n = min(len(r["masked_frac_per_step"]) for r in rows)
            masked = [statistics.fmean(r["masked_frac_per_step"][j] or 0.0 for r in rows) for j in range(n)]
            row[2].plot(range(1, n + 1), masked, label=LABELS[method], color=f"C{i}", lw=1)
            rates = [r["solve_rate"] for r in rows]
            row[1].bar(i, statistics.fmean(rates), color=f"C{i}", alpha=0.6)
            row[1].scatter([i] * len(rates), rates, color="k", s=12, zorder=3)
        row[0].set(title=f"{model_kind}: rollout reward (seed mean, trailing mean of 3)",
                   xlabel="optimizer step of the rollout", ylabel="mean partial-credit reward")
        row[1].axhline(baseline, color="r", ls="--", lw=1, label="start")
        row[1].axhline(0.5 * baseline, color="r", ls=":", lw=1, label="collapse line (½ start)")
        row[1].set_xticks(range(len(present)), [LABELS[m] for m in present], rotation=25, ha="right", fontsize=7)
        row[1].set(title=f"{model_kind}: final greedy solve rate (dots = seeds)", ylabel="solve rate")
        row[2].set(title=f"{model_kind}: share of loss tokens masked / clipped (seed mean)",
                   xlabel="optimizer step (a new rollout every num_iterations)", ylabel="masked fraction")
        for ax in row:
            ax.title.set_fontsize(9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.name}.json"
    store = {} if args.fresh or not results_path.is_file() else json.loads(results_path.read_text())
    setup = dict(steps=args.steps, num_iterations=args.num_iterations, learning_rate=args.learning_rate,
                 num_generations=args.num_generations, prompts_per_step=args.prompts_per_step, delta=args.delta,
                 top_k=args.top_k, eval_size=args.eval_size)
    if args.report_only:
        if not store.get("runs"):
            raise SystemExit(f"no runs in {results_path} to report")
    elif store.get("setup") != setup:
        store = {"setup": setup, "baseline": {}, "runs": []}
    start = time.perf_counter()
    for model_kind in args.models:
        if model_kind not in store["baseline"] and not args.report_only:
            model, tokenizer = load_model(model_kind)
            store["baseline"][model_kind] = solve_rate(model_kind, model, tokenizer, args.eval_size)
            results_path.write_text(json.dumps(store, indent=1) + "\n")
    done = {(r["model"], r["method"], r["seed"]) for r in store["runs"]}
    todo = [(m, method, seed) for m in args.models for method in args.methods for seed in args.seeds
            if (m, method, seed) not in done]
    if args.report_only:
        todo = []
    print(f"start solve rates {store['baseline']}; {len(todo)} runs to do", flush=True)
    for n, (model_kind, method, seed) in enumerate(todo, 1):
        result = run_one(model_kind, method, seed, args)
        store["runs"].append(result)
        results_path.write_text(json.dumps(store, indent=1) + "\n")
        masked = result["masked_frac"]
        print(f"[{n}/{len(todo)}] {model_kind:9s} {method:16s} seed {seed}: solve rate "
              f"{store['baseline'][model_kind]:.2f} -> {result['solve_rate']:.2f}, masked "
              f"{'—' if masked is None else f'{100 * masked:.2f}%'}, {result['train_seconds']:.0f}+"
              f"{result['eval_seconds']:.0f} s ({time.perf_counter() - start:.0f} s so far)", flush=True)
    if todo:
        store["wall_seconds"] = store.get("wall_seconds", 0.0) + (time.perf_counter() - start)
        results_path.write_text(json.dumps(store, indent=1) + "\n")
    table = markdown(store, args)
    (out / f"{args.name}_table.md").write_text(table)
    if store["runs"]:
        plot(store, out / f"{args.name}.png")
    print("\n" + table)
    print(f"wrote {results_path}, {out / (args.name + '_table.md')}, {out / (args.name + '.png')}")
    return store


if __name__ == "__main__":
    sys.exit(main() and 0)
