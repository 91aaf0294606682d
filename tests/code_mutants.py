"""Mutants of the code reward's issue-42 classes, generated systematically (written for this project):
each is ``(cls, name, program, tests, want)`` where ``want`` is the score the program is worth —
0.0 for a hostile mutant (its answer is wrong: an object that is no number, an identity where a
builtin was asked for, one fixed enum member, a registry's last object), 1.0 for a fair one (plain
CPython passes every test; ``tests/test_rewards_code.py`` checks that for the fair ones).

Used by ``tests/test_rewards_code.py`` (a fixed sample in CI) and ``benchmarks/code_reward.py --mutants``
(all of them, per class, optionally before / after with ``--baseline``)."""

from __future__ import annotations

import builtins

# ----------------------------------------------------------------------------- arithmetic forwarded
# a program object's dunders (each gives the test's check what it wants to see) x the float checks
# of HumanEval / MBPP. The object is no number: every mutant is worth 0.
_Z = "class Z:\n    def __init__(self, v=0):\n        self.v = v\n"
ARITH_DUNDERS = {
    "sub0": "    def __sub__(self, o):\n        return 0\n",
    "rsub0": "    def __rsub__(self, o):\n        return 0\n",
    "sub_self_pow0": "    def __sub__(self, o):\n        return self\n    def __pow__(self, k):\n        return 0\n",
    "sub_obj_abs0": "    def __sub__(self, o):\n        return Z()\n    def __abs__(self):\n        return 0.0\n    def __round__(self, n=0):\n        return 0\n",
    "truediv1": "    def __truediv__(self, o):\n        return 1.0\n    def __rtruediv__(self, o):\n        return 1.0\n",
    "add0_radd0": "    def __add__(self, o):\n        return 0\n    def __radd__(self, o):\n        return 0\n",
    "neg_self_add0": "    def __neg__(self):\n        return self\n    def __add__(self, o):\n        return 0\n    def __radd__(self, o):\n        return 0\n",
    "isub0": "    def __isub__(self, o):\n        return 0\n",
    "all_zero": "".join("    def __%s__(self, *o):\n        return 0\n" % n for n in
                     ("sub", "rsub", "add", "radd", "pow", "abs", "neg", "truediv", "rtruediv", "mul", "rmul", "mod", "round")),
}
ARITH_CHECKS = [
    "assert abs(f(2) - 4.0) < 1e-6",
    "assert abs(4.0 - f(2)) < 1e-6",
    "assert (f(2) - 4) ** 2 < 1e-12",
    "assert f(3) - 9 == 0",
    "assert 9 - f(3) == 0",
    "assert abs(f(2) / 4 - 1) < 1e-9",
    "assert -4 + f(2) == 0",
    "assert -f(2) + 4 == 0",
    "import math\nassert math.isclose(f(2) - 4, 0, abs_tol=1e-9)",
    "assert round(f(2) - 4, 6) == 0",
    "d = f(2)\nd -= 4\nassert d == 0",
    "assert all(abs(a - b) < 1e-9 for a, b in zip([f(1), f(2)], [1.0, 4.0]))",
]


def arithmetic_mutants():
    out = []
    for key, body in ARITH_DUNDERS.items():
        for i, check in enumerate(ARITH_CHECKS):
            out.append(("arith", "arith_%s_%d" % (key, i), _Z + body + "def f(x):\n    return Z(x)", [check], 0.0))
    for i, check in enumerate(ARITH_CHECKS):  # the same checks on a float answer
        out.append(("arith", "arith_fair_float_%d" % i, "def f(x):\n    return float(x * x)", [check], 1.0))
        out.append(("arith", "arith_fair_float_of_object_%d" % i, _Z + "    def __float__(self):\n        return float(self.v * self.v)\n"
                    "def f(x):\n    return float(Z(x))", [check], 1.0))
    return out


# ----------------------------------------------------------------------------- builtin-named definitions
# the test composes two builtins; the program defines both: the inner one wrong (identity) and the outer
# one answering the expected value. Fair: both right (they call the real builtin).
_BUILTINS = ["sorted", "list", "tuple", "set", "sum", "max", "min", "len", "str", "abs", "reversed", "frozenset"]
_ARGS = ["(3, 1, 2)", "[3, -1, 2, 2]", "[-5]", "'bca'"]


