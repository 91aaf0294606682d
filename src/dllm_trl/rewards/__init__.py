"""Reward functions with TRL's signature (``reward(completions, **columns) -> list[float]``).

* :func:`math_reward` — last ``\\boxed{}`` vs the ``answer`` column (string normalisation, then a
  structural comparison with exact numbers and sympy; binary; time-bounded). :func:`make_math_reward`
  for other column names.
* :func:`code_reward` — last ```` ```python ```` block run against unit tests (``tests`` /
  ``test_list`` column of assert strings, or HumanEval ``test`` + ``entry_point``) in a sandbox;
  reward = passed / total. :func:`make_code_reward` for other limits.

The rules both rewards apply, and their documented limitations: ``docs/rewards.md``.
"""

from .code import (
    CodeTestResult,
    SandboxConfig,
    code_reward,
    extract_python_block,
    make_code_reward,
    run_code_tests,
    sandbox_capabilities,
)
from .math import (
    extract_boxed_answer,
    extract_gold_answer,
    make_math_reward,
    math_answers_equal,
    math_reward,
    normalize_math_answer,
)

__all__ = [
    "math_reward",
    "code_reward",
    "extract_boxed_answer",
    "extract_python_block",
    "math_answers_equal",
    "normalize_math_answer",
    "extract_gold_answer",
    "make_math_reward",
    "make_code_reward",
    "run_code_tests",
    "CodeTestResult",
    "SandboxConfig",
    "sandbox_capabilities",
]
