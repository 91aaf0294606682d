"""Loader of the lm-eval task in toy_sudoku.yaml: the Sudoku toy's test split, from the library."""

import datasets

from dllm_trl.toy import sudoku_dataset


def load_dataset(**metadata) -> datasets.DatasetDict:
    """The puzzles as the task's ``test`` split (lm-eval passes the task's metadata, unused here)."""
    return datasets.DatasetDict({"test": sudoku_dataset("test")})
