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

Where each part lives: :mod:`.metrics` (pass@k, :class:`TaskAccuracy`), :mod:`.tasks` (:class:`EvalTask`: a dataset
and its reward), :mod:`.runner` (the grid of cells, decoded by :func:`~dllm_trl.generation.decode_prompts`),
:mod:`.reports` (tables, plot, files) and :mod:`.cli` (the command line). Names are imported on first use.

For standard benchmarks on EleutherAI's lm-evaluation-harness, :mod:`dllm_trl.evaluation.lm_eval` (the ``eval``
extra) registers every supported model there as ``dllm_trl``: ``python -m dllm_trl.evaluation.lm_eval --tasks gsm8k
--model_args pretrained=PATH``. It is not imported by this package (it needs lm-eval).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["TaskAccuracy", "check_sampling", "pass_at_k"], "metrics"),
    **dict.fromkeys(["EvalTask", "score_completions"], "tasks"),
    **dict.fromkeys(["PAPER_GEN_LENGTHS", "TOY_GEN_LENGTHS", "decode", "evaluate_model", "generation_config"],
                    "runner"),
    **dict.fromkeys(["LINESTYLES", "MARKERS", "markdown_tables", "plot_results", "provenance", "score_columns",
                     "write_results"], "reports"),
    **dict.fromkeys(["EvaluationArguments", "build_tasks", "main"], "cli"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .cli import EvaluationArguments, build_tasks, main
    from .metrics import TaskAccuracy, check_sampling, pass_at_k
    from .reports import LINESTYLES, MARKERS, markdown_tables, plot_results, provenance, score_columns, write_results
    from .runner import PAPER_GEN_LENGTHS, TOY_GEN_LENGTHS, decode, evaluate_model, generation_config
    from .tasks import EvalTask, score_completions
