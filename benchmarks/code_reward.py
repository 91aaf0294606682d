"""Throughput of the sandboxed code reward on a batch of small MBPP-like problems.

    python benchmarks/code_reward.py [--batch 64] [--workers N] [--repeats 3]

Prints completions (evaluations) per second and unit tests per second. Each completion gets a
fresh judge + executor process pair (see dllm_trl/rewards/code.py), so the figure is dominated by
interpreter start-up and scales with the number of free CPU cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from dllm_trl.rewards.code import SandboxConfig, code_reward, sandbox_capabilities

# (solution, buggy solution, tests) — written for this benchmark
PROBLEMS = [
    ("def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b",
     ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]),
    ("def is_even(n):\n    return n % 2 == 0", "def is_even(n):\n    return n % 2 == 1",
     ["assert is_even(2) is True", "assert is_even(7) is False", "assert is_even(0) is True"]),
    ("def rev(s):\n    return s[::-1]", "def rev(s):\n    return s",
     ["assert rev('abc') == 'cba'", "assert rev('') == ''", "assert rev('ab') == 'ba'"]),
    ("def fact(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
     "def fact(n):\n    r = 1\n    for i in range(2, n):\n        r *= i\n    return r",
     ["assert fact(0) == 1", "assert fact(5) == 120", "assert fact(10) == 3628800"]),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     "def fib(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55"]),
    ("def max_of(xs):\n    return max(xs)", "def max_of(xs):\n    return xs[0]",
     ["assert max_of([1, 5, 3]) == 5", "assert max_of([-1, -5]) == -1", "assert max_of([7]) == 7"]),
    ("def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())",
     "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
     ["assert count_vowels('Hello') == 2", "assert count_vowels('AEIOU') == 5", "assert count_vowels('xyz') == 0"]),
    ("def uniq(xs):\n    return sorted(set(xs))", "def uniq(xs):\n    return list(set(xs))[::-1]",
     ["assert uniq([3, 1, 3, 2]) == [1, 2, 3]", "assert uniq([]) == []", "assert uniq([5, 5]) == [5]"]),
    ("def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
     "            return False\n        i += 1\n    return True",
     "def is_prime(n):\n    return n % 2 == 1",
     ["assert is_prime(2)", "assert not is_prime(9)", "assert is_prime(97)"]),
    ("def word_count(s):\n    return len(s.split())", "def word_count(s):\n    return s.count(' ')",
     ["assert word_count('a b c') == 3", "assert word_count('') == 0", "assert word_count('one') == 1"]),
    ("def pairs(xs):\n    return list(zip(xs, xs[1:]))", "def pairs(xs):\n    return list(zip(xs, xs))",
     ["assert pairs([1, 2, 3]) == [(1, 2), (2, 3)]", "assert pairs([1]) == []", "assert pairs([]) == []"]),
    ("def freq(s):\n    d = {}\n    for c in s:\n        d[c] = d.get(c, 0) + 1\n    return d",
     "def freq(s):\n    return {c: 1 for c in s}",
     ["assert freq('aab') == {'a': 2, 'b': 1}", "assert freq('') == {}", "assert freq('z') == {'z': 1}"]),
    ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a", "def gcd(a, b):\n    return min(a, b)",
     ["assert gcd(12, 18) == 6", "assert gcd(7, 3) == 1", "assert gcd(10, 5) == 5"]),
    ("def flatten(xss):\n    return [x for xs in xss for x in xs]", "def flatten(xss):\n    return xss[0]",
     ["assert flatten([[1], [2, 3]]) == [1, 2, 3]", "assert flatten([]) == []", "assert flatten([[4]]) == [4]"]),
    ("def square_sum(n):\n    return sum(i * i for i in range(1, n + 1))",
     "def square_sum(n):\n    return sum(i * i for i in range(n))",
     ["assert square_sum(3) == 14", "assert square_sum(1) == 1", "assert square_sum(0) == 0"]),
    ("import math\ndef hyp(a, b):\n    return math.hypot(a, b)", "def hyp(a, b):\n    return a + b",
     ["assert abs(hyp(3, 4) - 5.0) < 1e-9", "assert hyp(0, 0) == 0", "assert abs(hyp(5, 12) - 13) < 1e-9"]),
]


def make_batch(n: int):
    completions, tests = [], []
    for i in range(n):
        good, bad, t = PROBLEMS[i % len(PROBLEMS)]
        code = good if (i // len(PROBLEMS)) % 2 == 0 else bad
        completions.append(f"Solution:\n```python\n{code}\n```")
        tests.append(t)
    return completions, tests


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=None, help="concurrent completions (default: min(8, cpus))")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()

    cfg = SandboxConfig(timeout=args.timeout, workers=args.workers)
    caps = sandbox_capabilities()
    print(f"sandbox: fs={caps['fs']} uid_drop={caps['uid_drop']} netns={caps['netns']} seccomp={caps['seccomp']}")
    completions, tests = make_batch(args.batch)
    n_tests = sum(len(t) for t in tests)
    code_reward(completions[:2], tests=tests[:2], sandbox_config=cfg)  # warm-up
    times = []
    rewards = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        rewards = code_reward(completions, tests=tests, sandbox_config=cfg)
        times.append(time.perf_counter() - t0)
    best, med = min(times), statistics.median(times)
    print(
        f"batch={args.batch} workers={cfg.n_workers()} cpus={os.cpu_count()} mean_reward={sum(rewards) / len(rewards):.3f}"
    )
    print(f"median {med:.2f}s per batch -> {args.batch / med:.1f} completions/s, {n_tests / med:.1f} tests/s "
          f"(best {args.batch / best:.1f} completions/s)")


if __name__ == "__main__":
    main()
