"""Throughput of the sandboxed code reward: completions per second for a batch of 32 good programs
and for a batch of 8 hostile + 24 good ones, optionally side by side with another checkout.

    python benchmarks/code_reward.py                          # this checkout
    git worktree add --detach /tmp/main-rewards main
    python benchmarks/code_reward.py --baseline /tmp/main-rewards   # before / after in one run
    python benchmarks/code_reward.py --mutants --baseline /tmp/main-rewards   # issue-42 mutants per class

Each completion gets a fresh judge + executor process pair (see dllm_trl/rewards/code.py), so the
figures depend on the free CPU cores. The hostile programs sleep in the function under test
(``--hostile sleep``, the default), spin (``spin``) or hand the judge a huge range (``stall``);
each costs its own per-test budget (``--timeout``). "ms CPU" is the CPU time (user + system, from
``RUSAGE_CHILDREN``) of the judge and executor processes per completion: steadier than completions/s
on a loaded machine. The baseline runs in a subprocess with ``PYTHONPATH=<baseline>/src`` and the
same arguments; "peak RSS" is that of the calling process
(the trainer's side: threads and pipes; each sandbox process is capped by its own RLIMIT_AS).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# (solution, tests) — written for this benchmark
PROBLEMS = [
    ("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]),
    ("def is_even(n):\n    return n % 2 == 0", ["assert is_even(2) is True", "assert is_even(7) is False", "assert is_even(0) is True"]),
    ("def rev(s):\n    return s[::-1]", ["assert rev('abc') == 'cba'", "assert rev('') == ''", "assert rev('ab') == 'ba'"]),
    ("def fact(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
     ["assert fact(0) == 1", "assert fact(5) == 120", "assert fact(10) == 3628800"]),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55"]),
    ("def max_of(xs):\n    return max(xs)", ["assert max_of([1, 5, 3]) == 5", "assert max_of([-1, -5]) == -1", "assert max_of([7]) == 7"]),
    ("def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())",
     ["assert count_vowels('Hello') == 2", "assert count_vowels('AEIOU') == 5", "assert count_vowels('xyz') == 0"]),
    ("def uniq(xs):\n    return sorted(set(xs))", ["assert uniq([3, 1, 3, 2]) == [1, 2, 3]", "assert uniq([]) == []", "assert uniq([5, 5]) == [5]"]),
    ("def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
     "            return False\n        i += 1\n    return True", ["assert is_prime(2)", "assert not is_prime(9)", "assert is_prime(97)"]),
    ("def word_count(s):\n    return len(s.split())", ["assert word_count('a b c') == 3", "assert word_count('') == 0", "assert word_count('one') == 1"]),
    ("def pairs(xs):\n    return list(zip(xs, xs[1:]))", ["assert pairs([1, 2, 3]) == [(1, 2), (2, 3)]", "assert pairs([1]) == []", "assert pairs([]) == []"]),
    ("def freq(s):\n    d = {}\n    for c in s:\n        d[c] = d.get(c, 0) + 1\n    return d",
     ["assert freq('aab') == {'a': 2, 'b': 1}", "assert freq('') == {}", "assert freq('z') == {'z': 1}"]),
    ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a", ["assert gcd(12, 18) == 6", "assert gcd(7, 3) == 1", "assert gcd(10, 5) == 5"]),
    ("def flatten(xss):\n    return [x for xs in xss for x in xs]", ["assert flatten([[1], [2, 3]]) == [1, 2, 3]", "assert flatten([]) == []", "assert flatten([[4]]) == [4]"]),
    ("def square_sum(n):\n    return sum(i * i for i in range(1, n + 1))", ["assert square_sum(3) == 14", "assert square_sum(1) == 1", "assert square_sum(0) == 0"]),
    ("import math\ndef hyp(a, b):\n    return math.hypot(a, b)", ["assert abs(hyp(3, 4) - 5.0) < 1e-9", "assert hyp(0, 0) == 0", "assert abs(hyp(5, 12) - 13) < 1e-9"]),
]

HOSTILE = {
    "sleep": "import time\ndef {name}(*args):\n    time.sleep(10 ** 6)",
    "spin": "def {name}(*args):\n    while True:\n        pass",
    "stall": "def {name}(*args):\n    return range(0, 10 ** 18, 2)",
}


def _name(solution: str) -> str:
    return solution.split("def ", 1)[1].split("(", 1)[0]


def make_batch(n_good: int, n_hostile: int, hostile: str):
    completions, tests = [], []
    for i in range(n_good + n_hostile):
        solution, t = PROBLEMS[i % len(PROBLEMS)]
        code = HOSTILE[hostile].format(name=_name(solution)) if i < n_hostile else solution
        if hostile == "stall" and i < n_hostile:
            t = [f"assert sum({_name(solution)}(1)) == 0"] + t[1:]
        completions.append(f"Solution:\n```python\n{code}\n```")
        tests.append(t)
    return completions, tests


def measure(args) -> dict:
    from dllm_trl.rewards.code import SandboxConfig, code_reward, sandbox_capabilities

    cfg = SandboxConfig(timeout=args.timeout)
    caps = sandbox_capabilities()
    code_reward(*make_batch(2, 0, args.hostile), sandbox_config=cfg)  # warm-up
    out = {"sandbox": f"fs={caps['fs']} uid_drop={caps['uid_drop']} netns={caps['netns']} seccomp={caps['seccomp']}",
           "workers": cfg.n_workers(), "scenarios": {}}
    for label, n_good, n_hostile in (("32 good", 32, 0), (f"8 hostile ({args.hostile}) + 24 good", 24, 8)):
        completions, tests = make_batch(n_good, n_hostile, args.hostile)
        times, rewards = [], []
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rewards = code_reward(completions, tests=tests, sandbox_config=cfg)
            times.append(time.perf_counter() - t0)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        good_ok = sum(r == 1.0 for r in rewards[n_hostile:]) == n_good
        hostile_zero = all(r == 0.0 for r in rewards[:n_hostile])
        out["scenarios"][label] = {"per_s": len(completions) / statistics.median(times), "seconds": statistics.median(times),
                                   "cpu_ms": 1000 * cpu_s / (len(completions) * args.repeats),
                                   "scores_right": good_ok and hostile_zero}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def measure_mutants(args) -> dict:
    """The issue-42 mutants (tests/code_mutants.py): per class, how many hostile ones score above 0 and
    how many fair ones below 1."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.code_mutants import all_mutants

    from dllm_trl.rewards.code import SandboxConfig, code_reward

    mutants = all_mutants()
    t0 = time.perf_counter()
    rewards = code_reward([f"```python\n{p}\n```" for _, _, p, _, _ in mutants], tests=[t for _, _, _, t, _ in mutants],
                          sandbox_config=SandboxConfig(timeout=args.timeout))
    counts: dict = {}
    wrong = []
    for (cls, name, _, _, want), r in zip(mutants, rewards):
        c = counts.setdefault(cls, {"hostile": 0, "hostile_credited": 0, "fair": 0, "fair_short": 0})
        kind = "hostile" if want == 0.0 else "fair"
        c[kind] += 1
        if r != want:
            c["hostile_credited" if kind == "hostile" else "fair_short"] += 1
            wrong.append(name)
    return {"counts": counts, "wrong": wrong, "seconds": time.perf_counter() - t0}


