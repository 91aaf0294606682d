"""Accuracy of a diffusion LM on math and code sets across generation lengths and unmasking modes.

Paper 1's protocol (Table 2 / Table 3): greedy decoding at generation lengths 128, 256 and 512, block-wise with
blocks of 32, dynamic unmasking (threshold 0.9) and static unmasking (one token per step); math scored by the
last ``\\boxed{}`` (:func:`~dllm_trl.rewards.math_reward`), code by the unit tests of the last ```` ```python ````
block (:func:`~dllm_trl.rewards.code_reward`, accuracy = all tests pass). Each (dataset, length, mode) cell also
reports decoding speed (completion tokens per second of sampler time) and forwards per completion (NFE).

With ``--num_samples n --temperature T`` (T > 0) every problem is decoded ``n`` times and each cell also
reports pass@k for the ``--pass_at_k`` values (the unbiased estimator of Chen et al. 2021, :func:`pass_at_k`).

::

    python -m dllm_trl.evaluation                 # the toy model on the toy test split (CPU, seconds)
    python -m dllm_trl.evaluation --model_name_or_path path/to/checkpoint --datasets test.jsonl
    python examples/evaluate.py --model_name_or_path GSAI-ML/LLaDA-8B-Instruct --dtype bfloat16 \\
        --datasets gsm8k math500 humaneval mbpp --output_dir eval/llada-8b-instruct

Writes ``results.json`` (cells, settings and versions), ``results.md`` (Markdown tables), ``completions.jsonl``
(every decoded completion with its reward) and then ``results.png`` (accuracy and speed against generation
length) to ``--output_dir``. Model flags are TRL's ``ModelConfig`` (``--load_in_4bit`` etc.); a PEFT adapter
folder as ``--model_name_or_path`` is loaded on top of its base model. With ``HF_HUB_OFFLINE=1`` nothing is
fetched from the Hub: local files and folders, or what the Hub cache already holds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import datasets
import evaluate
import torch
from tqdm.auto import tqdm

from .data import load_raw_dataset, prepare_dataset, resolve_format, task_reward
from .generation import DiffusionGenerationConfig, diffusion_generate
from .toy import decode_completions, encode_prompts, toy_dataset, toy_reward

PAPER_GEN_LENGTHS = (128, 256, 512)
TOY_GEN_LENGTHS = (4, 8, 16)
"""Toy counterpart of 128/256/512: half, equal to and twice the length the toy model was trained at."""


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``num_correct`` correct among ``num_samples`` samples of one problem:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, Eq. 1), computed as a product to stay exact for large n."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= num_samples={num_samples}.")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def check_sampling(num_samples: int, temperature: float, pass_at: Sequence[int]) -> None:
    """Raise unless ``num_samples`` completions per problem at ``temperature`` can give pass@k for ``pass_at``."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be ≥ 1.")
    if num_samples > 1 and not temperature > 0:
        raise ValueError(
            f"num_samples={num_samples} with temperature={temperature}: greedy decoding gives the same completion "
            "every time; set temperature > 0 (e.g. 0.6) or num_samples=1."
        )
    bad = [k for k in pass_at if not 1 <= k <= num_samples]
    if bad:
        raise ValueError(f"pass@k for k={bad}: every k must lie in [1, num_samples={num_samples}].")


class TaskAccuracy(evaluate.Metric):
    """Accuracy, mean reward and pass@k of per-sample rewards in [0, 1] (one list of samples per problem).

    A sample is correct at reward 1 (right answer / every test passed). ``accuracy`` is the fraction of correct
    samples (with one greedy sample per problem, the fraction of problems solved; with several, the pass@1
    estimate); ``mean_reward`` the mean reward (code: mean test pass rate); ``pass@k`` the mean over problems of
    :func:`pass_at_k`, for each ``k`` in ``ks`` (every problem needs at least ``max(ks)`` samples). A local
    metric: nothing is fetched from the Hub.
    """

    def _info(self):
        return evaluate.MetricInfo(
            description=self.__doc__,
            citation="",
            inputs_description="rewards: per problem, the list of its samples' rewards in [0, 1].",
            features=datasets.Features({"rewards": datasets.Sequence(datasets.Value("float64"))}),
        )

    def _compute(self, rewards, ks: Sequence[int] = ()):
        samples = [r for problem in rewards for r in problem]
        result = {
            "accuracy": sum(r >= 1.0 for r in samples) / len(samples) if samples else float("nan"),
            "mean_reward": sum(samples) / len(samples) if samples else float("nan"),
        }
        for k in ks:
            scores = [pass_at_k(len(problem), sum(r >= 1.0 for r in problem), k) for problem in rewards]
            result[f"pass@{k}"] = sum(scores) / len(scores) if scores else float("nan")
        return result


