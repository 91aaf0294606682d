"""Reward-hacking regression suite: an RL-style random search against each reward.

A policy that finds a reward bug trains on it. These tests play that policy: start from wrong
answers / programs, mutate them at random (fixed seeds), keep searching from what scored, and
assert that nothing ever scores above its true value. The true value comes from a small,
obviously-correct reference written here (exact ``Fraction`` arithmetic for math answers over the
search's own grammar, a plain in-process run of the function for programs), never from the reward
under test.
"""

from __future__ import annotations

import math
import random
import re
from fractions import Fraction

import pytest

from dllm_trl.rewards import code_reward, math_reward
from dllm_trl.rewards.code import SandboxConfig

pytestmark = pytest.mark.timeout(300)


# ============================================================================= math
class _Unknown(Exception):
    """The reference does not read this string (outside the search grammar)."""


class _Reference:
    r"""Exact value of an answer written in the search grammar: numbers (decimals, e-notation,
    leading zeros), ``+ - \cdot ^``, parentheses and braces, ``\frac{}{}``, mixed numbers, a
    trailing ``\%`` (then the answer is read both as p and as p/100), ``\$``, a trailing unit,
    ``x=``, and lists (``,`` or ``\text{ or }``) compared as multisets. Raises _Unknown otherwise."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0

    def peek(self, tok: str) -> bool:
        return self.s.startswith(tok, self.i)

    def take(self, tok: str) -> bool:
        if self.peek(tok):
            self.i += len(tok)
            return True
        return False

    def number(self) -> Fraction:
        m = re.compile(r"(\d+\.?\d*|\.\d+)([eE][+-]?\d{1,3}(?![\d.]))?").match(self.s, self.i)
        if m is None:
            raise _Unknown
        self.i = m.end()
        if self.peek("e") or self.peek("E") or self.peek("."):
            raise _Unknown  # Euler's e, "1.2.3"
        value = Fraction(m.group(0))
        if self.peek("\\frac{") and re.fullmatch(r"\d+", m.group(0)):  # mixed number 2\frac{1}{2}
            self.take("\\frac{")
            num = self.expr()
            if not self.take("}{"):
                raise _Unknown
            den = self.expr()
            if not self.take("}") or den == 0 or num.denominator != 1 or den.denominator != 1:
                raise _Unknown
            value += num / den
        return value

    def atom(self) -> Fraction:
        if self.take("("):
            v = self.expr()
            if not self.take(")"):
                raise _Unknown
            return v
        if self.take("\\frac{"):
            num = self.expr()
            if not self.take("}{"):
                raise _Unknown
            den = self.expr()
            if not self.take("}") or den == 0:
                raise _Unknown
            return num / den
        if self.take("{"):
            v = self.expr()
            if not self.take("}"):
                raise _Unknown
            return v
        return self.number()

    def power(self) -> Fraction:
        base = self.atom()
        if self.take("^"):
            exp = self.atom() if self.peek("{") or self.peek("(") else Fraction(self.s[self.i]) if self.s[self.i:self.i + 1].isdigit() else None
            if exp is None:
                raise _Unknown
            if not self.s[self.i - 1] in "})":
                self.i += 1
            if exp.denominator != 1 or abs(exp) > 12 or (base == 0 and exp < 0):
                raise _Unknown
            base = base ** int(exp)
        return base

    def factor(self) -> Fraction:
        if self.take("-"):
            return -self.factor()
        if self.take("+"):
            return self.factor()
        return self.power()

    def term(self) -> Fraction:
        v = self.factor()
        while True:
            if self.take("\\cdot"):
                v *= self.factor()
            elif self.peek("(") or self.peek("\\frac{"):
                v *= self.factor()  # implicit product
            else:
                return v

    def expr(self) -> Fraction:
        v = self.term()
        while True:
            if self.take("+"):
                v += self.term()
            elif self.take("-"):
                v -= self.term()
            else:
                return v

    @classmethod
    def item(cls, text: str) -> set[Fraction]:
        text = re.sub(r"^x=", "", text)
        text = re.sub(r"\\text\{ cm\}$", "", text)
        percent = text.endswith("\\%")
        if percent:
            text = text[: -len("\\%")]
        ref = cls(text)
        if not text:
            raise _Unknown
        value = ref.expr()
        if ref.i != len(text):
            raise _Unknown
        return {value, value / 100} if percent else {value}

    @classmethod
    def readings(cls, answer: str) -> list[set[Fraction]]:
        """One set of possible values per item of the answer."""
        s = answer.replace("\\$", "").replace("\\text{ or }", " , ")
        s = s.strip().rstrip(".").strip()
        if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators, no spaces
            s = s.replace(",", "")
        s = s.replace(" ", "").rstrip(".")
        if s.startswith("x=") and "x=" not in s[2:]:
            s = s[2:]
        if "(" in s and "," in s:
            raise _Unknown  # tuples and intervals are outside the grammar
        items = s.split(",") if "," in s else [s]
        return [cls.item(it) for it in items]


def _truly_equal(pred: str, gold: list[set[Fraction]]) -> bool:
    items = _Reference.readings(pred)
    if len(items) != len(gold):
        return False
    golds = [next(iter(g)) for g in gold]
    owner = [-1] * len(golds)

    def augment(i, seen):
        for j, g in enumerate(golds):
            if g in items[i] and not seen[j]:
                seen[j] = True
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(augment(i, [False] * len(golds)) for i in range(len(items)))


_MATH_TOKENS = [str(d) for d in range(10)] + [
    ".", ",", "-", "+", "e", "E", "\\%", " ", "x=", "\\frac{", "}{", "}", "{", "(", ")", "^", "\\cdot", "\\$",
    "\\text{ cm}", "\\text{ or }", "00", ",000", "9999999", "0000001",
]


def _mutate(s: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 2)):
        op = rng.random()
        pos = rng.randint(0, len(s))
        if op < 0.45 or not s:
            s = s[:pos] + rng.choice(_MATH_TOKENS) + s[pos:]
        elif op < 0.7:
            s = s[:pos] + s[pos + rng.randint(1, 3):]
        elif op < 0.9:
            s = s[:pos] + rng.choice(_MATH_TOKENS) + s[pos + 1:]
        else:
            j = rng.randint(0, len(s))
            s = s + s[min(pos, j):max(pos, j)]
    return s[:60]


# gold as the dataset writes it, its true value for the reference, and wrong starting answers
MATH_SEARCHES = [
    ("#### 72", "72", ["71", "720", "7.2", "72.5"]),
    ("#### 1000000", "1000000", ["1000001", "999999", "100000"]),
    (r"\frac{3}{4}", "0.75", ["0.7", "\\frac{3}{5}", "75"]),
    ("0.5", "0.5", ["0.4999999", "5", "0.05"]),
    ("2, 3", "2, 3", ["2, 4", "2", "2, 3, 3"]),
]


@pytest.mark.parametrize("gold,gold_value,start", MATH_SEARCHES, ids=[g for g, _, _ in MATH_SEARCHES])
def test_math_random_search_finds_no_false_positive(gold, gold_value, start):
    rng = random.Random(f"math:{gold}")
    truth = _Reference.readings(gold_value)
    assert not any(_truly_equal(s, truth) for s in start)
    pool, seen = list(start), set(start)
    false_positives, false_negatives, found_right = [], [], 0
    for _ in range(5):  # rounds of a random walk: every mutant joins the pool
        batch = []
        while len(batch) < 40:
            m = _mutate(rng.choice(pool), rng)
            if m not in seen:
                seen.add(m)
                batch.append(m)
        rewards = math_reward([f"so $\\boxed{{{m}}}$" for m in batch], [gold] * len(batch), math_timeout=2.0)
        for m, r in zip(batch, rewards):
            try:
                right = _truly_equal(m, truth)
            except (_Unknown, ZeroDivisionError, ValueError, IndexError):
                right = None
            if r == 1.0 and right is not True:
                false_positives.append((m, "reference: " + ("unknown" if right is None else "wrong")))
            if right is True:
                found_right += 1
                if r != 1.0:
                    false_negatives.append(m)
        pool.extend(batch)
    assert not false_positives, false_positives
    assert not false_negatives, false_negatives


# ============================================================================= code
def _block(code: str) -> str:
    return f"```python\n{code}\n```"


SQUARE_TESTS = [
    "assert f(2) == 4",
    "assert f(3) == 9",
    "assert f(-1) == 1",
    "assert len(str(f(3))) == 1",
    "assert isinstance(f(2), int)",
    "assert sum([f(1), f(1)]) == 2",
    "assert f(0) is not None and f(0) == 0",
    "assert math.isclose(f(2), 4)",  # math unimported: the program's `import math` provides it
    "assert 9 in [f(3)] or 9 in f(3)",
    "assert W(f(3)) == W(9)",  # W: a class of the program (the reference's is `class W(int)`)
    "assert np.allclose(f(2), 4)",  # numpy is not there: the reference fails it, so must the reward
    "assert abs(f(2) - 4) < 1e-9",  # issue 42: the float checks of HumanEval / MBPP, the judge's own `-`
    "assert (9 - f(3)) ** 2 < 1e-9",
]

# bodies of f: data-valued ones get their true value from a plain in-process run; the others are
# worth what the plain value they stand for is worth (an int subclass that claims equality with
# everything is still the int it holds), or 0 when they are no answer at all (objects, exits)
DATA_CORES = ["return x + 2", "return 4", "return x * 3", "return abs(x)", "return x * x + 1", "return 2 ** x",
              "return [x * x]", "return str(x * x)", "return float(x * x) + 0.5", "return None", "return -x * x",
              "return range(x * x, x * x + 1)", "return []"]
OBJECT_CORES = {"return A()": None, "return I(x * x + 1)": "return x * x + 1", "return L()": "return []",
                "return T()": None, "return C()": None, "return Z()": None, "raise SystemExit(0)": None, "import os\n    os._exit(0)": None}
# side channels a program may add around f. Not here: patching the executor's own reply code
# (``sys.modules['__main__'].encode_value = ...``) — the executor is the candidate's process, so
# that only chooses f's answers another way (as ``f = lambda x: 4`` would), it cannot beat them.
TRICKS = [
    "class A:\n    def __eq__(self, o):\n        return True\n    def __bool__(self):\n        return True\n    def __len__(self):\n        return 1\n    __hash__ = object.__hash__",
    "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__",
    "class L(list):\n    def __eq__(self, o):\n        return True",
    "class T:\n    def __bool__(self):\n        return True",
    "class C:\n    def __contains__(self, x):\n        return True\n    def __iter__(self):\n        return iter([A()])",
    # issue 42: arithmetic that answers the test's check (forwarded, `f(x) - want` would be 0)
    "class Z:\n    def __sub__(self, o):\n        return 0\n    __rsub__ = __sub__\n    def __pow__(self, k):\n        return 0\n    def __abs__(self):\n        return 0",
    "def len(x):\n    return 1",
    "def isinstance(*a):\n    return True",
    "def sum(xs):\n    return 2",
    "def str(x):\n    return '9'",
    "globals()['len'] = lambda x: 1",
    "import builtins\nbuiltins.AssertionError = ZeroDivisionError\nbuiltins.isinstance = lambda *a: True",
    "AssertionError = Exception",
    "import os, struct, json\nfor _rid in range(1, 9):\n    _m = json.dumps({'k': 'ret', 'id': _rid, 'v': 4, 'mut': []}).encode()\n"
    "    for _fd in range(3, 24):\n        try:\n            os.write(_fd, struct.pack('>I', len(_m)) + _m)\n        except OSError:\n            pass",
    "import sys\nsys.setrecursionlimit(60)",
    "import math\nmath.isclose = lambda *a, **k: True",
    "import math",
    "class math:\n    isclose = staticmethod(lambda *a, **k: True)",
    "class W(int):\n    pass",
    "class W(int):\n    def __new__(cls, *a):\n        return int.__new__(cls, 0)",
    "from dataclasses import dataclass\n@dataclass\nclass W:\n    v: int = 0\n    def __init__(self, *a):\n        pass",
    "class W:\n    _one = None\n    def __new__(cls, *a):\n        if cls._one is None:\n            cls._one = object.__new__(cls)\n        return cls._one",
    # issue 31: rewriting the executor's own helpers from inside (the judge no longer asks it what a
    # call built), a W that drops its argument after construction or hands back the last one built,
    # a program-defined numpy
    "import __main__ as _m\n_m._ISSUBCLASS = lambda a, b: False\n_m._REAL_SUBCLASS = lambda a, b: False",
    "import gc\nfor _o in gc.get_objects():\n    if isinstance(_o, dict) and '_ISSUBCLASS' in _o:\n        _o['_ISSUBCLASS'] = lambda a, b: False",
    "from dataclasses import dataclass\n@dataclass\nclass W:\n    v: int = 0\n    def __post_init__(self):\n        self.v = 0",
    "class W:\n    made = []\n    def __init__(self, *a):\n        W.made.append(self)",
    "class np:\n    allclose = staticmethod(lambda *a, **k: True)",
    "from dataclasses import dataclass\n@dataclass(frozen=True)\nclass W:\n    v: int",
]
CORE_CLASSES = 6  # TRICKS[:6] define the classes the object cores return: every program has them


def _true_value(core: str) -> float:
    if core in OBJECT_CORES:
        core = OBJECT_CORES[core]
        if core is None:
            return 0.0
    ns: dict = {"math": math}
    exec(f"def f(x):\n    {core}\nclass W(int):\n    pass\n", ns)
    passed = 0
    for test in SQUARE_TESTS:
        try:
            exec(test, dict(ns))
            passed += 1
        except Exception:
            pass
    return passed / len(SQUARE_TESTS)


def _program(core: str, tricks: list[int], after: list[int]) -> str:
    parts = [TRICKS[t] for t in tricks if t not in after]
    parts.append(f"def f(x):\n    {core}")
    parts += [TRICKS[t] for t in tricks if t in after]
    return "\n".join(parts) + "\n"


def test_code_random_search_finds_no_score_above_true_value():
    rng = random.Random("code")
    cores = DATA_CORES + list(OBJECT_CORES)
    cfg = SandboxConfig(timeout=1.0, memory_mb=512)

    def random_genome():
        tricks = rng.sample(range(len(TRICKS)), rng.randint(0, 3)) + list(range(CORE_CLASSES))
        return rng.choice(cores), sorted(set(tricks)), [t for t in tricks if rng.random() < 0.3]

    def mutate(genome):
        core, tricks, after = genome
        tricks = list(tricks)
        if rng.random() < 0.4:
            core = rng.choice(cores)
        if rng.random() < 0.6:
            tricks.append(rng.randrange(len(TRICKS)))
        elif len(tricks) > CORE_CLASSES:
            tricks.remove(rng.choice(tricks[CORE_CLASSES:]))
        return core, sorted(set(tricks)), [t for t in tricks if rng.random() < 0.3]

    genomes = [random_genome() for _ in range(24)]
    excess = []
    for _ in range(2):
        programs = [_program(*g) for g in genomes]
        rewards = code_reward([_block(p) for p in programs], tests=[SQUARE_TESTS] * len(programs), sandbox_config=cfg)
        scored = []
        for genome, program, reward in zip(genomes, programs, rewards):
            truth = _true_value(genome[0])
            if reward > truth + 1e-9:
                excess.append((reward, truth, program))
            scored.append((reward - truth, reward, genome))
        # keep searching from the programs that came closest to (or above) their true value
        scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
        parents = [g for _, _, g in scored[:8]]
        genomes = [mutate(rng.choice(parents)) for _ in range(24)]
    assert not excess, excess
