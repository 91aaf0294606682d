r"""Prompt templates and dataset adapters: paper 1's math and code prompts, and the column layouts of GSM8K,
MATH / MATH500, MBPP and HumanEval mapped onto TRL's ``prompt`` plus the columns the rewards read.

::

    from dllm_trl.data import load_task_dataset, task_reward

    train = load_task_dataset("gsm8k", split="train")         # Hub preset (online)
    train = load_task_dataset("my_math.jsonl")                  # local file, layout detected from its columns
    reward = task_reward("math")                                # math_reward, reads the `answer` column

Prompts are one-turn chats by default, so TRL renders them with the tokenizer's chat template;
:func:`render_prompt` gives the same text outside a trainer.
"""

from .adapters import (
    DATASET_FORMATS,
    TASK_REWARDS,
    DatasetFormat,
    MissingColumnError,
    detect_format,
    get_format,
    prepare_dataset,
    task_reward,
)
from .loading import (
    PRESETS,
    DatasetArguments,
    HubDataset,
    filter_by_length,
    load_raw_dataset,
    load_task_dataset,
    resolve_format,
)
from .prompts import CODE_INSTRUCTION, MATH_INSTRUCTION, as_conversation, code_prompt, math_prompt, render_prompt
from .samples import SAMPLE_ROWS, sample_dataset

__all__ = [
    "CODE_INSTRUCTION",
    "DATASET_FORMATS",
    "MATH_INSTRUCTION",
    "PRESETS",
    "SAMPLE_ROWS",
    "TASK_REWARDS",
    "DatasetArguments",
    "DatasetFormat",
    "HubDataset",
    "MissingColumnError",
    "as_conversation",
    "code_prompt",
    "detect_format",
    "filter_by_length",
    "get_format",
    "load_raw_dataset",
    "load_task_dataset",
    "math_prompt",
    "prepare_dataset",
    "render_prompt",
    "resolve_format",
    "sample_dataset",
    "task_reward",
]
