"""Before / after RLDF on the DiffusionGemma Sudoku toys: held-out solve rate per training seed, on CPU.

Each run loads a shipped DiffusionGemma toy (``dllm_trl.toy``: transformers' own ``DiffusionGemmaForBlockDiffusion``,
uniform-noise denoising, its answer one canvas of 20 tokens), trains it with :class:`~dllm_trl.RLDFTrainer` under
:func:`~dllm_trl.toy.configs.sudoku_diffusion_gemma_rldf_config` (4 puzzles × 8 rollouts per step with the toy's
sampler, k = 4 recorded steps per rollout, β = 0, constant lr) with ``DiffusionGemmaSampler`` and
``DiffusionGemmaRLDFLoss``, and measures the held-out solve rate before and after: the binary ``sudoku_reward`` on
the first ``--eval-size`` test puzzles, each decoded once per sampler seed in ``--eval-seeds`` (decoding is random:
the rate is their mean). Training seeds change the rollouts and the order of the puzzles; the start is the same
checkpoint. ::

    python benchmarks/diffusion_gemma_sudoku.py              # the noisy-teacher toy, seeds 0-4, 100 steps, lr 1e-4
    python benchmarks/diffusion_gemma_sudoku.py --toys clean --learning-rate 3e-5 --name diffusion_gemma_sudoku_clean
    python benchmarks/diffusion_gemma_sudoku.py --quick              # 2 steps, 1 seed, 20 puzzles: a smoke test
    python benchmarks/diffusion_gemma_sudoku.py --self-conditioning-gradients recorded chain  # paired, per seed

Toys: ``noisy_teacher`` (``load_sudoku_diffusion_gemma_noisy_teacher``: pre-trained on answers of which half exchange
the digits 1 and 2, the error RL with the verifier removes; the main job's recipe) and ``clean``
(``load_sudoku_diffusion_gemma``). ``--self-conditioning-gradients``: the loss's ``self_conditioning_gradient`` arms
(``recorded``: the rollout's self-conditioning input held fixed; ``chain``: the gradient through the self-conditioning
chain), each run on the same seeds; with two, the table adds their paired per-seed differences. Results go to
``<output-dir>/<name>.json`` and ``<name>_table.md``.
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
TOYS = ("noisy_teacher", "clean")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toys", nargs="+", choices=TOYS, default=["noisy_teacher"],
                        help="Which shipped toys to train (default: the noisy teacher).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="Training seeds.")
    parser.add_argument("--steps", type=int, default=100, help="Optimizer steps per run.")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="Constant learning rate.")
    parser.add_argument("--reward", choices=["cell", "solve"], default="cell",
                        help="Training reward: partial credit (sudoku_cell_reward) or binary (sudoku_reward).")
    parser.add_argument("--policy-estimator", choices=["rldf", "sequential"], default="rldf")
    parser.add_argument("--self-conditioning-gradients", nargs="+", choices=["recorded", "chain"],
                        default=["recorded"], help="DiffusionGemmaRLDFLoss's self_conditioning_gradient arms.")
    parser.add_argument("--eval-size", type=int, default=200, help="First N test puzzles.")
    parser.add_argument("--eval-seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="Sampler seeds of the held-out evaluation (each decodes every puzzle once).")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--quick", action="store_true", help="Smoke test: 2 steps, seed 0, 20 puzzles, a temp dir.")
    parser.add_argument("--output-dir", default=str(REPO / "docs" / "results"), help="Where the JSON and table go.")
    parser.add_argument("--name", default="diffusion_gemma_sudoku", help="Stem of the output files.")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.eval_size, args.eval_seeds = 2, [0], 20, [0]
        if args.output_dir == str(REPO / "docs" / "results"):
            args.output_dir = os.path.join(tempfile.gettempdir(), "dllm_trl_diffusion_gemma_sudoku_quick")
    return args


def load(toy: str):
    from dllm_trl.toy import load_sudoku_diffusion_gemma, load_sudoku_diffusion_gemma_noisy_teacher

    return (load_sudoku_diffusion_gemma_noisy_teacher if toy == "noisy_teacher" else load_sudoku_diffusion_gemma)()


def held_out(model, tokenizer, args) -> dict:
    from dllm_trl.toy import evaluate_diffusion_gemma_accuracy, sudoku_dataset, sudoku_up_to_relabelling_reward

    test = sudoku_dataset("test", size=args.eval_size)
    plain = evaluate_diffusion_gemma_accuracy(model, tokenizer, test, batch_size=args.eval_size,
                                              seeds=args.eval_seeds)
    either = [sum(sudoku_up_to_relabelling_reward(completions, list(test["puzzle"]))) / len(test)
              for completions in plain["completions_per_seed"]]  # the same decodes, scored in either convention
    return dict(solve_rate=plain["accuracy"], per_eval_seed=plain["accuracies"],
                up_to_relabelling=sum(either) / len(either))


def run_one(toy: str, seed: int, args, gradient: str = "recorded") -> dict:
    import torch
    from transformers.trainer_callback import PrinterCallback

    from dllm_trl import RLDFTrainer
    from dllm_trl.generation import DiffusionGemmaSampler
    from dllm_trl.losses import DiffusionGemmaRLDFLoss
    from dllm_trl.toy import sudoku_cell_reward, sudoku_dataset, sudoku_diffusion_gemma_sampler_config, sudoku_reward
    from dllm_trl.toy.configs import sudoku_diffusion_gemma_rldf_config

    torch.set_num_threads(args.threads)
    model, tokenizer = load(toy)
    with tempfile.TemporaryDirectory() as output_dir:
        config = sudoku_diffusion_gemma_rldf_config(output_dir, learning_rate=args.learning_rate, max_steps=args.steps,
                                                    seed=seed, policy_estimator=args.policy_estimator,
                                                    disable_tqdm=True)
        trainer = RLDFTrainer(model=model, reward_funcs=sudoku_cell_reward if args.reward == "cell" else sudoku_reward,
                              args=config, train_dataset=sudoku_dataset("train"), processing_class=tokenizer,
                              sampler=DiffusionGemmaSampler(sudoku_diffusion_gemma_sampler_config()),
                              loss=DiffusionGemmaRLDFLoss(config, self_conditioning_gradient=gradient))
        trainer.remove_callback(PrinterCallback)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    logs = [e for e in trainer.state.log_history if "reward" in e]
    return dict(toy=toy, seed=seed, self_conditioning_gradient=gradient, train_seconds=seconds,
                rewards=[e["reward"] for e in logs], after=held_out(trainer.model, tokenizer, args))


def _mean_std(values):
    values = list(values)
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
"""Two-sided 95% quantiles of Student's t for 1–10 degrees of freedom (1.96 beyond)."""


