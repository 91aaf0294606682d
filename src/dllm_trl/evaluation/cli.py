"""The evaluation's command line, ``python -m dllm_trl.evaluation``: TRL's ``TrlParser`` over
:class:`EvaluationArguments` and TRL's ``ModelConfig`` (``--config x.yaml`` works as in TRL's scripts)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..data import load_raw_dataset, prepare_dataset, resolve_format, task_reward
from ..toy import toy_assets_dir, toy_dataset, toy_reward
from .metrics import check_sampling
from .reports import markdown_tables, write_results
from .runner import PAPER_GEN_LENGTHS, TOY_GEN_LENGTHS, evaluate_model
from .tasks import EvalTask


DESCRIPTION = (
    "Paper 1's accuracy grid: math and code sets decoded at several generation lengths with dynamic and static "
    "unmasking (accuracy, pass@k, tokens/s, forwards). For standard benchmarks scored as everyone else scores them "
    "(any lm-eval task: gsm8k, minerva_math, humaneval, ifeval, your own YAML tasks), use EleutherAI's "
    "lm-evaluation-harness instead: python -m dllm_trl.evaluation.lm_eval --model_args pretrained=PATH --tasks gsm8k "
    "(the eval extra: pip install -e '.[eval]')."
)


@dataclass
class EvaluationArguments:
    """What to evaluate and how to decode; the model comes from TRL's ``ModelConfig`` flags."""

    datasets: list[str] | None = field(
        default=None,
        metadata={
            "help": "Local json/jsonl/parquet/csv files or folders, presets (gsm8k, math, math500, mbpp, humaneval: "
            "from the Hub), Hub datasets, or 'toy'. Default: 'toy' with the toy model, else gsm8k math500 "
            "humaneval mbpp. Set HF_HUB_OFFLINE=1 to never contact the Hub (only local files and the Hub cache)."
        },
    )
    split: str = field(default="test", metadata={"help": "Split of Hub datasets."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration of Hub datasets."})
    dataset_layout: str | None = field(
        default=None, metadata={"help": "Column layout of every dataset (default: detect)."}
    )
    num_problems: int | None = field(default=None, metadata={"help": "Evaluate the first N problems of each dataset."})
    gen_lengths: list[int] | None = field(
        default=None, metadata={"help": "Generation lengths (default: 128 256 512; toy model: 4 8 16)."}
    )
    unmasking: list[str] = field(default_factory=lambda: ["dynamic", "static"], metadata={"help": "Unmasking modes."})
    block_length: int | None = field(default=None, metadata={"help": "Block length (default: 32; toy model: 4)."})
    threshold: float = field(default=0.9, metadata={"help": "Confidence threshold of dynamic unmasking."})
    tokens_per_step: int = field(default=1, metadata={"help": "Static unmasking: tokens committed per step."})
    cache_mode: str = field(default="dual", metadata={"help": "KV cache: none, prefix or dual."})
    num_samples: int = field(
        default=1, metadata={"help": "Completions per problem: 1 = greedy; more need --temperature > 0 (pass@k)."}
    )
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature (0 = greedy)."})
    pass_at_k: list[int] | None = field(
        default=None,
        metadata={"help": "k of the pass@k scores, each ≤ --num_samples (default with samples: 1 and num_samples)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the sampling draws (with --temperature > 0)."})
    batch_size: int = field(default=16, metadata={"help": "Prompts decoded together."})
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message before each prompt."})
    device: str | None = field(default=None, metadata={"help": "Device (default: cuda when available, else cpu)."})
    output_dir: str = field(default="outputs/eval", metadata={"help": "Where results.{json,md,png} go."})
    plot: bool = field(default=True, metadata={"help": "Also draw results.png."})

    def __post_init__(self):
        # Asking for a length or mode twice evaluates it once.
        for name in ("datasets", "gen_lengths", "unmasking", "pass_at_k"):
            if getattr(self, name) is not None:
                setattr(self, name, list(dict.fromkeys(getattr(self, name))))
        if self.pass_at_k is None:
            self.pass_at_k = sorted({1, self.num_samples}) if self.num_samples > 1 else []
        check_sampling(self.num_samples, self.temperature, self.pass_at_k)


def build_tasks(args: EvaluationArguments, toy_model: bool) -> list[EvalTask]:
    """One :class:`EvalTask` per ``--datasets`` entry."""
    tasks = []
    for source in args.datasets or (["toy"] if toy_model else ["gsm8k", "math500", "humaneval", "mbpp"]):
        if source == "toy":
            tasks.append(EvalTask("toy", toy_dataset("test", size=args.num_problems), toy_reward))
            continue
        raw = load_raw_dataset(source, split=args.split, config=args.dataset_config)
        if args.num_problems is not None:
            raw = raw.select(range(min(args.num_problems, len(raw))))
        fmt = resolve_format(source, raw, args.dataset_layout)
        name = os.path.splitext(os.path.basename(os.path.normpath(source)))[0] if os.path.exists(source) else source
        dataset = prepare_dataset(raw, fmt, system_prompt=args.system_prompt)
        tasks.append(EvalTask(name, dataset, task_reward(fmt.task)))
    return tasks


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse the command line, evaluate, write the reports and print the score table."""
    from trl import ModelConfig, TrlParser

    from ..families import load_model_and_tokenizer
    from ..prechecks import check_output_dir

    parser = TrlParser((EvaluationArguments, ModelConfig), description=DESCRIPTION)
    args, model_args = parser.parse_args_and_config(args=argv)
    check_output_dir(args)  # the reports go there: a folder it cannot write is said before any work
    toy_model = model_args.model_name_or_path is None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen_lengths = args.gen_lengths or list(TOY_GEN_LENGTHS if toy_model else PAPER_GEN_LENGTHS)
    block_length = args.block_length or (4 if toy_model else 32)

    try:  # the data first: a missing file or an unreachable Hub should not wait for the model to load
        tasks = build_tasks(args, toy_model)
    except (ConnectionError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    if toy_model:  # no model named: the shipped toy checkpoint
        model_args.model_name_or_path = str(toy_assets_dir())
    model, tokenizer = load_model_and_tokenizer(model_args, device)
    torch.manual_seed(args.seed)
    results = evaluate_model(
        model, tokenizer, tasks, gen_lengths, args.unmasking, block_length, args.threshold, args.tokens_per_step,
        args.cache_mode, args.batch_size, num_samples=args.num_samples, temperature=args.temperature,
        pass_at=args.pass_at_k,
    )
    settings = dict(
        model="toy" if toy_model else model_args.model_name_or_path, datasets=[t.name for t in tasks],
        gen_lengths=gen_lengths,
        unmasking=list(args.unmasking), block_length=block_length, threshold=args.threshold,
        tokens_per_step=args.tokens_per_step, cache_mode=args.cache_mode,
        decoding="greedy" if args.temperature == 0 else f"temperature {args.temperature}",
        num_samples=args.num_samples, pass_at_k=args.pass_at_k, seed=args.seed, device=device,
    )
    paths = write_results(results, args.output_dir, settings, plot=args.plot)
    print(markdown_tables(results["cells"]))
    print("wrote " + ", ".join(paths.values()))
    return {**results, "paths": paths, "settings": settings}

