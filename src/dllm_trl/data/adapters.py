r"""Column layouts of GSM8K, MATH / MATH500, MBPP and HumanEval → TRL's ``prompt`` plus what the reward reads.

* ``gsm8k``: ``question``, ``answer`` (``"… #### 42"``) → ``prompt``, ``answer`` (``"42"``), ``solution``.
* ``math`` (also MATH500): ``problem`` and ``solution`` and/or ``answer`` → ``prompt``, ``answer`` (MATH500's
  column, else the last ``\boxed{}`` of the solution), ``solution``.
* ``mbpp``: ``text`` (full set) or ``prompt`` (sanitized set), ``test_list`` → ``prompt``, ``tests``,
  ``test_setup_code``, ``test_imports``, ``solution``.
* ``humaneval``: ``prompt``, ``test``, ``entry_point`` → ``prompt``, ``test``, ``entry_point``, ``code_prefix``,
  ``solution``.
* ``prepared_*``: data already in this layout (``prompt`` + ``answer``, ``prompt`` + ``tests``, or HumanEval's
  prepared columns) passes through unchanged.

``answer`` is what :func:`~dllm_trl.rewards.math_reward` reads; ``tests`` / ``test_setup_code`` /
``test_imports`` and HumanEval's ``test`` + ``entry_point`` + ``code_prefix`` are what
:func:`~dllm_trl.rewards.code_reward` reads (the HumanEval prompt as ``code_prefix`` supplies the helper functions
some problems define before the one to complete). ``solution`` is the reference answer text, used by
:func:`~dllm_trl.data.filter_by_length`. Identifier columns (``task_id``, ``unique_id``, ``level``, ``type``,
``subject``) are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset

from ..rewards import code_reward, extract_boxed_answer, extract_gold_answer, math_reward
from .prompts import as_conversation, code_prompt, math_prompt

KEPT_COLUMNS = ("task_id", "unique_id", "level", "type", "subject")
"""Identifier columns carried over from the raw data when present."""

TASK_REWARDS = {"math": math_reward, "code": code_reward}
"""The reward function of each task (paper 1 App. B)."""


class MissingColumnError(ValueError):
    """A dataset lacks a column its layout needs; the message names the column and the columns it has."""

    def __init__(self, layout: str, names: tuple[str, ...], available: list[str]):
        self.layout, self.column, self.available = layout, names[0], list(available)
        alternatives = "".join(f" (or {n!r})" for n in names[1:])
        super().__init__(
            f"The {layout} layout needs a column {names[0]!r}{alternatives}, but the dataset has {self.available}. "
            f"Rename the column (Dataset.rename_column) or pass another layout (one of {sorted(DATASET_FORMATS)})."
        )


@dataclass(frozen=True)
class DatasetFormat:
    """One column layout: the columns it needs and how a row becomes a prompt plus reward columns.

    ``required`` lists one tuple per needed column: any one name of the tuple will do (MBPP's description is
    ``text`` in the full set and ``prompt`` in the sanitized one). ``task`` (``"math"`` or ``"code"``) picks the
    reward. ``convert(row)`` returns the new row, ``prompt`` as the user-turn text; ``None`` marks data already
    in this package's layout.
    """

    name: str
    task: str
    required: tuple[tuple[str, ...], ...]
    convert: Callable[[dict], dict] | None

    def missing(self, columns) -> list[tuple[str, ...]]:
        """The entries of ``required`` none of whose names is in ``columns``."""
        return [names for names in self.required if not any(c in columns for c in names)]

    def check(self, columns) -> None:
        """Raise :class:`MissingColumnError` for the first needed column absent from ``columns``."""
        missing = self.missing(columns)
        if missing:
            raise MissingColumnError(self.name, missing[0], list(columns))


def _gsm8k(row: dict) -> dict:
    return dict(prompt=math_prompt(row["question"]), answer=extract_gold_answer(row["answer"]), solution=row["answer"])


def _math(row: dict) -> dict:
    solution = row.get("solution") or ""
    answer = row.get("answer")
    if answer is None or str(answer).strip() == "":
        answer = extract_boxed_answer(solution)
    if not answer:
        raise ValueError(f"MATH row without an answer (no 'answer', no \\boxed{{}} in the solution): {solution[:80]!r}")
    return dict(prompt=math_prompt(row["problem"]), answer=str(answer), solution=solution)


def _mbpp(row: dict) -> dict:
    tests = list(row["test_list"])
    return dict(
        prompt=code_prompt(row.get("text") or row["prompt"], tests=tests),
        tests=tests,
        test_setup_code=row.get("test_setup_code") or "",
        test_imports=list(row.get("test_imports") or []),
        solution=row.get("code") or "",
    )


def _humaneval(row: dict) -> dict:
    return dict(
        prompt=code_prompt(starter_code=row["prompt"]),
        test=row["test"],
        entry_point=row["entry_point"],
        code_prefix=row["prompt"],
        solution=row["prompt"] + (row.get("canonical_solution") or ""),
    )


DATASET_FORMATS: dict[str, DatasetFormat] = {
    f.name: f
    for f in (
        DatasetFormat(
            "prepared_humaneval", "code", (("prompt",), ("test",), ("entry_point",), ("code_prefix",)), None
        ),
        DatasetFormat("humaneval", "code", (("prompt",), ("test",), ("entry_point",)), _humaneval),
        DatasetFormat("mbpp", "code", (("text", "prompt"), ("test_list",)), _mbpp),
        DatasetFormat("gsm8k", "math", (("question",), ("answer",)), _gsm8k),
        DatasetFormat("math", "math", (("problem",), ("solution", "answer")), _math),
        DatasetFormat("prepared_code", "code", (("prompt",), ("tests",)), None),
        DatasetFormat("prepared_math", "math", (("prompt",), ("answer",)), None),
    )
}
"""Known layouts, in the order :func:`detect_format` tries them (most specific first)."""


class LayoutNotDetectedError(MissingColumnError):
    """No known layout has all its columns in the dataset; the message lists every layout's columns and the way to
    choose one."""

    def __init__(self, columns: list[str]):
        closest = min(DATASET_FORMATS.values(), key=lambda f: len(f.missing(columns)))
        ValueError.__init__(self)
        self.layout, self.column, self.available = None, closest.missing(columns)[0][0], list(columns)
        layouts = "; ".join(f"{f.name}: {' + '.join('/'.join(names) for names in f.required)}"
                            for f in DATASET_FORMATS.values())
        near = [f"{f.name} (lacks {f.missing(columns)[0][0]!r})" for f in DATASET_FORMATS.values()
                if len(f.missing(columns)) == 1]
        near = f" One column away: {', '.join(near)}." if near else ""
        self.args = (
            f"No dataset layout matches the columns {self.available}.{near} The layouts and the columns they need: "
            f"{layouts}. Rename the columns (Dataset.rename_column) to one of these, or choose the layout: "
            f"load_task_dataset(..., layout=...) in Python, --dataset_layout in the scripts.",
        )


def detect_format(columns) -> DatasetFormat:
    """The first layout whose columns are all present; otherwise the error lists every layout's columns."""
    columns = list(columns)
    for fmt in DATASET_FORMATS.values():
        if not fmt.missing(columns):
            return fmt
    raise LayoutNotDetectedError(columns)


