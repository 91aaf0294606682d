"""What is evaluated: a prepared dataset and the TRL-style reward that scores completions of its prompts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets


def score_completions(reward_func: Callable[..., list], completions: list[str], dataset, num_samples: int = 1
                      ) -> list[float]:
    """``reward_func`` (TRL's signature) on ``completions``, ``num_samples`` consecutive completions per row of
    ``dataset``, with every column of ``dataset`` but ``prompt`` as a keyword (as TRL's trainers call it)."""
    columns = {
        c: [value for value in dataset[c] for _ in range(num_samples)] for c in dataset.column_names if c != "prompt"
    }
    return [float(r) for r in reward_func(completions, **columns)]


@dataclass
class EvalTask:
    """A prepared dataset (``prompt`` + reward columns) and the TRL-style reward that scores it."""

    name: str
    dataset: datasets.Dataset
    reward_func: Callable[..., list[float]]

    def score(self, completions: list[str], num_samples: int = 1) -> list[float]:
        """Rewards of ``completions``: ``num_samples`` consecutive completions per dataset row."""
        return score_completions(self.reward_func, completions, self.dataset, num_samples)