def main_mutants(args) -> None:
    runs = {}
    if args.baseline:
        env = {**os.environ, "PYTHONPATH": os.path.join(os.path.abspath(args.baseline), "src")}
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--mutants", "--timeout", str(args.timeout)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=args.baseline)
        runs["baseline"] = json.loads(done.stdout.strip().splitlines()[-1])
    runs["this checkout"] = measure_mutants(args)
    names = list(runs)
    print("| class | mutants (hostile / fair) | " + " | ".join(f"{n}: hostile credited, fair below 1" for n in names) + " |")
    print("|" + "---|" * (2 + len(names)))
    for cls, c in runs[names[-1]]["counts"].items():
        cells = [f"{runs[n]['counts'][cls]['hostile_credited']}, {runs[n]['counts'][cls]['fair_short']}" for n in names]
        print(f"| {cls} | {c['hostile']} / {c['fair']} | " + " | ".join(cells) + " |")
    for n in names:
        print(f"{n}: {runs[n]['seconds']:.0f} s; wrong: {', '.join(runs[n]['wrong'][:20])}{' ...' if len(runs[n]['wrong']) > 20 else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None, help="another checkout (e.g. a git worktree of main) to run side by side")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0, help="per-test budget (the SandboxConfig default)")
    ap.add_argument("--hostile", choices=sorted(HOSTILE), default="sleep")
    ap.add_argument("--mutants", action="store_true", help="score the issue-42 mutants per class instead of throughput")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.mutants:
        if args.json:
            print(json.dumps(measure_mutants(args)))
        else:
            main_mutants(args)
        return
    if args.json:
        print(json.dumps(measure(args)))
        return
    runs = {}
    if args.baseline:
        env = {**os.environ, "PYTHONPATH": os.path.join(os.path.abspath(args.baseline), "src")}
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--repeats", str(args.repeats),
               "--timeout", str(args.timeout), "--hostile", args.hostile]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=args.baseline)
        runs["baseline"] = json.loads(done.stdout.strip().splitlines()[-1])
    runs["this checkout"] = measure(args)
    names = list(runs)
    print(f"cpus={os.cpu_count()} timeout={args.timeout}s repeats={args.repeats} (median)")
    for name, run in runs.items():
        print(f"  {name}: sandbox {run['sandbox']}, concurrent completions {run['workers']}, "
              f"peak RSS {run['peak_rss_mb']:.0f} MiB")
    header = "| batch | " + " | ".join(f"{n} (completions/s)" for n in names) + (" | ratio |" if len(names) == 2 else " |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for label in runs[names[-1]]["scenarios"]:
        cells = []
        for n in names:
            sc = runs[n]["scenarios"][label]
            cpu = f", {sc['cpu_ms']:.0f} ms CPU" if "cpu_ms" in sc else ""
            cells.append(f"{sc['per_s']:.1f} ({sc['seconds']:.1f} s{cpu}{'' if sc['scores_right'] else ', WRONG SCORES'})")
        ratio = ""
        if len(names) == 2:
            ratio = f" {runs[names[1]]['scenarios'][label]['per_s'] / runs[names[0]]['scenarios'][label]['per_s']:.1f}x |"
        print(f"| {label} | " + " | ".join(cells) + " |" + ratio)


if __name__ == "__main__":
    main()