def get_format(layout: str | DatasetFormat | None, columns=()) -> DatasetFormat:
    """``layout`` by name (or as is), or detected from ``columns`` when ``None``."""
    if isinstance(layout, DatasetFormat):
        return layout
    if layout is None:
        return detect_format(columns)
    if layout == "math500":
        layout = "math"
    if layout not in DATASET_FORMATS:
        raise ValueError(f"Unknown dataset layout {layout!r}; expected one of {sorted(DATASET_FORMATS)} or None.")
    return DATASET_FORMATS[layout]


def prepare_dataset(
    dataset: Dataset,
    layout: str | DatasetFormat | None = None,
    conversational: bool = True,
    system_prompt: str | None = None,
) -> Dataset:
    """Map a raw dataset onto ``prompt`` + reward columns (see the module docstring).

    ``conversational=True`` wraps each prompt as a one-turn chat, so TRL renders it with the tokenizer's chat
    template; ``False`` keeps the plain text. Raises :class:`MissingColumnError` naming a column the layout
    needs. Rows of an already prepared dataset pass through unchanged.
    """
    fmt = get_format(layout, dataset.column_names)
    fmt.check(dataset.column_names)
    if fmt.convert is None:
        return dataset
    kept = [c for c in KEPT_COLUMNS if c in dataset.column_names]

    def convert(row):
        new = fmt.convert(row)
        if conversational:
            new["prompt"] = as_conversation(new["prompt"], system_prompt)
        elif system_prompt:
            new["prompt"] = f"{system_prompt}\n\n{new['prompt']}"
        return new

    removed = [c for c in dataset.column_names if c not in kept]
    return dataset.map(convert, remove_columns=removed, desc=f"{fmt.name} → prompts")


def task_reward(task: str):
    """The reward function of ``task`` (``"math"`` or ``"code"``)."""
    if task not in TASK_REWARDS:
        raise ValueError(f"Unknown task {task!r}; expected one of {sorted(TASK_REWARDS)}.")
    return TASK_REWARDS[task]
