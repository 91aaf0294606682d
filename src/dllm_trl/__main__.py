"""The main job: ``python -m dllm_trl`` trains the embedded Sudoku diffusion LM with RLDF on CPU.

It measures the held-out greedy solve rate of the shipped noisy-teacher 4×4 Sudoku checkpoint (pre-trained on answers
of which half exchange the digits 1 and 2, so it writes either convention), trains it with
:class:`~dllm_trl.RLDFTrainer` on the rule-checked reward, measures again, and writes the reward
curve (``reward_curve.png``), ``summary.json`` and TRL's full per-step metrics (``log_history.jsonl``) to
``--output_dir``. The console shows one progress bar (mean rollout reward, held-out solve rate when evaluated, seconds
per step) and a before/after line; ``--report_to tensorboard`` etc. send TRL's metrics to a tracker as usual.

The command line is TRL's ``TrlParser`` over the job's own flags (:class:`MainJobArguments`),
:class:`~dllm_trl.RLDFConfig` and TRL's ``ModelConfig``, so every TRL / transformers training flag (``--save_steps``,
``--resume_from_checkpoint`` …), the model flags (``--model_name_or_path`` (a folder or a Hub name), ``--use_peft``,
``--lora_r``, ``--load_in_4bit`` …), the hyphenated spellings (``--max-steps``) and ``--config job.yaml`` work as in
TRL's scripts. Unless a flag (or the YAML file) says otherwise the job trains at :func:`main_job_settings`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

OUTPUT_DIR = "outputs/sudoku-rldf"
REWARD_WEIGHTS = {"solve": [1.0, 0.0], "cell": [0.0, 1.0]}
"""``reward_weights`` of ``[sudoku_reward, sudoku_cell_reward]`` that each ``--reward`` trains on."""
SETTINGS = ("model_name_or_path", "max_steps", "learning_rate", "num_generations", "prompts_per_step",
            "num_sampled_timesteps", "beta", "temperature", "eval_size", "reward", "eval_steps", "skip_eval", "seed",
            "report_to")
"""What ``summary.json`` records of the run's flags."""


def main_job_settings() -> dict:
    """The training arguments at which ``python -m dllm_trl`` runs when no flag says otherwise: the Sudoku toy's RLDF
    settings (:func:`~dllm_trl.toy.sudoku_rldf_settings`, from the learning-rate sweep in docs/main_job.md), seed 0,
    the held-out solve rate every 50 steps, and a batch of ``num_generations`` × ``prompts_per_step`` completions."""
    from .toy import sudoku_rldf_settings

    return sudoku_rldf_settings(OUTPUT_DIR, seed=0, eval_steps=50, per_device_train_batch_size=None)


@dataclass
class MainJobArguments:
    """The main job's own flags; every training flag is :class:`~dllm_trl.RLDFConfig`'s (TRL's and transformers')."""

    prompts_per_step: int = field(
        default=8,
        metadata={"help": "Puzzles per step: the batch is num_generations × prompts_per_step completions (a "
                          "--per_device_train_batch_size given as well wins)."},
    )
    eval_size: int = field(default=200, metadata={"help": "Held-out puzzles for the greedy solve rate."})
    reward: str = field(
        default="cell",
        metadata={"help": "Trained reward: 'cell' (d1's partial credit: share of blanks right in a grid keeping the "
                          "givens) or 'solve' (1 for a solved grid), i.e. reward_weights (a --reward_weights given as "
                          "well wins). Both are logged; the evaluation is always the greedy solve rate.",
                  "choices": sorted(REWARD_WEIGHTS)},
    )
    skip_eval: bool = field(
        default=False, metadata={"help": "No evaluation at all (before, during or after training)."}
    )
    save_model: bool = field(default=False, metadata={"help": "Also save the trained checkpoint to <output_dir>/model."})
    threads: int | None = field(
        default=None,
        metadata={"help": "torch CPU threads; default: OMP_NUM_THREADS when set, else the cores that the machine's "
                          "load (1-minute average) leaves free, at least 1 (see fair_threads)."},
    )