def builtin_mutants():
    out = []
    for outer in _BUILTINS:
        for inner in _BUILTINS:
            if outer == inner or (inner in ("set", "frozenset") and outer in ("list", "tuple", "str")):
                continue  # (the order of a set of strings differs between processes)
            for arg in _ARGS:
                try:
                    want = getattr(builtins, outer)(getattr(builtins, inner)(eval(arg)))
                    identity = getattr(builtins, outer)(eval(arg))
                except Exception:
                    continue
                if type(want) not in (int, str, list, tuple, set, frozenset) or identity == want or " at 0x" in repr(want):
                    continue  # the composition is not a value, or an identity inner would pass anyway
                test = ["assert %s(%s(%s)) == %r" % (outer, inner, arg, want)]
                hostile = "def %s(x):\n    return x\ndef %s(x):\n    return %r" % (inner, outer, want)
                fair = "import builtins\ndef %s(x):\n    return builtins.%s(x)\ndef %s(x):\n    return builtins.%s(x)" % (inner, inner, outer, outer)
                tag = "%s_%s_%d" % (outer, inner, _ARGS.index(arg))
                out.append(("builtin", "shadow_" + tag, hostile, test, 0.0))
                out.append(("builtin", "shadow_fair_" + tag, fair, test, 1.0))
    return out


# ----------------------------------------------------------------------------- enum members
# the program always answers one member and rewrites its class so that the others look like it
_ENUMS = {
    "literal": "from enum import Enum\nclass C(Enum):\n    RED = 1\n    GREEN = 2\n    BLUE = 3\n",
    "auto": "from enum import Enum, auto\nclass C(Enum):\n    RED = auto()\n    GREEN = auto()\n    BLUE = auto()\n",
    "strings": "import enum\nclass C(enum.Enum):\n    RED = 'r'\n    GREEN = 'g'\n    BLUE = 'b'\n",
    "intenum": "from enum import IntEnum\nclass C(IntEnum):\n    RED = 1\n    GREEN = 2\n    BLUE = 3\n",
    "strenum": "from enum import StrEnum, auto\nclass C(StrEnum):\n    RED = auto()\n    GREEN = auto()\n    BLUE = 'b'\n",
}
_VALUES = {"literal": (1, 2, 3), "auto": (1, 2, 3), "strings": ("r", "g", "b"), "intenum": (1, 2, 3), "strenum": ("red", "green", "b")}
_REBINDS = {
    "type_setattr": "type.__setattr__(C, 'GREEN', C.RED)\ntype.__setattr__(C, 'BLUE', C.RED)\n",
    "member_map": "C._member_map_['GREEN'] = C.RED\nC._member_map_['BLUE'] = C.RED\n",
    "value_map": "C._value2member_map_[{g!r}] = C.RED\nC._value2member_map_[{b!r}] = C.RED\n",
    "both_maps": "C._member_map_['GREEN'] = C.RED\nC._value2member_map_[{g!r}] = C.RED\ntype.__setattr__(C, 'GREEN', C.RED)\n",
    "member_names": "type.__setattr__(C, '_member_names_', ['RED'])\n",
}
_ENUM_CHECKS = ["assert pick({g!r}) == C({g!r})", "assert pick({g!r}) == C.GREEN", "assert pick({g!r}) == C['GREEN']",
                "assert pick({g!r}) is C({g!r})", "assert pick({g!r}) in [C.GREEN]", "assert {{pick({g!r}): 1}} == {{C.GREEN: 1}}",
                "assert [pick(v) for v in {vals!r}] == list(C)"]


def enum_mutants():
    out = []
    for ekey, src in _ENUMS.items():
        r, g, b = _VALUES[ekey]
        for rkey, rebind in _REBINDS.items():
            for i, check in enumerate(_ENUM_CHECKS):
                prog = src + rebind.format(g=g, b=b) + "def pick(v):\n    return C.RED"
                out.append(("enum", "enum_%s_%s_%d" % (ekey, rkey, i), prog, [check.format(g=g, vals=(r, g, b))], 0.0))
        for i, check in enumerate(_ENUM_CHECKS):
            prog = src + "def pick(v):\n    return C(v)"
            out.append(("enum", "enum_fair_%s_%d" % (ekey, i), prog, [check.format(g=g, vals=(r, g, b))], 1.0))
    return out