def _paired(deltas) -> str:
    """Mean ± sample std [95% t-interval of the mean] of paired per-seed differences."""
    mean, std = _mean_std(deltas)
    if len(deltas) < 2:
        return f"{mean:+.3f}"
    half = (T_975[len(deltas) - 2] if len(deltas) - 1 <= len(T_975) else 1.96) * std / len(deltas) ** 0.5
    return f"{mean:+.3f} ± {std:.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"


def paired_markdown(store, toy: str, reference: str = "recorded", other: str = "chain") -> str:
    """Per seed, ``other`` − ``reference`` (same seed, same start): held-out solve rate and the mean training reward
    of the last 10 steps."""
    arms = {(r["self_conditioning_gradient"], r["seed"]): r for r in store["runs"] if r["toy"] == toy}
    seeds = sorted(seed for arm, seed in arms if arm == reference and (other, seed) in arms)
    if not seeds:
        return ""
    solve = [arms[other, s]["after"]["solve_rate"] - arms[reference, s]["after"]["solve_rate"] for s in seeds]
    reward = [statistics.fmean(arms[other, s]["rewards"][-10:]) - statistics.fmean(arms[reference, s]["rewards"][-10:])
              for s in seeds]
    seconds = [arms[other, s]["train_seconds"] / arms[reference, s]["train_seconds"] for s in seeds]
    return "\n".join([
        f"Paired, `{other}` − `{reference}` self-conditioning gradient on the same seeds {seeds} ({toy}): mean ± "
        "sample std [95% t-interval of the mean].",
        "",
        "| quantity | Δ | per seed Δ |",
        "|---|---|---|",
        f"| held-out solve rate | **{_paired(solve)}** | [{', '.join(f'{d:+.3f}' for d in solve)}] |",
        f"| training reward, last 10 steps | **{_paired(reward)}** | [{', '.join(f'{d:+.3f}' for d in reward)}] |",
        f"| training time (ratio) | {statistics.fmean(seconds):.2f}× | [{', '.join(f'{d:.2f}' for d in seconds)}] |",
    ]) + "\n"


