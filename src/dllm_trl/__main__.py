"""The main job: ``python -m dllm_trl`` trains the embedded Sudoku diffusion LM with RLDF on CPU.

It measures the held-out greedy solve rate of the shipped noisy-teacher 4×4 Sudoku checkpoint (pre-trained on answers
of which half exchange the digits 1 and 2, so it writes either convention), trains it with
:class:`~dllm_trl.RLDFTrainer` on the rule-checked reward, measures again, and writes the reward
curve (``reward_curve.png``), ``summary.json`` and TRL's full per-step metrics (``log_history.jsonl``) to
``--output_dir``. The console shows one progress bar (mean rollout reward, held-out solve rate when evaluated, seconds
per step) and a before/after line; ``--report_to tensorboard`` etc. send TRL's metrics to a tracker as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import time


MAIN_JOB_DEFAULTS = dict(
    max_steps=150, learning_rate=1e-4, num_generations=8, prompts_per_step=8, num_sampled_timesteps=4, beta=0.0,
    temperature=1.0, reward="cell",
)
"""The defaults of the main job's training flags (chosen by the learning-rate sweep in docs/main_job.md)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m dllm_trl",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def flag(name, **kwargs):  # TRL-style underscore flags; the hyphenated spelling stays as an alias
        parser.add_argument(f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else []), **kwargs)

    flag("output_dir", default="outputs/sudoku-rldf", help="Where the plot, summary, metrics and model go.")
    flag("model_name_or_path", default=None,
         help="Sudoku diffusion checkpoint to train (a folder written by scripts/pretrain_sudoku.py); "
         "default: the shipped noisy-teacher one (assets/sudoku_noisy_teacher).")
    flag("max_steps", type=int, default=MAIN_JOB_DEFAULTS["max_steps"], help="Optimizer steps.")
    flag("learning_rate", type=float, default=MAIN_JOB_DEFAULTS["learning_rate"], help="Constant learning rate.")
    flag("num_generations", type=int, default=MAIN_JOB_DEFAULTS["num_generations"],
         help="Completions per prompt (group size).")
    flag("prompts_per_step", type=int, default=MAIN_JOB_DEFAULTS["prompts_per_step"], help="Puzzles per step.")
    flag("num_sampled_timesteps", type=int, default=MAIN_JOB_DEFAULTS["num_sampled_timesteps"],
         help="k of weighted timestep sampling.")
    flag("beta", type=float, default=MAIN_JOB_DEFAULTS["beta"], help="k3-KL weight.")
    flag("temperature", type=float, default=MAIN_JOB_DEFAULTS["temperature"], help="Rollout sampling temperature.")
    flag("eval_size", type=int, default=200, help="Held-out puzzles for the greedy solve rate.")
    flag("reward", default=MAIN_JOB_DEFAULTS["reward"], choices=["cell", "solve"],
         help="Trained reward: 'cell' (d1's partial credit: share of blanks right in a grid keeping the givens) or "
         "'solve' (1 for a solved grid). Both are logged; the evaluation is always the greedy solve rate.")
    flag("eval_steps", type=int, default=50, help="Also evaluate every N steps (shown on the bar); 0 = only before/after.")
    flag("skip_eval", action="store_true", help="No evaluation at all (before, during or after training).")
    flag("seed", type=int, default=0, help="Random seed.")
    flag("report_to", default="none", help="TRL/transformers report backend(s), e.g. tensorboard, wandb.")
    flag("save_model", action="store_true", help="Also save the trained checkpoint to <output_dir>/model.")
    args = parser.parse_args(argv)
    for name in ("max_steps", "num_generations", "prompts_per_step", "num_sampled_timesteps", "eval_size"):
        if getattr(args, name) < 1 and not (name == "eval_size" and args.skip_eval):
            parser.error(f"--{name} must be ≥ 1 (got {getattr(args, name)}).")
    if args.eval_steps < 0:
        parser.error(f"--eval_steps must be ≥ 0 (got {args.eval_steps}).")
    return args


