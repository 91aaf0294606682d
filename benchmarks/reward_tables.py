"""How many rows of the reward tables the installed rewards get right (tests/math_answer_table.py,
tests/code_program_table.py).

    python benchmarks/reward_tables.py                                   # this checkout
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/reward_tables.py   # e.g. main, for a before/after

Prints one line per table and the rows that are wrong (the expected values are the tables' own).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "..", "tests", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _block(code: str) -> str:
    return f"```python\n{code}\n```"


def main() -> None:
    from dllm_trl.rewards import code_reward, math_reward
    from dllm_trl.rewards.code import SandboxConfig

    print(f"dllm_trl from {os.path.dirname(sys.modules['dllm_trl'].__file__)}")
    rows = _load("math_answer_table").MATH_TABLE
    t0 = time.perf_counter()
    got = math_reward([f"$\\boxed{{{p}}}$" for p, _, _, _ in rows], [g for _, g, _, _ in rows])
    wrong = [(p, g, e) for (p, g, e, _), r in zip(rows, got) if (r == 1.0) != e]
    print(f"math: {len(rows) - len(wrong)}/{len(rows)} right ({time.perf_counter() - t0:.1f}s)")
    for w in wrong:
        print("   wrong:", w)

    table = _load("code_program_table")
    cfg = SandboxConfig(timeout=2.0)
    for label, progs, want in (("legitimate", table.LEGIT, 1.0), ("hostile", table.HOSTILE, 0.0)):
        t0 = time.perf_counter()
        got = code_reward([_block(p) for _, p, _ in progs], tests=[t for _, _, t in progs], sandbox_config=cfg)
        wrong = [(name, r) for (name, _, _), r in zip(progs, got) if r != want]
        print(f"code {label}: {len(progs) - len(wrong)}/{len(progs)} right ({time.perf_counter() - t0:.1f}s)")
        issue31 = {name for name, _, _ in getattr(table, "FAIR_31", []) + getattr(table, "HOSTILE_31", [])}
        if issue31:
            rows31 = [name for name, _, _ in progs if name in issue31]
            wrong31 = [w for w in wrong if w[0] in issue31]
            print(f"   of which issue 31's rows: {len(rows31) - len(wrong31)}/{len(rows31)} right")
        for w in wrong:
            print("   wrong:", w)


if __name__ == "__main__":
    main()