@dataclass
class EvalTask:
    """A prepared dataset (``prompt`` + reward columns) and the TRL-style reward that scores it."""

    name: str
    dataset: datasets.Dataset
    reward_func: Callable[..., list[float]]

    def score(self, completions: list[str], num_samples: int = 1) -> list[float]:
        """Rewards of ``completions``: ``num_samples`` consecutive completions per dataset row."""
        columns = {
            c: [value for value in self.dataset[c] for _ in range(num_samples)]
            for c in self.dataset.column_names
            if c != "prompt"
        }
        return [float(r) for r in self.reward_func(completions, **columns)]


def decode(
    model, tokenizer, prompts: Sequence, config: DiffusionGenerationConfig, batch_size: int, desc: str | None = None
):
    """Decode every prompt with :func:`diffusion_generate`; batches group prompts of similar length.

    Returns ``completions`` (in the order of ``prompts``), ``tokens`` (completion tokens up to and including
    EOS), ``seconds`` (sampler time), ``nfe`` (forwards, all batches) and ``nfe_per_problem`` (forwards each
    prompt's decoding went through, averaged over prompts).
    """
    device = model.get_input_embeddings().weight.device
    lengths = [len(p) if isinstance(p, str) else sum(len(m["content"]) for m in p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])
    completions: list[str | None] = [None] * len(prompts)
    tokens, seconds, nfe, problem_forwards = 0, 0.0, 0, 0
    was_training = model.training
    model.eval()
    with tqdm(total=len(prompts), desc=desc, unit="completion", disable=desc is None) as bar, torch.no_grad():
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
                      tokens_per_step: int = 1, cache: str = "dual",
                      temperature: float = 0.0) -> DiffusionGenerationConfig:
    """Decoding settings of one cell (greedy unless ``temperature`` > 0); blocks never exceed the generation
    length."""
    block = min(block_length, gen_length)
    steps = gen_length // tokens_per_step if unmasking == "static" else None
    return DiffusionGenerationConfig(
        gen_length=gen_length, block_length=block, unmasking=unmasking, threshold=threshold, steps=steps,
        temperature=temperature, cache=cache,
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
    num_samples: int = 1,
    temperature: float = 0.0,
    pass_at: Sequence[int] = (),
) -> dict:
    """Decode and score every task at every (generation length, unmasking mode).

    Each problem is decoded ``num_samples`` times (``temperature`` > 0 when more than once: greedy decoding
    repeats itself); ``pass_at`` lists the k of the pass@k columns. Duplicate lengths or modes are evaluated once.

    Returns ``{"cells": [...], "completions": [...]}``: one cell per (task, length, mode) with ``accuracy``,
    ``mean_reward``, ``pass@k`` for each k of ``pass_at``, ``num_problems``, ``num_samples``,
    ``tokens_per_second``, ``nfe``, ``nfe_per_problem`` and ``seconds``; one completion record per (cell,
    problem, sample) with its ``reward``.
    """
    check_sampling(num_samples, temperature, pass_at)
    cells, records = [], []
    for task in tasks:
        prompts = [p for p in task.dataset["prompt"] for _ in range(num_samples)]
        for gen_length in dict.fromkeys(gen_lengths):
            for mode in dict.fromkeys(unmasking):
                config = generation_config(gen_length, mode, block_length, threshold, tokens_per_step, cache,
                                           temperature)
                desc = f"{task.name} · length {gen_length} · {mode}" if progress else None
                out = decode(model, tokenizer, prompts, config, batch_size, desc)
                rewards = task.score(out["completions"], num_samples)
                metric = TaskAccuracy(keep_in_memory=True)
                metric.add_batch(rewards=[rewards[i : i + num_samples] for i in range(0, len(rewards), num_samples)])
                cell = dict(
                    dataset=task.name,
                    gen_length=gen_length,
                    unmasking=mode,
                    **metric.compute(ks=list(pass_at)),
                    num_problems=len(task.dataset),
                    num_samples=num_samples,
                    tokens_per_second=out["tokens"] / out["seconds"] if out["seconds"] > 0 else float("nan"),
                    nfe=out["nfe"],
                    nfe_per_problem=out["nfe_per_problem"],
                    seconds=out["seconds"],
                )
                cells.append(cell)
                records += [
                    dict(dataset=task.name, gen_length=gen_length, unmasking=mode, index=i // num_samples,
                         sample=i % num_samples, completion=c, reward=r)
                    for i, (c, r) in enumerate(zip(out["completions"], rewards))
                ]
    return {"cells": cells, "completions": records}


