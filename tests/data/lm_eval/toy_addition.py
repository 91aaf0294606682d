"""Loader of the lm-eval task in toy_addition.yaml: the jsonl beside this file (a copy of the addition toy's test split,
``dllm_trl.toy.toy_problems("test")``; tests/test_lm_eval.py checks that it still is)."""

import json
from pathlib import Path

import datasets

JSONL = Path(__file__).with_name("toy_addition.jsonl")


def load_dataset(**metadata) -> datasets.DatasetDict:
    """The problems as the task's ``test`` split (lm-eval passes the task's metadata, unused here)."""
    rows = [json.loads(line) for line in JSONL.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