HELP = {
    "model_name_or_path": "Sudoku diffusion checkpoint to train: a folder (e.g. written by scripts/toy_pretraining.py) "
                          "or a Hub name; default: the shipped noisy-teacher one (assets/sudoku_noisy_teacher).",
    "output_dir": "Where the plot, summary, metrics (and with --save_model the model) go.",
    "eval_steps": "Also evaluate the held-out solve rate every N steps (shown on the bar); 0 = only before/after.",
    "per_device_train_batch_size": "Completions per step; unset: num_generations × prompts_per_step.",
}
"""Help of the RLDFConfig flags that the job reads in its own way."""


def _resolve(parser, args) -> None:
    """Check the parsed flags and fill in the RLDFConfig fields that the job's own flags name: the batch from
    ``--prompts_per_step``, the reward weights from ``--reward`` (unless those fields are given themselves)."""
    at_least_one = ["max_steps", "num_generations", "prompts_per_step", "num_sampled_timesteps"]
    for name in at_least_one + ([] if args.skip_eval else ["eval_size"]):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be ≥ 1 (got {getattr(args, name)}).")
    if args.eval_steps is None or args.eval_steps < 0 or args.eval_steps != int(args.eval_steps):
        parser.error(f"--eval_steps must be a whole number ≥ 0 (got {args.eval_steps}).")
    args.eval_steps = int(args.eval_steps)
    if args.per_device_train_batch_size is None:
        args.per_device_train_batch_size = args.num_generations * args.prompts_per_step
    elif args.per_device_train_batch_size % args.num_generations:
        parser.error(f"--per_device_train_batch_size {args.per_device_train_batch_size} is not a whole number of "
                     f"puzzles × --num_generations {args.num_generations}.")
    else:
        args.prompts_per_step = args.per_device_train_batch_size // args.num_generations
    if args.reward_weights is None:
        args.reward_weights = REWARD_WEIGHTS[args.reward]
    else:  # the reward that the given weights train on, if it has a name
        args.reward = next((name for name, w in REWARD_WEIGHTS.items() if w == list(args.reward_weights)), None)


def main_job_parser():
    """TRL's ``TrlParser`` over :class:`MainJobArguments` and :class:`~dllm_trl.RLDFConfig`: every TRL / transformers
    training flag and ``--config job.yaml`` work as in TRL's scripts, the defaults are :func:`main_job_settings`, a
    YAML config overrides them and the command line overrides both."""
    from trl import ModelConfig, TrlParser

    from .trainers import RLDFConfig

    class MainJobParser(TrlParser):
        def parse_known_args(self, args=None, namespace=None):
            namespace, extras = super().parse_known_args(args, namespace)
            _resolve(self, namespace)
            return namespace, extras

    parser = MainJobParser((MainJobArguments, RLDFConfig, ModelConfig), prog="python -m dllm_trl",
                           description=__doc__.split("\n\n")[0])
    parser.set_defaults(**main_job_settings())
    # TrlParser reads --config itself, before argparse: listed here so that --help shows it.
    parser.add_argument("--config", metavar="YAML", default=argparse.SUPPRESS, help="YAML file of flag values (TRL's --config): they replace the "
                        "defaults, and flags on the command line replace them.")
    for action in parser._actions:
        action.help = HELP.get(action.dest, action.help)
    return parser


def parse_args(argv=None):
    """``(MainJobArguments, RLDFConfig, ModelConfig)`` of the command line ``argv`` (default: ``sys.argv[1:]``)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the job runs on CPU: DeepSpeed need not probe for a GPU
    args, config, model_args = main_job_parser().parse_args_and_config(argv)
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"error: --threads must be ≥ 1 (got {args.threads}).")
    return args, config, model_args


def fair_threads() -> int:
    """The job's default torch thread count: ``OMP_NUM_THREADS`` when set; otherwise the cores this process may run on
    less the machine's 1-minute load average, at least 1. The toy's matmuls are tiny, so a thread that has to wait for
    a core held by another process stalls every step (docs/main_job.md has the timings, alone and beside a busy
    process)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cores, cores - round(load)))