# ------------------------------------------------------------------------------------------------ reports
def score_columns(cells: Sequence[dict]) -> list[str]:
    """The scores to report: the ``pass@k`` keys the cells hold, after ``accuracy`` unless pass@1 (the same
    number) is one of them."""
    passes = sorted({key for c in cells for key in c if key.startswith("pass@")}, key=lambda key: int(key[5:]))
    return passes if "pass@1" in passes else ["accuracy", *passes]


def markdown_tables(cells: Sequence[dict]) -> str:
    """Scores (%) per dataset, mode and score across generation lengths (the paper's table layout), then every
    cell with its speed."""
    lengths = sorted({c["gen_length"] for c in cells})
    scores = score_columns(cells)
    lines = [
        "| dataset | unmasking | score | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|---|---|" + "---:|" * len(lengths),
    ]
    for dataset, mode in dict.fromkeys((c["dataset"], c["unmasking"]) for c in cells):
        by_length = {c["gen_length"]: c for c in cells if (c["dataset"], c["unmasking"]) == (dataset, mode)}
        for score in scores:
            values = [f"{100 * by_length[n][score]:.1f}" if n in by_length else "–" for n in lengths]
            lines.append(f"| {dataset} | {mode} | {score} | " + " | ".join(values) + " |")
    passes = [score for score in scores if score != "accuracy"]
    lines += [
        "",
        "| dataset | unmasking | length | accuracy | " + "".join(f"{p} | " for p in passes)
        + "mean reward | problems | samples | tokens/s | NFE / completion | seconds |",
        "|---|---|---:|---:|" + "---:|" * len(passes) + "---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c['dataset']} | {c['unmasking']} | {c['gen_length']} | {100 * c['accuracy']:.1f} | "
            + "".join(f"{100 * c[p]:.1f} | " for p in passes)
            + f"{c['mean_reward']:.3f} | {c['num_problems']} | {c['num_samples']} | {c['tokens_per_second']:.1f} | "
            f"{c['nfe_per_problem']:.1f} | {c['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", "-.", ":")