def _quiet_third_party_imports() -> None:
    """The job runs on CPU: DeepSpeed (imported by transformers' trainer) need not probe for an accelerator and warn,
    and bitsandbytes (imported by PEFT) need not warn that its optional CPU kernel package is missing."""
    import logging

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def moving_average(values, window=10):
    """Trailing mean over the last ``window`` values (shorter at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    _quiet_third_party_imports()
    import torch

    from .callbacks import RewardProgressBar
    from .toy import evaluate_accuracy, load_sudoku_noisy_teacher, sudoku_cell_reward, sudoku_dataset
    from .toy import sudoku_generation_config
    from .toy import sudoku_reward, sudoku_rldf_config
    from .trainers import RLDFTrainer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    os.makedirs(args.output_dir, exist_ok=True)
    model, tokenizer = load_sudoku_noisy_teacher(path=args.model_name_or_path)
    held_out = sudoku_dataset("test", size=args.eval_size) if not args.skip_eval else None
    eval_config = sudoku_generation_config()

    def solve_rate(policy) -> float:
        return evaluate_accuracy(policy, tokenizer, held_out, eval_config, batch_size=100, reward=sudoku_reward)[
            "accuracy"
        ]

    before = None if args.skip_eval else solve_rate(model)
    config = sudoku_rldf_config(
        args.output_dir,
        temperature=args.temperature,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_sampled_timesteps=args.num_sampled_timesteps,
        beta=args.beta,
        learning_rate=args.learning_rate,
        max_steps=args.max_steps,
        seed=args.seed,
        report_to=args.report_to,
        reward_weights=[1.0, 0.0] if args.reward == "solve" else [0.0, 1.0],
    )
    trainer = RLDFTrainer(
        model=model,
        reward_funcs=[sudoku_reward, sudoku_cell_reward],
        args=config,
        train_dataset=sudoku_dataset("train"),
        processing_class=tokenizer,
    )
    progress = RewardProgressBar(
        evaluate=None if args.skip_eval or args.eval_steps == 0 else solve_rate,
        eval_steps=args.eval_steps,
        metrics_path=os.path.join(args.output_dir, "log_history.jsonl"),
        initial_accuracy=before,
        shown={"solved": "rewards/sudoku_reward/mean"},
    )
    progress.install(trainer)
    train_start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_start
    after = None if args.skip_eval else solve_rate(trainer.model)

    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    plot_path = os.path.join(args.output_dir, "reward_curve.png")
    _plot(rewards, progress.accuracies, before, after, plot_path)
    total_seconds = time.perf_counter() - start
    summary = {
        "accuracy_before": before,
        "accuracy_after": after,
        "eval_size": None if args.skip_eval else args.eval_size,
        "accuracy_during_training": progress.accuracies,
        "train_seconds": train_seconds,
        "total_seconds": total_seconds,
        "steps": trainer.state.global_step,
        "rewards": rewards,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output_dir", "save_model")},
    }
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if args.save_model:
        trainer.save_model(os.path.join(args.output_dir, "model"))
    first = sum(rewards[:10]) / max(len(rewards[:10]), 1)
    last = sum(rewards[-10:]) / max(len(rewards[-10:]), 1)
    result = (
        "evaluation skipped"
        if args.skip_eval
        else f"held-out greedy solve rate {before:.3f} → {after:.3f} ({after - before:+.3f}, {args.eval_size} puzzles)"
    )
    print(
        f"{result}; mean rollout reward {first:.3f} (first 10 steps) → {last:.3f} (last 10); "
        f"{trainer.state.global_step} steps in {_minutes(train_seconds)}, {_minutes(total_seconds)} in all.\n"
        f"Wrote {plot_path}, summary.json and log_history.jsonl to {args.output_dir}."
    )
    return summary


def _plot(rewards, accuracies, accuracy_before, accuracy_after, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    steps = range(1, len(rewards) + 1)
    ax.plot(steps, rewards, alpha=0.3, label="mean rollout reward (temperature 1)")
    ax.plot(steps, moving_average(rewards), linewidth=2, label="moving average (10 steps)")
    points = ([(0, accuracy_before)] if accuracy_before is not None else []) + [
        (step, acc) for step, acc in accuracies
    ]
    if accuracy_after is not None:
        points.append((len(rewards), accuracy_after))
    if points:
        ax.plot([s for s, _ in points], [a for _, a in points], "o-", color="black", label="held-out greedy solve rate")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / solve rate")
    ax.set_ylim(-0.02, 1.02)
    title = "RLDF on 4×4 Sudoku (toy diffusion LM)"
    if accuracy_before is not None:
        title += f": solve rate {accuracy_before:.2f} → {accuracy_after:.2f}"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