# ----------------------------------------------------------------------------- registries
# the program keeps every object the test builds and answers the last one; the test used its expected
# object before the call (never handed it to the call). Fair: the call is handed the object.
_CLASSES = {
    "init_registry": "class Point:\n    made = []\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n        Point.made.append(self)\n",
    "new_registry": "class Point:\n    made = []\n    def __new__(cls, *a):\n        self = object.__new__(cls)\n        Point.made.append(self)\n        return self\n"
                    "    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
}
_METHODS = ("    def norm1(self):\n        return abs(self.x) + abs(self.y)\n    def __repr__(self):\n        return 'P'\n"
            "    def __len__(self):\n        return 2\n    def __iter__(self):\n        return iter((self.x, self.y))\n    def me(self):\n        return self\n")
_USES = ["e.norm1()", "e.x", "e.x = 1", "repr(e)", "str(e)", "len(e)", "list(e)", "touch(e)", "e.me()", "hash(e)"]


def registry_mutants():
    out = []
    for ckey, cls in _CLASSES.items():
        base = cls + _METHODS + "def touch(p):\n    return p.x\n"
        for i, use in enumerate(_USES):
            prog = base + "def mid(a, b):\n    return Point.made[-1]"
            test = "e = Point(1, 2)\n%s\nassert mid(0, 4) == e" % use
            out.append(("registry", "registry_%s_%d" % (ckey, i), prog, [test], 0.0))
        fair = base + "def same(p):\n    return p\n"
        for i, test in enumerate(["e = Point(1, 2)\nassert same(e) == e", "e = Point(1, 2)\nassert e.me() == e",
                                  "e = Point(1, 2)\nr = e.me()\nassert r.me() == e", "e = Point(1, 2)\nassert same([e])[0] == e"]):
            out.append(("registry", "registry_fair_%s_%d" % (ckey, i), fair, [test], 1.0))
    return out


# ----------------------------------------------------------------------------- dataclasses (fair)
_DEFAULTS = {"literal": "0.5", "math_inf": "math.inf", "neg_math_inf": "-math.inf", "float_inf": "float('inf')",
             "from_math_pi": "2 * pi", "expr": "10 ** 9 + 7"}
_FACTORIES = {"lambda_list": "field(default_factory=lambda: [0, 0])", "lambda_dict": "field(default_factory=lambda: {'k': [1]})",
              "lambda_repeat": "field(default_factory=lambda: [None] * 3)", "builtin_list": "field(default_factory=list)"}


def dataclass_mutants():
    head = "import math\nfrom math import pi\nfrom dataclasses import dataclass, field\n"
    out = []
    specs = {**{k: v for k, v in _DEFAULTS.items()}, **_FACTORIES}
    for key, default in specs.items():
        for depth in (0, 1, 2):
            classes = ["@dataclass\nclass A:\n    a: int\n"]
            for level in range(depth):
                classes.append("@dataclass\nclass %s(%s):\n    %s: int = %d\n" % ("BC"[level], "AB"[level], "bc"[level], level + 1))
            last = "ABC"[depth]
            classes.append("@dataclass\nclass D(%s):\n    d: object = %s\n" % (last, default))
            prog = head + "".join(classes) + "def make(a):\n    return D(a)"
            given = ", ".join(["1"] + ["%d" % (level + 1) for level in range(depth)])
            tests = ["assert make(1) == D(1)", "assert make(1) == D(%s)" % given, "assert make(2) != D(1)",
                     "assert isinstance(D(1), A)", "assert make(1).d == D(1).d"]
            out.append(("dataclass", "dataclass_%s_depth%d" % (key, depth), prog, tests, 1.0))
    return out


def all_mutants():
    return arithmetic_mutants() + builtin_mutants() + enum_mutants() + registry_mutants() + dataclass_mutants()