def markdown(store) -> str:
    setup = store["setup"]
    lines = [
        f"RLDF on the DiffusionGemma Sudoku toys: {setup['steps']} steps, lr {setup['learning_rate']:g} (constant), "
        f"`{setup['policy_estimator']}`, trained on `{setup['reward']}`, 4 puzzles × 8 rollouts per step, k = 4, β 0, "
        f"one CPU thread. Held-out: binary `sudoku_reward` on the first {setup['eval_size']} test puzzles, mean over "
        f"sampler seeds {setup['eval_seeds']} (\"either\": solved with or without 1 ↔ 2 exchanged). Mean ± sample std "
        "over training seeds.",
        "",
        "| toy | seeds | before | after | Δ (mean ± std) | per seed Δ | either, before → after | reward, first 10 → "
        "last 10 steps | s / run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    arms = list(dict.fromkeys(r.get("self_conditioning_gradient", "recorded") for r in store["runs"]))
    for (toy, before), arm in ((item, arm) for item in store["before"].items() for arm in arms):
        runs = [r for r in store["runs"] if r["toy"] == toy and r.get("self_conditioning_gradient", "recorded") == arm]
        if not runs:
            continue
        label = toy if arms == ["recorded"] else f"{toy}, `{arm}`"
        deltas = [r["after"]["solve_rate"] - before["solve_rate"] for r in runs]
        after = _mean_std(r["after"]["solve_rate"] for r in runs)
        delta = _mean_std(deltas)
        either = _mean_std(r["after"]["up_to_relabelling"] for r in runs)
        first = _mean_std(statistics.fmean(r["rewards"][:10]) for r in runs)
        last = _mean_std(statistics.fmean(r["rewards"][-10:]) for r in runs)
        seconds = statistics.fmean(r["train_seconds"] for r in runs)
        lines.append(
            f"| {label} | {len(runs)} | {before['solve_rate']:.3f} | {after[0]:.3f} ± {after[1]:.3f} | "
            f"**{delta[0]:+.3f} ± {delta[1]:.3f}** | [{', '.join(f'{d:+.2f}' for d in deltas)}] | "
            f"{before['up_to_relabelling']:.3f} → {either[0]:.3f} | {first[0]:.3f} → {last[0]:.3f} | {seconds:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    if len(arms) > 1:
        table += "".join("\n" + paired_markdown(store, toy) for toy in store["before"])
    return table


def main(argv=None) -> dict:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup = dict(steps=args.steps, learning_rate=args.learning_rate, reward=args.reward,
                 policy_estimator=args.policy_estimator, eval_size=args.eval_size, eval_seeds=args.eval_seeds,
                 self_conditioning_gradients=args.self_conditioning_gradients)
    store = dict(setup=setup, before={}, runs=[])
    start = time.perf_counter()
    for toy in args.toys:
        model, tokenizer = load(toy)
        store["before"][toy] = held_out(model, tokenizer, args)
        print(f"{toy}: before {store['before'][toy]['solve_rate']:.3f}", flush=True)
        for seed, gradient in ((seed, g) for seed in args.seeds for g in args.self_conditioning_gradients):
            result = run_one(toy, seed, args, gradient)
            store["runs"].append(result)
            (out / f"{args.name}.json").write_text(json.dumps(store, indent=1) + "\n")  # partial, run by run
            print(f"{toy} seed {seed} {gradient}: after {result['after']['solve_rate']:.3f} "
                  f"({result['train_seconds']:.0f} s training, {time.perf_counter() - start:.0f} s so far)", flush=True)
    store["wall_seconds"] = time.perf_counter() - start
    (out / f"{args.name}.json").write_text(json.dumps(store, indent=1) + "\n")
    table = markdown(store)
    (out / f"{args.name}_table.md").write_text(table)
    print("\n" + table)
    print(f"{store['wall_seconds']:.0f} s; wrote {out / (args.name + '.json')} and {out / (args.name + '_table.md')}")
    return store


if __name__ == "__main__":
    sys.exit(main() and 0)