def moving_average(values, window=10):
    """Trailing mean over the last ``window`` values (shorter at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _settings(args: MainJobArguments, config, model_args) -> dict:
    """The :data:`SETTINGS` of this run, from the job's flags, the trainer's config and the model flags
    (``report_to`` as given)."""
    values = {name: next(getattr(source, name) for source in (args, model_args, config) if hasattr(source, name))
              for name in SETTINGS}
    return {**values, "use_peft": model_args.use_peft, "report_to": " ".join(config.report_to) or "none"}


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def main(argv=None) -> dict:
    start = time.perf_counter()
    args, config, model_args = parse_args(argv)
    from .prechecks import check_run_setup

    check_run_setup(config)  # before anything loads: one line, not a traceback minutes in
    from .trainers.safe_runs import OutputDirInUseError, acquire_output_dir, release_output_dir

    try:  # the whole job, not only training, is the one run writing to output_dir
        acquire_output_dir(config.output_dir)
    except OutputDirInUseError as error:
        raise SystemExit(f"error: {error}") from None
    try:
        return _run(args, config, model_args, start)
    finally:
        release_output_dir(config.output_dir)


def _run(args, config, model_args, start) -> dict:
    import torch
    from trl import get_peft_config

    from .callbacks import RewardProgressBar
    from .families import load_model_and_tokenizer
    from .toy import evaluate_accuracy, sudoku_cell_reward, sudoku_dataset, toy_assets_dir
    from .toy import sudoku_generation_config, sudoku_reward
    from .trainers import RLDFTrainer
    from .trainers.safe_runs import TrainingInterrupted

    torch.set_num_threads(args.threads if args.threads is not None else fair_threads())
    os.makedirs(config.output_dir, exist_ok=True)
    if model_args.model_name_or_path is None:
        model_args.model_name_or_path = str(toy_assets_dir("sudoku_noisy_teacher"))
    model, tokenizer = load_model_and_tokenizer(model_args)
    held_out = sudoku_dataset("test", size=args.eval_size) if not args.skip_eval else None
    eval_config = sudoku_generation_config()

    def solve_rate(policy) -> float:
        return evaluate_accuracy(policy, tokenizer, held_out, eval_config, batch_size=100, reward=sudoku_reward)[
            "accuracy"
        ]

    before = None if args.skip_eval else solve_rate(model)
    trainer = RLDFTrainer(
        model=model,
        reward_funcs=[sudoku_reward, sudoku_cell_reward],
        args=config,
        train_dataset=sudoku_dataset("train"),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    progress = RewardProgressBar(
        evaluate=None if args.skip_eval or config.eval_steps == 0 else solve_rate,
        eval_steps=config.eval_steps,
        metrics_path=os.path.join(config.output_dir, "log_history.jsonl"),
        initial_accuracy=before,
        shown={"solved": "rewards/sudoku_reward/mean"},
    )
    progress.install(trainer)
    train_start = time.perf_counter()
    interrupted = None
    try:
        trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    except TrainingInterrupted as stop:  # saved; the summary says so, then the job exits as SIGTERM asked
        interrupted = stop
    train_seconds = time.perf_counter() - train_start
    after = None if args.skip_eval or interrupted else solve_rate(trainer.model)

    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    plot_path = os.path.join(config.output_dir, "reward_curve.png")
    _plot(rewards, progress.accuracies, before, after, plot_path)
    total_seconds = time.perf_counter() - start
    summary = {
        "status": "interrupted" if interrupted else "finished",
        "resumed_from": trainer.resumed_from,
        "accuracy_before": before,
        "accuracy_after": after,
        "eval_size": None if args.skip_eval else args.eval_size,
        "accuracy_during_training": progress.accuracies,
        "train_seconds": train_seconds,
        "total_seconds": total_seconds,
        "steps": trainer.state.global_step,
        "rewards": rewards,
        "settings": _settings(args, config, model_args),
    }
    with open(os.path.join(config.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if interrupted:
        print(f"{interrupted} summary.json (status: interrupted) and log_history.jsonl are in {config.output_dir}.",
              file=sys.stderr, flush=True)
        raise SystemExit(interrupted.code)
    if args.save_model:
        trainer.save_model(os.path.join(config.output_dir, "model"))
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
        f"Wrote {plot_path}, summary.json and log_history.jsonl to {config.output_dir}."
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
    if accuracy_before is not None:  # an interrupted run stops before its final evaluation
        after = "(interrupted)" if accuracy_after is None else f"{accuracy_after:.2f}"
        title += f": solve rate {accuracy_before:.2f} → {after}"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
