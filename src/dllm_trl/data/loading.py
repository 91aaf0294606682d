"""Loading task datasets from a local json / jsonl / parquet / csv file, a Hub name or a short preset name."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import huggingface_hub
from datasets import Dataset, load_dataset

from .adapters import DatasetFormat, get_format, prepare_dataset
from .prompts import render_prompt


@dataclass(frozen=True)
class HubDataset:
    """Where a benchmark lives on the Hugging Face Hub, and its layout."""

    path: str
    config: str | None
    layout: str


PRESETS = {
    "gsm8k": HubDataset("openai/gsm8k", "main", "gsm8k"),
    "math": HubDataset("DigitalLearningGmbH/MATH-lighteval", None, "math"),
    "math500": HubDataset("HuggingFaceH4/MATH-500", None, "math"),
    "mbpp": HubDataset("google-research-datasets/mbpp", "full", "mbpp"),
    "humaneval": HubDataset("openai/openai_humaneval", None, "humaneval"),
}
"""Short names for the paper's datasets (MATH500 and HumanEval have a ``test`` split only)."""

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_raw_dataset(source: str, split: str = "train", config: str | None = None) -> Dataset:
    """The rows of ``source`` as they are stored.

    ``source``: a preset name (``gsm8k``, ``math``, ``math500``, ``mbpp``, ``humaneval``), a local
    ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` file (one split: ``split`` is ignored), a local folder or a
    Hub dataset name (``config`` names its configuration).
    """
    if source in PRESETS:
        preset = PRESETS[source]
        return _load_from_hub(source, preset.path, config or preset.config, split)
    extension = os.path.splitext(source)[1].lower()
    if os.path.isfile(source):
        if extension not in FILE_BUILDERS:
            raise ValueError(f"{source!r}: expected a {'/'.join(sorted(FILE_BUILDERS))} file.")
        return load_dataset(FILE_BUILDERS[extension], data_files=source, split="train")
    if extension in FILE_BUILDERS:
        raise FileNotFoundError(f"No such dataset file: {source!r}.")
    if os.path.isdir(source):
        return load_dataset(source, config, split=split)
    return _load_from_hub(source, source, config, split)


def _load_from_hub(source: str, path: str, config: str | None, split: str) -> Dataset:
    """``load_dataset`` of a Hub dataset; without a connection, an error that says what to do instead."""
    try:
        return load_dataset(path, config, split=split)
    except ConnectionError as error:
        name = f"{source!r} (Hub dataset {path!r})" if source != path else repr(source)
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            reason = "is not in the local Hub cache and HF_HUB_OFFLINE is set"
        else:
            reason = "could not be downloaded (no connection to the Hub?; HF_HUB_OFFLINE=1 skips the retries)"
        raise ConnectionError(
            f"Dataset {name} {reason}: pass a local {'/'.join(sorted(FILE_BUILDERS))} file instead."
        ) from error


def resolve_format(source: str, dataset: Dataset, layout: str | None = None) -> DatasetFormat:
    """``layout`` if given, else the preset's layout, else the one detected from the columns."""
    if layout is None and source in PRESETS:
        layout = PRESETS[source].layout
    return get_format(layout, dataset.column_names)


def load_task_dataset(
    source: str,
    split: str = "train",
    config: str | None = None,
    layout: str | None = None,
    size: int | None = None,
    conversational: bool = True,
    system_prompt: str | None = None,
) -> Dataset:
    """Load ``source`` (see :func:`load_raw_dataset`) and map it onto ``prompt`` + reward columns
    (:func:`~dllm_trl.data.prepare_dataset`); ``size`` keeps the first rows.

    >>> train = load_task_dataset("gsm8k", split="train")          # doctest: +SKIP
    >>> tests = load_task_dataset("data/mbpp_test.jsonl", layout="mbpp")  # doctest: +SKIP
    """
    raw = load_raw_dataset(source, split=split, config=config)
    if size is not None:
        raw = raw.select(range(min(size, len(raw))))
    return prepare_dataset(raw, resolve_format(source, raw, layout), conversational, system_prompt)


def filter_by_length(dataset: Dataset, tokenizer, max_tokens: int, solution_column: str = "solution") -> Dataset:
    """Keep the rows whose rendered prompt plus reference solution fit in ``max_tokens`` tokens.

    Paper 1 App. C.1 trains on the MATH and MBPP problems of at most 320 (LLaDA) / 256 (Dream) tokens to avoid
    running out of memory; we read "sequence" as the templated prompt followed by the reference solution.
    """
    has_solution = solution_column in dataset.column_names

    def fits(row) -> bool:
        solution = (row[solution_column] or "") if has_solution else ""
        text = render_prompt(tokenizer, row["prompt"]) + solution
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= max_tokens

    return dataset.filter(fits, desc=f"≤ {max_tokens} tokens")


@dataclass
class DatasetArguments:
    """Command-line arguments of the example scripts that choose the training data (parse with ``TrlParser``)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Preset (gsm8k, math, math500, mbpp, humaneval), local json/jsonl/parquet/csv file or Hub "
            "dataset. Default: the toy task with the toy model, the paper's training set (MATH / MBPP) otherwise."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration of a Hub dataset."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_layout: str | None = field(
        default=None,
        metadata={"help": "Column layout: gsm8k, math, mbpp, humaneval, prepared_*; default: detect from columns."},
    )
    train_size: int | None = field(default=None, metadata={"help": "Keep the first N problems (default: all)."})
    max_sequence_length: int | None = field(
        default=None,
        metadata={"help": "Drop problems whose templated prompt + reference solution exceed N tokens (App. C.1)."},
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message before each prompt."})

    def load(self, default_source: str, tokenizer=None) -> Dataset:
        """The prepared training set: ``dataset_name`` or ``default_source``, cut to ``train_size`` and filtered
        by ``max_sequence_length`` (which needs ``tokenizer``)."""
        dataset = load_task_dataset(
            self.dataset_name or default_source,
            split=self.dataset_split,
            config=self.dataset_config,
            layout=self.dataset_layout,
            size=self.train_size,
            system_prompt=self.system_prompt,
        )
        if self.max_sequence_length is not None:
            if tokenizer is None:
                raise ValueError("max_sequence_length needs the tokenizer.")
            dataset = filter_by_length(dataset, tokenizer, self.max_sequence_length)
        if len(dataset) == 0:
            cut = f" of at most {self.max_sequence_length} tokens" if self.max_sequence_length is not None else ""
            raise ValueError(f"{self.dataset_name or default_source!r} has no training problems{cut}.")
        return dataset
