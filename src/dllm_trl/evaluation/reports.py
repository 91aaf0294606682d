"""Reports of an evaluation: Markdown tables, a plot of scores and speed against generation length, and the files
``results.json`` (cells, settings, provenance), ``results.md``, ``completions.jsonl`` and ``results.png``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime

import torch


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

    from .. import __version__

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
