"""Accuracy of a diffusion LM on math and code sets across generation lengths and unmasking modes.

Paper 1's protocol (Table 2 / Table 3): greedy decoding at generation lengths 128, 256 and 512, block-wise with
blocks of 32, dynamic unmasking (threshold 0.9) and static unmasking (one token per step); math scored by the
last ``\\boxed{}`` (:func:`~dllm_trl.rewards.math_reward`), code by the unit tests of the last ```` ```python ````
block (:func:`~dllm_trl.rewards.code_reward`, accuracy = all tests pass). Each (dataset, length, mode) cell also
reports decoding speed (completion tokens per second of sampler time) and forwards per problem (NFE).

::

    python -m dllm_trl.evaluation                 # the toy model on the toy test split (CPU, seconds)
    python examples/evaluate.py --model_name_or_path GSAI-ML/LLaDA-8B-Instruct --dtype bfloat16 \\
        --datasets gsm8k math500 humaneval mbpp --output_dir eval/llada-8b-instruct

Writes ``results.json`` (with :func:`evaluate.save`'s provenance fields), ``results.md`` (Markdown tables),
``results.png`` (accuracy and speed against generation length) and ``completions.jsonl`` (every decoded
completion with its reward) to ``--output_dir``. Model flags are TRL's ``ModelConfig`` (``--load_in_4bit``
etc.); a PEFT adapter folder as ``--model_name_or_path`` is loaded on top of its base model.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import datasets
import evaluate
import torch
from tqdm.auto import tqdm
from trl import ModelConfig, TrlParser

from .data import load_raw_dataset, prepare_dataset, resolve_format, task_reward
from .generation import DiffusionGenerationConfig, diffusion_generate
from .cli import load_model_and_tokenizer
from .toy import decode_completions, encode_prompts, toy_dataset, toy_reward

PAPER_GEN_LENGTHS = (128, 256, 512)
TOY_GEN_LENGTHS = (4, 8, 16)
"""Toy counterpart of 128/256/512: half, equal to and twice the length the toy model was trained at."""


class TaskAccuracy(evaluate.Metric):
    """Accuracy (reward 1: correct answer / every test passed) and mean reward (code: mean pass rate) of
    per-problem rewards in [0, 1]. Defined here because ``evaluate.load`` fetches metric scripts from the Hub."""

    def _info(self):
        return evaluate.MetricInfo(
            description=self.__doc__,
            citation="",
            inputs_description="rewards: one float in [0, 1] per problem.",
            features=datasets.Features({"rewards": datasets.Value("float64")}),
        )

    def _compute(self, rewards):
        n = len(rewards)
        return {
            "accuracy": sum(r >= 1.0 for r in rewards) / n if n else float("nan"),
            "mean_reward": sum(rewards) / n if n else float("nan"),
        }


@dataclass
class EvalTask:
    """A prepared dataset (``prompt`` + reward columns) and the TRL-style reward that scores it."""

    name: str
    dataset: datasets.Dataset
    reward_func: Callable[..., list[float]]

    def score(self, completions: list[str]) -> list[float]:
        columns = {c: list(self.dataset[c]) for c in self.dataset.column_names if c != "prompt"}
        return [float(r) for r in self.reward_func(completions, **columns)]


def decode(
    model, tokenizer, prompts: Sequence, config: DiffusionGenerationConfig, batch_size: int, desc: str | None = None
):
    """Decode every prompt with :func:`diffusion_generate`; batches group prompts of similar length.

    Returns ``completions`` (in the order of ``prompts``), ``tokens`` (completion tokens up to and including
    EOS), ``seconds`` (sampler time), ``nfe`` (forwards, all batches) and ``nfe_per_problem`` (forwards each
    problem went through, averaged).
    """
    device = model.get_input_embeddings().weight.device
    lengths = [len(p) if isinstance(p, str) else sum(len(m["content"]) for m in p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])
    completions: list[str | None] = [None] * len(prompts)
    tokens, seconds, nfe, problem_forwards = 0, 0.0, 0, 0
    was_training = model.training
    model.eval()
    with tqdm(total=len(prompts), desc=desc, unit="problem", disable=desc is None) as bar, torch.no_grad():
        for begin in range(0, len(order), batch_size):
            rows = order[begin : begin + batch_size]
            input_ids, attention_mask = encode_prompts(tokenizer, [prompts[i] for i in rows])
            start = time.perf_counter()
            out = diffusion_generate(model, input_ids.to(device), attention_mask.to(device), config)
            mask = out.completion_mask.cpu()
            seconds += time.perf_counter() - start
            for i, text in zip(rows, decode_completions(tokenizer, out.completion_ids.cpu(), mask)):
                completions[i] = text
            tokens += int(mask.sum())
            nfe += out.nfe
            problem_forwards += out.nfe * len(rows)
            bar.update(len(rows))
    model.train(was_training)
    return dict(
        completions=completions,
        tokens=tokens,
        seconds=seconds,
        nfe=nfe,
        nfe_per_problem=problem_forwards / max(len(prompts), 1),
    )


def generation_config(gen_length: int, unmasking: str, block_length: int = 32, threshold: float = 0.9,
                      tokens_per_step: int = 1, cache: str = "dual") -> DiffusionGenerationConfig:
    """Greedy decoding settings of one cell; blocks never exceed the generation length."""
    block = min(block_length, gen_length)
    steps = gen_length // tokens_per_step if unmasking == "static" else None
    return DiffusionGenerationConfig(
        gen_length=gen_length, block_length=block, unmasking=unmasking, threshold=threshold, steps=steps,
        temperature=0.0, cache=cache,
    )


def evaluate_model(
    model,
    tokenizer,
    tasks: Sequence[EvalTask],
    gen_lengths: Sequence[int] = PAPER_GEN_LENGTHS,
    unmasking: Sequence[str] = ("dynamic", "static"),
    block_length: int = 32,
    threshold: float = 0.9,
    tokens_per_step: int = 1,
    cache: str = "dual",
    batch_size: int = 16,
    progress: bool = True,
) -> dict:
    """Decode and score every task at every (generation length, unmasking mode).

    Returns ``{"cells": [...], "completions": [...]}``: one cell per (task, length, mode) with ``accuracy``,
    ``mean_reward``, ``num_problems``, ``tokens_per_second``, ``nfe``, ``nfe_per_problem`` and ``seconds``; one
    completion record per (cell, problem) with its ``reward``.
    """
    cells, records = [], []
    for task in tasks:
        prompts = list(task.dataset["prompt"])
        for gen_length in gen_lengths:
            for mode in unmasking:
                config = generation_config(gen_length, mode, block_length, threshold, tokens_per_step, cache)
                desc = f"{task.name} · length {gen_length} · {mode}" if progress else None
                out = decode(model, tokenizer, prompts, config, batch_size, desc)
                rewards = task.score(out["completions"])
                metric = TaskAccuracy(keep_in_memory=True)
                metric.add_batch(rewards=rewards)
                cell = dict(
                    dataset=task.name,
                    gen_length=gen_length,
                    unmasking=mode,
                    **metric.compute(),
                    num_problems=len(prompts),
                    tokens_per_second=out["tokens"] / out["seconds"] if out["seconds"] > 0 else float("nan"),
                    nfe=out["nfe"],
                    nfe_per_problem=out["nfe_per_problem"],
                    seconds=out["seconds"],
                )
                cells.append(cell)
                records += [
                    dict(dataset=task.name, gen_length=gen_length, unmasking=mode, index=i, completion=c, reward=r)
                    for i, (c, r) in enumerate(zip(out["completions"], rewards))
                ]
    return {"cells": cells, "completions": records}


# ------------------------------------------------------------------------------------------------ reports
def markdown_tables(cells: Sequence[dict]) -> str:
    """Accuracy (%) per dataset and mode across generation lengths (the paper's table layout), then speed."""
    lengths = sorted({c["gen_length"] for c in cells})
    lines = [
        "| dataset | unmasking | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|---|" + "---:|" * len(lengths),
    ]
    rows = dict.fromkeys((c["dataset"], c["unmasking"]) for c in cells)
    for dataset, mode in rows:
        by_length = {c["gen_length"]: c for c in cells if (c["dataset"], c["unmasking"]) == (dataset, mode)}
        values = [f"{100 * by_length[n]['accuracy']:.1f}" if n in by_length else "–" for n in lengths]
        lines.append(f"| {dataset} | {mode} | " + " | ".join(values) + " |")
    lines += [
        "",
        "| dataset | unmasking | length | accuracy | mean reward | problems | tokens/s | NFE / problem | seconds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c['dataset']} | {c['unmasking']} | {c['gen_length']} | {100 * c['accuracy']:.1f} | "
            f"{c['mean_reward']:.3f} | {c['num_problems']} | {c['tokens_per_second']:.1f} | "
            f"{c['nfe_per_problem']:.1f} | {c['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot_results(cells: Sequence[dict], path: str) -> None:
    """Accuracy (top) and tokens/s (bottom) against generation length, one column per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c["dataset"] for c in cells))
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6), squeeze=False, sharex="col")
    for column, name in enumerate(names):
        for mode in dict.fromkeys(c["unmasking"] for c in cells):
            points = sorted((c["gen_length"], c) for c in cells if c["dataset"] == name and c["unmasking"] == mode)
            if not points:
                continue
            x = [n for n, _ in points]
            axes[0, column].plot(x, [100 * c["accuracy"] for _, c in points], marker="o", label=mode)
            axes[1, column].plot(x, [c["tokens_per_second"] for _, c in points], marker="o", label=mode)
        axes[0, column].set_title(name)
        axes[0, column].set_ylim(-2, 102)
        axes[0, column].set_ylabel("accuracy (%)")
        axes[1, column].set_ylabel("tokens / s")
        axes[1, column].set_xlabel("generation length")
        for ax in axes[:, column]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({c["gen_length"] for c in cells}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(results: dict, output_dir: str, settings: dict | None = None) -> dict:
    """``results.json``, ``results.md``, ``results.png`` and ``completions.jsonl`` in ``output_dir``; returns
    their paths."""
    os.makedirs(output_dir, exist_ok=True)
    names = ("results.json", "results.md", "results.png", "completions.jsonl")
    paths = {name: os.path.join(output_dir, name) for name in names}
    evaluate.save(paths["results.json"], cells=results["cells"], settings=settings or {})
    with open(paths["results.md"], "w") as f:
        f.write(markdown_tables(results["cells"]))
    plot_results(results["cells"], paths["results.png"])
    with open(paths["completions.jsonl"], "w") as f:
        for record in results["completions"]:
            f.write(json.dumps(record) + "\n")
    return paths


# ------------------------------------------------------------------------------------------------ CLI
@dataclass
class EvaluationArguments:
    """What to evaluate and how to decode; the model comes from TRL's ``ModelConfig`` flags."""

    datasets: list[str] | None = field(
        default=None,
        metadata={
            "help": "Presets (gsm8k, math, math500, mbpp, humaneval), local json/jsonl/parquet/csv files, Hub "
            "datasets, or 'toy'. Default: 'toy' with the toy model, else gsm8k math500 humaneval mbpp."
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
    batch_size: int = field(default=16, metadata={"help": "Prompts decoded together."})
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message before each prompt."})
    device: str | None = field(default=None, metadata={"help": "Device (default: cuda when available, else cpu)."})
    output_dir: str = field(default="outputs/eval", metadata={"help": "Where results.{json,md,png} go."})


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
        name = os.path.splitext(os.path.basename(source))[0] if os.path.exists(source) else source
        dataset = prepare_dataset(raw, fmt, system_prompt=args.system_prompt)
        tasks.append(EvalTask(name, dataset, task_reward(fmt.task)))
    return tasks


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse the command line, evaluate, write the reports and print the accuracy table."""
    parser = TrlParser((EvaluationArguments, ModelConfig))
    args, model_args = parser.parse_args_and_config(args=argv)
    toy_model = model_args.model_name_or_path is None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen_lengths = args.gen_lengths or list(TOY_GEN_LENGTHS if toy_model else PAPER_GEN_LENGTHS)
    block_length = args.block_length or (4 if toy_model else 32)

    model, tokenizer = load_model_and_tokenizer(model_args, device)
    tasks = build_tasks(args, toy_model)
    results = evaluate_model(
        model, tokenizer, tasks, gen_lengths, args.unmasking, block_length, args.threshold, args.tokens_per_step,
        args.cache_mode, args.batch_size,
    )
    settings = dict(
        model=model_args.model_name_or_path or "toy", datasets=[t.name for t in tasks], gen_lengths=gen_lengths,
        unmasking=list(args.unmasking), block_length=block_length, threshold=args.threshold,
        tokens_per_step=args.tokens_per_step, cache_mode=args.cache_mode, decoding="greedy", device=device,
    )
    paths = write_results(results, args.output_dir, settings)
    print(markdown_tables(results["cells"]))
    print("wrote " + ", ".join(paths.values()))
    return {**results, "paths": paths, "settings": settings}


if __name__ == "__main__":
    main()
