"""Rows of the math answer table scored wrong, per class: wrong answers credited and right answers rejected.

    python benchmarks/math_table_classes.py                        # this checkout, issue 42's rows
    PYTHONPATH=<other checkout>/src python benchmarks/math_table_classes.py   # another checkout, same rows
    python benchmarks/math_table_classes.py --all                  # every row of the table

Each row is scored as ``tests/test_rewards_math.py::test_answer_table`` scores it: the prediction boxed against
the gold, and the gold boxed against the prediction (a row is wrong when either direction is).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


def _table():
    path = os.path.join(HERE, "..", "tests", "math_answer_table.py")
    spec = importlib.util.spec_from_file_location("math_answer_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every row of the table, not issue 42's only")
    ap.add_argument("-v", action="store_true", help="print the rows scored wrong")
    args = ap.parse_args()
    from dllm_trl.rewards import math_reward
    from dllm_trl.rewards.math import extract_gold_answer

    table = _table()
    rows = table.MATH_TABLE if args.all else table.ISSUE_42
    print(f"dllm_trl from {os.path.dirname(sys.modules['dllm_trl'].__file__)}; {len(rows)} rows")
    t0 = time.perf_counter()
    forward = math_reward([f"$\\boxed{{{p}}}$" for p, _, _, _ in rows], [g for _, g, _, _ in rows])
    backward = math_reward([f"$\\boxed{{{extract_gold_answer(g)}}}$" for _, g, _, _ in rows], [p for p, _, _, _ in rows])
    elapsed = time.perf_counter() - t0
    credited, rejected, total = Counter(), Counter(), Counter()
    for (p, g, expected, rule), f, b in zip(rows, forward, backward):
        total[(rule, expected)] += 1
        if f != float(expected) or b != float(expected):
            (rejected if expected else credited)[rule] += 1
            if args.v:
                short = [x if len(x) <= 80 else x[:60] + f"... ({len(x)} chars)" for x in (p, g)]
                print(f"   {'rejected' if expected else 'credited'}: {short[0]!r} vs {short[1]!r} ({rule}: {f}, {b})")
    print(f"{'class':22} {'wrong credited':>16} {'right rejected':>16}")
    for rule in dict.fromkeys(r for _, _, _, r in rows):
        print(f"{rule:22} {credited[rule]:>8} of {total[(rule, False)]:<5} {rejected[rule]:>8} of {total[(rule, True)]:<5}")
    print(f"{'all':22} {sum(credited.values()):>8} of {sum(v for (r, e), v in total.items() if not e):<5}"
          f" {sum(rejected.values()):>8} of {sum(v for (r, e), v in total.items() if e):<5}  ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
