"""Loader of the lm-eval task in toy_addition_choice.yaml: the addition toy's test problems (toy_addition.jsonl) as
four-way multiple choice. The choices are the right sum and three wrong ones, each written as the toy's completion is
(the digits, then EOS up to its 8 completion positions), so that every choice is scored on the canvas the toy knows."""

import json
import random
from pathlib import Path

import datasets

JSONL = Path(__file__).with_name("toy_addition.jsonl")
GEN_LENGTH = 8
EOS = "<|eos|>"


def completion(answer: str) -> str:
    return answer + EOS * (GEN_LENGTH - len(answer))


def choices_of(prompt: str, answer: str) -> tuple[list[str], int]:
    """Four choices (the right sum among three others within ±20 of it, drawn from a generator seeded by the prompt)
    and the index of the right one."""
    total = int(answer)
    rng = random.Random(prompt)
    wrong = rng.sample([s for s in range(max(0, total - 20), total + 21) if s != total], 3)
    sums = [total, *wrong]
    rng.shuffle(sums)
    return [completion(str(s)) for s in sums], sums.index(total)


def load_dataset(**metadata) -> datasets.DatasetDict:
    rows = []
    for line in JSONL.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            choices, label = choices_of(row["prompt"], row["answer"])
            rows.append({**row, "choices": choices, "label": label})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
