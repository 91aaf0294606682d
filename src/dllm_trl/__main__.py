"""The main job: ``python -m dllm_trl`` trains the embedded toy diffusion LM with RLDF on CPU.

It measures greedy held-out accuracy of the shipped checkpoint, trains with :class:`RLDFTrainer` on the
toy arithmetic task, measures again, prints the reward curve and writes it as a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def parse_args(argv=None):
    """TRL-style underscore flags (``--output_dir``); the hyphenated spellings (``--output-dir``) are aliases."""
    parser = argparse.ArgumentParser(prog="python -m dllm_trl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def flag(name, **kwargs):
        names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*names, **kwargs)

    flag("output_dir", default="outputs/toy-rldf", help="Where the log, summary.json, the plot and the model go.")
    flag("max_steps", type=int, default=60, help="Optimizer steps.")
    flag("learning_rate", type=float, default=3e-5, help="AdamW learning rate.")
    flag("num_generations", type=int, default=8, help="Completions per prompt (group size).")
    flag("prompts_per_step", type=int, default=4, help="Prompts per optimizer step.")
    flag("num_sampled_timesteps", type=int, default=4, help="k of weighted timestep sampling.")
    flag("beta", type=float, default=0.0, help="k3-KL weight.")
    flag("temperature", type=float, default=1.0, help="Rollout sampling temperature.")
    flag("eval_size", type=int, default=200, help="Held-out problems for greedy accuracy.")
    flag("skip_eval", action="store_true", help="Skip the greedy evaluations before and after training.")
    flag("seed", type=int, default=0, help="Random seed.")
    flag("save_model", action="store_true", help="Also save the trained checkpoint to OUTPUT_DIR/model.")
    args = parser.parse_args(argv)
    if args.eval_size < 1 and not args.skip_eval:
        parser.error(f"--eval_size={args.eval_size} must be at least 1 (or pass --skip_eval).")
    return args


def moving_average(values, window=10):
    """Trailing mean over the last ``window`` values (shorter at the start)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def ascii_curve(values, width=60, height=10) -> str:
    """A small text plot of ``values`` (one column per step, resampled to ``width``)."""
    if not values:
        return "(no values)"
    step = max(1, len(values) // width)
    points = [sum(values[i : i + step]) / len(values[i : i + step]) for i in range(0, len(values), step)]
    low, high = min(points), max(points)
    span = (high - low) or 1.0
    rows = []
    for level in range(height, -1, -1):
        threshold = low + span * level / height
        line = "".join("█" if p >= threshold else " " for p in points)
        rows.append(f"{threshold:6.3f} |{line}")
    rows.append("       +" + "-" * len(points))
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from .toy import evaluate_accuracy, load_toy, toy_dataset, toy_generation_config, toy_reward
    from .cli import toy_rldf_config
    from .trainers import RLDFTrainer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    os.makedirs(args.output_dir, exist_ok=True)
    model, tokenizer = load_toy()
    held_out = toy_dataset("test", size=args.eval_size)
    eval_config = toy_generation_config()

    def evaluate(policy, label):
        if args.skip_eval:
            return {"accuracy": None}
        result = evaluate_accuracy(policy, tokenizer, held_out, generation_config=eval_config)
        if label:
            print(f"[{label}] held-out greedy accuracy {result['accuracy']:.3f} ({result['tokens_per_second']:.0f} tokens/s)")
        return result

    before = evaluate(model, "before")

    config = toy_rldf_config(
        args.output_dir,
        temperature=args.temperature,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_sampled_timesteps=args.num_sampled_timesteps,
        beta=args.beta,
        learning_rate=args.learning_rate,
        max_steps=args.max_steps,
        seed=args.seed,
        disable_tqdm=False,
    )
    trainer = RLDFTrainer(
        model=model,
        reward_funcs=toy_reward,
        args=config,
        train_dataset=toy_dataset("train"),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    after = evaluate(trainer.model, None)

    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    rewards = [entry["reward"] for entry in logs]
    print(f"\nmean rollout reward (temperature {args.temperature}), moving average over 10 steps:")
    print(ascii_curve(moving_average(rewards)))
    plot_path = os.path.join(args.output_dir, "reward_curve.png")
    _plot(rewards, before["accuracy"], after["accuracy"], plot_path)
    summary = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "train_seconds": train_seconds,
        "steps": args.max_steps,
        "rewards": rewards,
    }
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if args.save_model:
        trainer.save_model(os.path.join(args.output_dir, "model"))
    result = "evaluation skipped" if args.skip_eval else (
        f"held-out greedy accuracy {after['accuracy']:.3f} (was {before['accuracy']:.3f})")
    print(f"\n[after]  {result}; trained {args.max_steps} steps in {train_seconds:.0f} s; plot: {plot_path}")
    return summary


def _plot(rewards, accuracy_before, accuracy_after, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(rewards) + 1)
    ax.plot(steps, rewards, alpha=0.35, label="mean rollout reward")
    ax.plot(steps, moving_average(rewards), linewidth=2, label="moving average (10 steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title("RLDF on the toy task" + ("" if accuracy_before is None else
                                           f": greedy accuracy {accuracy_before:.2f} → {accuracy_after:.2f}"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