def plot_results(cells: Sequence[dict], path: str) -> None:
    """Scores (top) and tokens/s (bottom) against generation length, one column per dataset.

    One colour and marker per unmasking mode, one line style per score; every line is shifted slightly along the
    length axis, so that lines with equal values stay visible side by side.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c["dataset"] for c in cells))
    modes = list(dict.fromkeys(c["unmasking"] for c in cells))
    scores = score_columns(cells)
    lengths = sorted({c["gen_length"] for c in cells})
    num_lines = len(modes) * len(scores)
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6), squeeze=False, sharex="col")
    for column, name in enumerate(names):
        for m, mode in enumerate(modes):
            by_length = {c["gen_length"]: c for c in cells if c["dataset"] == name and c["unmasking"] == mode}
            x = sorted(by_length)
            style = dict(color=f"C{m}", marker=MARKERS[m % len(MARKERS)], alpha=0.85)
            for s, score in enumerate(scores):
                line = m * len(scores) + s
                shifted = [n * 2 ** (0.04 * (line - (num_lines - 1) / 2)) for n in x]  # the length axis is log2
                label = mode if len(scores) == 1 else f"{mode} · {score}"
                axes[0, column].plot(shifted, [100 * by_length[n][score] for n in x], label=label,
                                     linestyle=LINESTYLES[s % len(LINESTYLES)], **style)
                if s == 0:
                    axes[1, column].plot(shifted, [by_length[n]["tokens_per_second"] for n in x], label=mode,
                                         **style)
        axes[0, column].set_title(name)
        axes[0, column].set_ylim(-2, 102)
        axes[0, column].set_ylabel("score (%)")
        axes[1, column].set_ylabel("tokens / s")
        axes[1, column].set_xlabel("generation length")
        for ax in axes[:, column]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths)
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def provenance() -> dict:
    """When and with what the results were produced (the dllm_trl commit when it runs from a git checkout)."""
    import transformers

    from . import __version__

    try:  # quiet: outside a checkout git prints "fatal: not a git repository" on stderr
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(__file__), capture_output=True,
                              text=True, timeout=10)
        commit = done.stdout.strip() if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(_timestamp=datetime.now().isoformat(), _dllm_trl_version=__version__, _dllm_trl_commit=commit,
                _torch_version=torch.__version__, _transformers_version=transformers.__version__,
                _python_version=sys.version, _interpreter_path=sys.executable)


def write_results(results: dict, output_dir: str, settings: dict | None = None, plot: bool = True) -> dict:
    """``results.json``, ``results.md`` and ``completions.jsonl`` in ``output_dir``, then ``results.png`` (so a
    plotting error loses nothing); returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    names = ("results.json", "results.md", "completions.jsonl") + (("results.png",) if plot else ())
    paths = {name: os.path.join(output_dir, name) for name in names}
    with open(paths["results.json"], "w") as f:
        json.dump(dict(cells=results["cells"], settings=settings or {}, **provenance()), f, indent=1)
    with open(paths["results.md"], "w") as f:
        f.write(markdown_tables(results["cells"]))
    with open(paths["completions.jsonl"], "w") as f:
        for record in results["completions"]:
            f.write(json.dumps(record) + "\n")
    if plot:
        plot_results(results["cells"], paths["results.png"])
    return paths


# ------------------------------------------------------------------------------------------------ CLI
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

    from .cli import load_model_and_tokenizer

    parser = TrlParser((EvaluationArguments, ModelConfig))
    args, model_args = parser.parse_args_and_config(args=argv)
    toy_model = model_args.model_name_or_path is None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen_lengths = args.gen_lengths or list(TOY_GEN_LENGTHS if toy_model else PAPER_GEN_LENGTHS)
    block_length = args.block_length or (4 if toy_model else 32)

    try:  # the data first: a missing file or an unreachable Hub should not wait for the model to load
        tasks = build_tasks(args, toy_model)
    except (ConnectionError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    model, tokenizer = load_model_and_tokenizer(model_args, device)
    torch.manual_seed(args.seed)
    results = evaluate_model(
        model, tokenizer, tasks, gen_lengths, args.unmasking, block_length, args.threshold, args.tokens_per_step,
        args.cache_mode, args.batch_size, num_samples=args.num_samples, temperature=args.temperature,
        pass_at=args.pass_at_k,
    )
    settings = dict(
        model=model_args.model_name_or_path or "toy", datasets=[t.name for t in tasks], gen_lengths=gen_lengths,
        unmasking=list(args.unmasking), block_length=block_length, threshold=args.threshold,
        tokens_per_step=args.tokens_per_step, cache_mode=args.cache_mode,
        decoding="greedy" if args.temperature == 0 else f"temperature {args.temperature}",
        num_samples=args.num_samples, pass_at_k=args.pass_at_k, seed=args.seed, device=device,
    )
    paths = write_results(results, args.output_dir, settings, plot=args.plot)
    print(markdown_tables(results["cells"]))
    print("wrote " + ", ".join(paths.values()))
    return {**results, "paths": paths, "settings": settings}


if __name__ == "__main__":
    main()
