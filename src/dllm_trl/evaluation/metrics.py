"""Scores of per-sample rewards: accuracy, mean reward and pass@k (the unbiased estimator of Chen et al. 2021)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import datasets
import evaluate


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``num_correct`` correct among ``num_samples`` samples of one problem:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, Eq. 1), computed as a product to stay exact for large n."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= num_samples={num_samples}.")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def check_sampling(num_samples: int, temperature: float, pass_at: Sequence[int]) -> None:
    """Raise unless ``num_samples`` completions per problem at ``temperature`` can give pass@k for ``pass_at``."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be ≥ 1.")
    if num_samples > 1 and not temperature > 0:
        raise ValueError(
            f"num_samples={num_samples} with temperature={temperature}: greedy decoding gives the same completion "
            "every time; set temperature > 0 (e.g. 0.6) or num_samples=1."
        )
    bad = [k for k in pass_at if not 1 <= k <= num_samples]
    if bad:
        raise ValueError(f"pass@k for k={bad}: every k must lie in [1, num_samples={num_samples}].")


class TaskAccuracy(evaluate.Metric):
    """Accuracy, mean reward and pass@k of per-sample rewards in [0, 1] (one list of samples per problem).

    A sample is correct at reward 1 (right answer / every test passed). ``accuracy`` is the fraction of correct
    samples (with one greedy sample per problem, the fraction of problems solved; with several, the pass@1
    estimate); ``mean_reward`` the mean reward (code: mean test pass rate); ``pass@k`` the mean over problems of
    :func:`pass_at_k`, for each ``k`` in ``ks`` (every problem needs at least ``max(ks)`` samples). A local
    metric: nothing is fetched from the Hub.
    """

    def _info(self):
        return evaluate.MetricInfo(
            description=self.__doc__,
            citation="",
            inputs_description="rewards: per problem, the list of its samples' rewards in [0, 1].",
            features=datasets.Features({"rewards": datasets.Sequence(datasets.Value("float64"))}),
        )

    def _compute(self, rewards, ks: Sequence[int] = ()):
        samples = [r for problem in rewards for r in problem]
        result = {
            "accuracy": sum(r >= 1.0 for r in samples) / len(samples) if samples else float("nan"),
            "mean_reward": sum(samples) / len(samples) if samples else float("nan"),
        }
        for k in ks:
            scores = [pass_at_k(len(problem), sum(r >= 1.0 for r in problem), k) for problem in rewards]
            result[f"pass@{k}"] = sum(scores) / len(scores) if scores else float("nan")
        return result
