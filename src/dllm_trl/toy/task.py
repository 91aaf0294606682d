"""The toy task: add two numbers below 100 (``"37+45="`` → ``"82"``), its datasets and its reward.

All 10,000 problems ``a+b=`` with ``0 ≤ a, b ≤ 99`` are shuffled once with a fixed seed; the first
``TEST_SIZE`` form the held-out ``"test"`` split and the rest the ``"train"`` split, so the two never overlap
and every call returns the same rows in the same order.
"""

from __future__ import annotations

import random

from datasets import Dataset

from .tokenizer import SPECIAL_TOKENS

MAX_OPERAND = 99
TEST_SIZE = 200
SPLIT_SEED = 1234
SPLITS = ("train", "test")


def _all_problems() -> list[tuple[int, int]]:
    problems = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(SPLIT_SEED).shuffle(problems)
    return problems


def toy_problems(split: str = "train") -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs of a split, e.g. ``("37+45=", "82")``, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}.")
    problems = _all_problems()
    chosen = problems[:TEST_SIZE] if split == "test" else problems[TEST_SIZE:]
    return [(f"{a}+{b}=", str(a + b)) for a, b in chosen]


def toy_dataset(split: str = "train", size: int | None = None, conversational: bool = False) -> Dataset:
    """The task as a `datasets.Dataset` with TRL's ``prompt`` column and an ``answer`` column.

    ``conversational=False`` gives plain-text prompts (TRL's "standard" format), ``True`` a one-turn chat
    (``[{"role": "user", "content": "37+45="}]``). ``size`` keeps the first ``size`` rows of the split.
    """
    problems = toy_problems(split)
    if size is not None:
        if size < 0 or size > len(problems):
            raise ValueError(f"size={size}: the {split!r} split has {len(problems)} problems.")
        problems = problems[:size]
    prompts = [[{"role": "user", "content": p}] if conversational else p for p, _ in problems]
    return Dataset.from_dict({"prompt": prompts, "answer": [a for _, a in problems]})


def completion_text(completion) -> str:
    """The answer text of a completion: a string or a list of chat messages (the last one's content),
    cut at the first special token (EOS) and stripped."""
    if isinstance(completion, list):
        completion = completion[-1]["content"] if completion else ""
    text = str(completion)
    cut = min((i for i in (text.find(token) for token in SPECIAL_TOKENS) if i >= 0), default=len(text))
    return text[:cut].strip()


def toy_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 where the completion (up to EOS, stripped) equals the answer, else 0.0."""
    return [float(completion_text(c) == str(a).strip()) for c, a in zip(completions, answer, strict=True)]
