r"""Red-team search of the math reward: mutations of right answers, judged by an independent reference.

Every seed is a row of the answer table (``tests/math_answer_table.py``) whose expected result is "equal", in both
directions (the prediction against the gold, the gold against the prediction), kept when the reference below reads
both sides and agrees that they are equal. Each mutant rewrites the seed's answer once or twice, with fixed seeds:
a digit changed, a minus dropped or inserted, a fraction turned over or divided by zero, a symbol appended
(``i``, ``e``, ``x``, ``\pi``, also as ``\mathrm{i}`` or ``\text{ x}``), the answer wrapped in ``\text{}``, a unit
word or a number word added, a set or list element repeated, an interval's brackets or endpoints exchanged,
a minus written with a unicode look-alike, ``\frac{1}{2}`` written ``½``, a trailing full stop, thousands
separators, a run of whitespace, an implicit product ``2(…)``, a multiple-choice letter doubled; and for the rules
of issue 31: two named values exchanged or a name changed, an integer written in another base with its subscript
(sometimes under a wrong base), a fraction written as its repeating decimal or a number with a period of nines,
Euler's e added inside an expression (``+2e-2e``, ``+2\mathrm{e}-2``), a space between two digits.

The verdict on each mutant comes from :class:`Ref`, written here for the restricted grammar the mutations produce
(integers, decimals, repeating decimals, base numerals, fractions, ``+ - \cdot \times / ^``, the symbols
``i e x \pi`` to the first power, percent, sets, lists, tuples and intervals, named values, choice letters, unit
words and number words) with exact ``Fraction``
arithmetic, and the documented rules (``docs/rewards.md``) spelled out on that grammar: never the reward under
test. A mutant the reference cannot read is left out (and counted). The reward must agree with the reference:
1.0 where the value is kept, 0.0 where it changed or is undefined.

CI runs a fixed sample of ``SAMPLE`` mutants; the full search (``FULL`` mutants) is ``slow``:

    python -m pytest -q -m slow tests/test_math_red_team.py -s     # prints the counts per mutation
"""

from __future__ import annotations

import itertools

import random
import re
import time
from collections import Counter
from decimal import Decimal
from fractions import Fraction

import pytest

from dllm_trl.rewards import math_reward

from .math_answer_table import MATH_TABLE

FULL = 9000
SAMPLE = 300
SEED = 20240607

pytestmark = pytest.mark.timeout(300)


# ============================================================================= the reference
class Unknown(Exception):
    """Outside the reference's grammar: the mutant is not judged."""


class Undefined(Exception):
    """A division by zero: the answer equals nothing, itself included."""


NEVER = ("never",)  # an answer equal to nothing (undefined, refused)

UNIT_WORDS = {"cm", "meters", "dollars", "degrees", "units", "inches", "apples", "hours", "km/h", "square units"}
MULTIPLIERS = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9, "dozen": 12,
               # issue 42: the multipliers of other languages, plurals where the language counts with them, runs
               "lakh": 10**5, "lakhs": 10**5, "crore": 10**7, "crores": 10**7, "myriad": 10**4, "milliard": 10**9,
               "milliards": 10**9, "millones": 10**6, "hundred thousand": 10**5, "thousand crore": 10**10}
REFUSED_WORDS = {"squared", "cubed", "half", "halves", "tens", "thousands", "millions", "quarter", "thirds",
                 "twelfths", "sevenths", "sixteenths", "twentieths", "elevens",  # also outside the reward's list
                 "myriads", "thousand hundred"}
UNIT_LETTERS = {"s", "m", "g", "h"}  # a unit after a plain number (or in a text wrapper), else the problem's variable
# digits of other scripts (issue 42): Arabic-Indic, extended Arabic-Indic, Devanagari, fullwidth, mathematical bold
DIGIT_SCRIPTS = (0x0660, 0x06F0, 0x0966, 0xFF10, 0x1D7CE)
SUPERSCRIPT_DIGITS = "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079"
SYMBOLS = {"i": "i", "e": "e", "x": "x", "\\pi": "pi", "\\euler": "e"}  # \euler: \mathrm{e} as the reference reads it
MINUS_LOOKALIKES = "\u2010\u2011\u2012\u2013\u2212\ufe63\uff0d"
VULGAR = {"½": Fraction(1, 2), "⅓": Fraction(1, 3), "⅔": Fraction(2, 3), "¼": Fraction(1, 4), "¾": Fraction(3, 4),
          "⅕": Fraction(1, 5), "⅛": Fraction(1, 8), "⅜": Fraction(3, 8), "⅝": Fraction(5, 8), "⅞": Fraction(7, 8)}
WRAPPERS = ("\\text", "\\mathrm", "\\mathit", "\\textbf", "\\mbox")

_TOKEN = re.compile(
    r"\s*(?:(?P<rep>\d*\.\d*(?:\\(?:overline|bar)\{\d+\}|\\(?:bar|dot)\d))|(?P<num>\d+\.?\d*|\.\d+)"
    r"|(?P<cmd>\\[A-Za-z]+)|(?P<ch>[-+/^(){}\[\]ixe])|(?P<vulgar>[" + "".join(VULGAR) + r"]))"
)
E_NOTATION = re.compile(r"-?(\d+\.?\d*|\.\d+)[eE][+-]?\d{1,3}")  # e-notation: only a whole item


def _repeating(tok):
    """``0.1\\overline{6}`` → 1/6: the fixed digits, then the period repeated forever."""
    m = re.fullmatch(r"(\d*)\.(\d*)\\(?:overline|bar|dot)\{?(\d+)\}?", tok)
    whole, fixed, period = m.group(1) or "0", m.group(2), m.group(3)
    return Fraction(int(whole + fixed + period) - int(whole + fixed), (10 ** len(period) - 1) * 10 ** len(fixed))


def _form(const=Fraction(0), **syms):
    """A value: a linear form over 1 and the symbols, as a frozenset of (name, coefficient), zeros dropped."""
    d = {"1": Fraction(const)}
    d.update({k: Fraction(v) for k, v in syms.items()})
    return frozenset((k, v) for k, v in d.items() if v != 0)


def _add(a, b, sign=1):
    d = dict(a)
    for k, v in b:
        d[k] = d.get(k, Fraction(0)) + sign * v
    return frozenset((k, v) for k, v in d.items() if v != 0)


def _const(a):
    d = dict(a)
    if set(d) - {"1"}:
        return None
    return d.get("1", Fraction(0))


def _mul(a, b):
    ca, cb = _const(a), _const(b)
    if ca is None and cb is None:
        raise Unknown("product of two symbols")
    c, other = (ca, b) if ca is not None else (cb, a)
    return frozenset((k, v * c) for k, v in other if v * c != 0)


class _Expr:
    """Recursive descent over the scalar grammar; values are linear forms (see :func:`_form`)."""

    def __init__(self, text):
        self.toks = []
        i = 0
        text = text.rstrip()
        while i < len(text):
            m = _TOKEN.match(text, i)
            if m is None or m.end() == i:
                raise Unknown(text[i:])
            kind = m.lastgroup
            self.toks.append((kind, m.group(kind), text[m.start(kind) - 1] == " " if m.start(kind) > 0 else False))
            i = m.end()
        self.i = 0

    def peek(self, value=None, kind=None):
        if self.i >= len(self.toks):
            return False
        k, v, _ = self.toks[self.i]
        return (value is None or v == value) and (kind is None or k == kind)

    def take(self, value):
        if self.peek(value):
            self.i += 1
            return True
        return False

    def parse(self):
        v = self.expr()
        if self.i != len(self.toks):
            raise Unknown("trailing tokens")
        return v

    def expr(self):
        sign = -1 if self.take("-") else (self.take("+") and 1) or 1
        v = _mul(_form(sign), self.term())
        while self.peek("+") or self.peek("-"):
            s = 1 if self.toks[self.i][1] == "+" else -1
            self.i += 1
            v = _add(v, self.term(), s)
        return v

    def term(self):
        v = self.power()
        while True:
            if self.take("\\cdot") or self.take("\\times"):
                v = _mul(v, self.power())
            elif self.take("/"):
                d = _const(self.power())
                if d is None:
                    raise Unknown("division by a symbol")
                if d == 0:
                    raise Undefined
                v = _mul(v, _form(1 / d))
            elif self.peek(kind="cmd") and self.toks[self.i][1] in ("\\frac", "\\pi", "\\euler") or self.peek("(") \
                    or (self.peek(kind="ch") and self.toks[self.i][1] in "ixe") or self.peek(kind="vulgar"):
                if self.toks[self.i][2]:
                    raise Unknown("space before an implicit product")
                v = _mul(v, self.power())  # implicit product
            else:
                return v

    def power(self):
        if self.take("-"):
            return _mul(_form(-1), self.power())
        base = self.atom()
        if self.take("^"):
            if self.take("{"):
                e = self.expr()
                if not self.take("}"):
                    raise Unknown("^{")
            elif self.peek(kind="num") and re.fullmatch(r"\d", self.toks[self.i][1]):
                e = _form(int(self.toks[self.i][1]))
                self.i += 1
            else:
                raise Unknown("^")
            b, n = _const(base), _const(e)
            if b is None or n is None or n.denominator != 1 or abs(n) > 64:
                raise Unknown("power")
            if b == 0 and n <= 0:
                raise Undefined  # a division by zero, or the indeterminate 0^0 (issue 42)
            base = _form(b ** int(n))
        return base

    def frac(self):
        if self.peek(kind="num") and re.fullmatch(r"\d\d", self.toks[self.i][1]):  # \frac12
            digits = self.toks[self.i][1]
            self.i += 1
            if int(digits[1]) == 0:
                raise Undefined
            return _form(Fraction(int(digits[0]), int(digits[1])))
        if not self.take("{"):
            raise Unknown("\\frac without braces")
        num = self.expr()
        if not (self.take("}") and self.take("{")):
            raise Unknown("\\frac")
        den = self.expr()
        if not self.take("}"):
            raise Unknown("\\frac")
        d = _const(den)
        if d is None:
            raise Unknown("symbolic denominator")
        if d == 0:
            raise Undefined
        return _mul(num, _form(1 / d))

    def atom(self):
        if self.i >= len(self.toks):
            raise Unknown("end")
        kind, tok, _ = self.toks[self.i]
        self.i += 1
        if kind == "rep":
            return _form(_repeating(tok))
        if kind == "num":
            value = Fraction(tok)
            nxt = self.toks[self.i] if self.i < len(self.toks) else None
            fraction_next = nxt is not None and (nxt[1] in ("\\frac", "\\dfrac") or nxt[0] == "vulgar")
            if fraction_next and not nxt[2] and re.fullmatch(r"\d+", tok):
                # a mixed number: 2\frac{1}{2} = 2 + 1/2 (whole and fraction of integers), 2½ likewise
                self.i += 1
                if nxt[0] == "vulgar":
                    part = VULGAR[nxt[1]]
                else:
                    start = self.i
                    part = _const(self.frac())
                    inner = [t[1] for t in self.toks[start:self.i]]
                    if len(inner) != 6 or not all(re.fullmatch(r"\d+", t) for t in inner[1:5:3]):
                        raise Unknown("mixed number with a non-integer fraction")
                if self.i < len(self.toks) and self.toks[self.i][1] not in ("+", "-", "}", ")"):
                    raise Unknown("mixed number followed by a product")
                return _form(value + part)
            return _form(value)
        if kind == "vulgar":
            return _form(VULGAR[tok])
        if tok in ("\\frac", "\\dfrac", "\\tfrac"):
            return self.frac()
        if tok == "(":
            v = self.expr()
            if not self.take(")"):
                raise Unknown("(")
            return v
        if tok == "{":
            v = self.expr()
            if not self.take("}"):
                raise Unknown("{")
            return v
        if tok in SYMBOLS:
            return _form(**{SYMBOLS[tok]: 1})
        raise Unknown(tok)


def _split_top(s):
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
        i += 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _balanced_inner(s, opener, closers):
    """``s`` is ``opener … closer`` with the opener's match at the very end: the inner text, else None."""
    if not s.startswith(opener):
        return None
    depth, i = 0, 0
    while i < len(s):
        step, closing = 1, False
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            step, closing = 2, s[i + 1] == "}"
            depth += -1 if closing else 1
        elif s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
            closing = True
        if closing and depth == 0:
            return s[len(opener):i] if i + step == len(s) and s[i:i + step] in closers else None
        i += step
    return None


def _scalar(text):
    text = text.strip()
    if re.search(r"[-+]\s*[-+]", text):
        raise Unknown("two signs in a row")
    if re.search(r"\d\s+[eE]|[eE]\s+[-+\d]|[eE][-+]\s+\d", text):
        raise Unknown("whitespace inside e-notation")
    if re.search(r"\\(?:overline|bar|dot)(?:\{\d+\}|\d)\s*(?:[\d.(\[{]|\\[dt]?frac|[" + "".join(VULGAR) + "])", text):
        return NEVER  # a repeating decimal followed by what would continue a number
    if re.search(r"\d_", text):
        if re.fullmatch(r"[\w{}+\-^\\.()]+", text):
            return NEVER  # a subscripted numeral inside an expression is not read
        raise Unknown("subscript")
    literal = text
    if E_NOTATION.fullmatch(text):
        literal = format(Decimal(text), "f")  # e-notation is the exact decimal it writes
        value = _form(Fraction(literal))
    else:
        value = _Expr(text).parse()
    lone = re.fullmatch(r"-?(\d*)\.(\d+)", literal)
    approx = None
    if lone:
        digits = (lone.group(1) + lone.group(2)).lstrip("0")
        approx = (len(digits), Fraction(1, 10 ** len(lone.group(2))))
    return ("num", value, approx)


def _item(s):
    """One item of an answer: a number (with its decimal precision), percent, choice, set, tuple, or NEVER."""
    s = s.strip()
    inner = _balanced_inner(s, "{", {"}"})
    if inner is not None:
        return _item(inner)  # grouping braces around the whole item
    m = re.fullmatch(r"([a-z](?:_\{?\d\}?)?|\(x,y\))\s*=\s*(.+)", s)
    if m and "=" not in m.group(2):
        return ("assign", re.sub(r"_\{(\d)\}", r"_\1", m.group(1)), _item(m.group(2)))
    m = re.fullmatch(r"(\d[0-9A-Z]*)_(?:\{(\d{1,2})\}|(\d))", s)
    if m:  # a base numeral: its value; a digit the base lacks makes it nothing
        base = int(m.group(2) or m.group(3))
        try:
            return ("base", int(m.group(1), base), m.group(1)) if 2 <= base <= 36 else NEVER
        except ValueError:
            return NEVER
    for w in WRAPPERS:
        inner = _balanced_inner(s, w + "{", {"}"})
        if inner is not None:
            return _item(inner)
    # a choice letter, alone or followed by the choice's value
    s = re.sub(r"\\(?:text|textbf|mathrm)\{\s*(\([A-E]\))\s*\}", r"\1", s)
    m = re.fullmatch(r"\(([A-E])\)\s*(.*)", s) or re.fullmatch(r"([A-E])()", s)
    if m:
        rest = m.group(2).strip()
        if rest == "":
            return ("choice", m.group(1))
        if re.search(r"[A-E]", rest):
            return NEVER  # two choices: "(A)(B)", "(A)B"
        _scalar(rest)  # the rest must read as a value
        return ("choice", m.group(1))
    # a single-letter symbol in a text wrapper is the symbol: 1+2\mathrm{i} = 1+2i
    s = re.sub(r"\\(?:text|mathrm|mathit)\{\s*e\s*\}", r"\\euler ", s)  # Euler's e: never part of e-notation
    s = re.sub(r"\\(?:text|mathrm|mathit)\{\s*([ix])\s*\}", r"\1", s)
    # a trailing word: a unit (dropped), a multiplier (multiplies a plain number), another number word (refused)
    m = re.fullmatch(r"(.*?)\s*\\(?:text|mathrm|mbox)\{\s*([a-z/ ]+?)\s*\}", s)
    m = m or re.fullmatch(r"(.*?\d)\s+([a-z/]+)", s)
    if m:
        body, word = m.group(1).strip(), m.group(2)
        if (word in UNIT_LETTERS or word in UNIT_WORDS) and not re.search(r"\d", body):
            raise Unknown("a unit after a body without a digit (the documented rule drops units only after one)")
        if word in UNIT_LETTERS:
            value = _item(body)
            if value[0] == "never":
                return value
            if value[0] != "num":
                raise Unknown("unit letter after a non-number")
            wrapped = s.rstrip().endswith("}")
            if wrapped or re.fullmatch(r"-?\d+(\.\d+)?(?:[eE][-+]?\d{1,3})?", body):  # e-notation is a number
                return value  # a unit: dropped
            if re.search(r"(?<=.)[-+]", body):
                raise Unknown("a variable letter after a sum multiplies its last term only")
            return ("num", _mul(value[1], _form(**{"letter_" + word: 1})), None)  # the problem's variable
        if word in UNIT_WORDS:
            value = _item(body)
            if value[0] not in ("num", "never"):
                raise Unknown("unit after a non-number")
            return value
        if word in MULTIPLIERS:
            if not re.fullmatch(r"-?\d+(\.\d+)?", body):
                return NEVER
            return ("num", _form(Fraction(body) * MULTIPLIERS[word]), None)
        if word in REFUSED_WORDS:
            return NEVER
        if word == "percent":
            s = body + "\\%"
        else:
            raise Unknown(word)
    if s.endswith("\\%") or s.endswith("%"):
        inner = _scalar(s[:-2] if s.endswith("\\%") else s[:-1])
        if inner == NEVER:
            return NEVER
        if _const(inner[1]) is None:
            raise Unknown("percent of a symbol")
        return ("pct", _const(inner[1]), inner[2])
    inner = _balanced_inner(s, "\\{", {"\\}"})
    if inner is not None:
        return ("set", [_item(p) for p in _split_top(inner)] if inner.strip() else [])
    for opener in ("(", "["):
        inner = _balanced_inner(s, opener, {")", "]"})
        if inner is not None:
            parts = _split_top(inner)
            if len(parts) > 1:
                return ("tuple", opener, s[-1], [_item(p) for p in parts])
    return _scalar(s)


def ref_read(answer):
    """An answer as the reference reads it (raises Unknown)."""
    s = answer
    for ch in MINUS_LOOKALIKES:
        s = s.replace(ch, "-")
    for base in DIGIT_SCRIPTS:  # a digit of any script is that digit
        for d in range(10):
            s = s.replace(chr(base + d), str(d))
    s = re.sub("[" + SUPERSCRIPT_DIGITS + "]+", lambda m: "^{%s}" % "".join(str(SUPERSCRIPT_DIGITS.index(c))
                                                                          for c in m.group(0)), s)
    s = re.sub(r"(?<=\d)\\,(?=\d{3}(?!\d))", "", s)  # a thin space between 3-digit groups: thousands
    s = re.sub(r"\\frac\s*(\d)\s*(\d)(?!\d)", r"\\frac{\1}{\2}", s)  # \frac1 3 is \frac{1}{3}, as TeX reads it
    s = re.sub(r"\\[,;:]", " ", s)  # LaTeX spacing
    s = " ".join(s.split())
    if "####" in s:
        s = s.rsplit("####", 1)[1].strip()
    if "\\boxed" in s or "$" in s.replace("\\$", ""):
        raise Unknown("delimiters")
    s = s.replace("\\$", "").strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()  # a full stop after the answer
    if not s:
        raise Unknown("empty")
    m = re.fullmatch(r"(-?\d{1,3}(?:,\d{3})+(?:\.\d+)?)\.?((?:\s*\\(?:text|mathrm|mbox)\{[a-z/ ]*\}|\s+[a-z/ ]+)?)", s)
    if m:  # thousands separators: the whole answer is one number (a trailing word aside)
        s = m.group(1).replace(",", "") + m.group(2)
    if re.search(r"\d \d", s):
        m = re.fullmatch(r"(\\(?:text|mathrm|mbox|textbf)\{)?(-?\d{1,3}(?: \d{3})+(?:\.\d+)?)(\}?)"
                         r"((?:\s*\\(?:text|mathrm|mbox)\{[a-z/ ]*\}|\s+[a-z/ ]+)?)", s)
        if m is None or bool(m.group(1)) != bool(m.group(3)):
            return NEVER  # two digits split by a space: neither their concatenation nor a product
        s = m.group(2).replace(" ", "") + m.group(4)  # 3-digit groups, the whole answer: thousands
    try:
        parts = _split_top(s)
        if len(parts) > 1 and any(re.search(r"\\(?:text|mathrm|mbox)\{\s*[a-z]{2}|\d\s+[a-z]{2}", p) for p in parts):
            raise Unknown("a word inside a list")
        items = [_item(p) for p in parts]
        if items[0][0] == "assign" and len(items) > 1 and all("=" not in p for p in parts[1:]):
            items = [items[0]] + [("assign", items[0][1], it) for it in items[1:]]  # x = 2, 3: both are x
    except Undefined:
        return NEVER
    if any(it == NEVER for it in items):
        return NEVER
    return ("list", items) if len(items) > 1 else items[0]


def _terminating(r):
    q = r.denominator
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def _approx(decimal, approx, value):
    """The documented decimal-precision rule on rationals: a lone decimal of at least 6 significant digits stands
    for a non-terminating rational that it rounds or truncates."""
    digits, unit = approx
    if digits < 6 or _terminating(value) or decimal == 0 or (decimal > 0) != (value > 0):
        return False
    return abs(decimal) - unit / 2 <= abs(value) < abs(decimal) + unit


def _nums_equal(a, b):
    if a[1] == b[1]:
        return True
    ca, cb = _const(a[1]), _const(b[1])
    if (a[2] is not None and b[2] is None and cb is None) or (b[2] is not None and a[2] is None and ca is None):
        raise Unknown("a long decimal against a symbolic value")
    if ca is None or cb is None:
        return False
    if a[2] is not None and b[2] is None:
        return _approx(ca, a[2], cb)
    if b[2] is not None and a[2] is None:
        return _approx(cb, b[2], ca)
    return False


def _symbolic(v):
    return v[0] != "num" or _const(v[1]) is None


def _matching(xs, ys):
    """Some ordering of ``ys`` equals ``xs`` element by element (brute force: the reference's lists are short)."""
    if len(xs) != len(ys):
        return False
    return any(all(ref_equal(x, y) for x, y in zip(xs, order)) for order in itertools.permutations(ys))


def _distinct(xs):
    out = []
    for x in xs:
        if not any(ref_equal(x, y) for y in out):
            out.append(x)
    return out


def ref_equal(a, b):
    """The documented equality on the reference's values."""
    if a == NEVER or b == NEVER:
        return False
    ka, kb = a[0], b[0]
    if ka == kb == "assign":
        if a[1] != b[1]:
            if any(_symbolic(v[2]) for v in (a, b)):
                raise Unknown("two names and a symbolic value: an equation")
            return False  # x = 3 is not y = 3
        return ref_equal(a[2], b[2])
    if "assign" in (ka, kb):
        named, other = (a, b) if ka == "assign" else (b, a)
        return ref_equal(named[2], other)
    if "base" in (ka, kb):
        n, other = (a, b) if ka == "base" else (b, a)
        if other[0] == "base":
            return n[1] == other[1]
        if other[0] != "num" or _const(other[1]) is None:
            return False
        v = _const(other[1])
        return v == n[1] or (n[2].isdigit() and v == int(n[2]))
    if ka == kb == "num":
        return _nums_equal(a, b)
    if "pct" in (ka, kb):
        if ka == kb:
            if a[2] is not None or b[2] is not None:
                raise Unknown("decimal precision under percent")
            return a[1] == b[1]
        p, other = (a, b) if ka == "pct" else (b, a)
        if other[0] != "num":
            return False
        if p[2] is not None or other[2] is not None:
            raise Unknown("decimal precision under percent")
        return _const(other[1]) in (p[1], p[1] / 100)
    if ka == "choice" or kb == "choice":
        return ka == kb and a[1] == b[1]
    if {ka, kb} <= {"list", "set"}:
        for one, other in ((a[1], b[1]), (b[1], a[1])):
            if len({n[1] for n in one if n[0] == "assign"}) >= 2 and any(n[0] != "assign" for n in other):
                return False  # two names pair the values; a bare list does not say which is which
    if ka == kb == "list":
        return _matching(a[1], b[1])
    if {ka, kb} <= {"list", "set"}:
        return _matching(_distinct(a[1]), _distinct(b[1]))
    if ka == "set" or kb == "set":
        s, other = (a, b) if ka == "set" else (b, a)
        d = _distinct(s[1])
        return len(d) == 1 and other[0] != "list" and ref_equal(d[0], other)
    if ka == kb == "tuple":
        return a[1:3] == b[1:3] and len(a[3]) == len(b[3]) and all(ref_equal(x, y) for x, y in zip(a[3], b[3]))
    return False


# ============================================================================= mutations
def _sub_at(s, m, new):
    return s[: m.start()] + new + s[m.end():]


def _pick(rng, pattern, s):
    ms = list(re.finditer(pattern, s))
    return rng.choice(ms) if ms else None


def m_digit(s, rng):
    m = _pick(rng, r"\d", s)
    return m and _sub_at(s, m, rng.choice([d for d in "0123456789" if d != m.group(0)]))


def m_minus_drop(s, rng):
    m = _pick(rng, r"-", s)
    return m and _sub_at(s, m, "")


def m_minus_insert(s, rng):
    m = _pick(rng, r"(?<![\d.])(?=\d)|(?=\\frac)", s)
    return m and _sub_at(s, m, "-")


def m_frac_swap(s, rng):
    m = _pick(rng, r"\\frac\{([^{}]*)\}\{([^{}]*)\}", s)
    return m and _sub_at(s, m, "\\frac{%s}{%s}" % (m.group(2), m.group(1)))


def m_divide_by_zero(s, rng):
    m = _pick(rng, r"\\frac\{([^{}]*)\}\{([^{}]*)\}", s)
    if m:
        return _sub_at(s, m, "\\frac{%s}{%s}" % (m.group(1), rng.choice(["0", "1-1", "0.0"])))
    return rng.choice(["\\frac{%s}{0}", "%s/0", "\\frac{1}{0}+%s"]) % s


def m_append_symbol(s, rng):
    return s + rng.choice(["i", "e", "x", "\\pi", "\\mathrm{i}", "\\mathrm{e}", "\\mathit{x}", "\\text{ i}",
                           "\\text{ x}", "\\mathrm{e}"])


def m_wrap_text(s, rng):
    return rng.choice(["\\text{%s}", "\\mathrm{%s}", "\\textbf{%s}", "\\mbox{%s}"]) % s


def m_unit_word(s, rng):
    word = rng.choice(sorted(UNIT_WORDS))
    return s + rng.choice(["\\text{ %s}", " %s", "\\,\\text{%s}", "\\mbox{ %s}"]) % word


def m_number_word(s, rng):
    word = rng.choice(sorted(MULTIPLIERS) + sorted(REFUSED_WORDS))
    return s + rng.choice(["\\text{ %s}", " %s", "\\mathrm{ %s}"]) % word


def m_duplicate(s, rng):
    inner = _balanced_inner(s, "\\{", {"\\}"})
    if inner is not None and inner.strip():
        parts = _split_top(inner)
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(parts))
        return "\\{" + ", ".join(parts) + "\\}"
    parts = _split_top(s)
    if len(parts) > 1:
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(parts))
        return ", ".join(parts)
    return None


def m_reorder(s, rng):
    for opener in ("(", "["):
        inner = _balanced_inner(s, opener, {")", "]"})
        if inner is not None and len(_split_top(inner)) > 1:
            parts = _split_top(inner)
            how = rng.randrange(3)
            if how == 0:  # exchange the brackets' kinds
                flip = {"(": "[", "[": "(", ")": "]", "]": ")"}
                left = flip[s[0]] if rng.random() < 0.5 else s[0]
                return left + inner + (flip[s[-1]] if rng.random() < 0.5 else s[-1])
            if how == 1:
                return s[0] + ", ".join(reversed(parts)) + s[-1]
            return ", ".join(parts)  # brackets dropped: a list
    parts = _split_top(s)
    if len(parts) > 1:
        rng.shuffle(parts)
        return ", ".join(parts)
    return None


def m_unicode_minus(s, rng):
    m = _pick(rng, r"-", s)
    return m and _sub_at(s, m, rng.choice(MINUS_LOOKALIKES))


def m_vulgar(s, rng):
    chars = {v: k for k, v in VULGAR.items()}
    m = _pick(rng, r"\\[dt]?frac\{(\d+)\}\{(\d+)\}|\\frac(\d)(\d)", s)
    if m:
        num, den = int(m.group(1) or m.group(3)), int(m.group(2) or m.group(4))
        if den and Fraction(num, den) in chars and num < den:
            return _sub_at(s, m, chars[Fraction(num, den)])
    m = _pick(rng, r"(?<![\d.])0?\.(5|25|75|125)(?![\d])", s)
    if m:
        return _sub_at(s, m, chars[Fraction("0." + m.group(1))])
    m = _pick(rng, r"(?<![\d.])\d+(?![\d.])", s)
    return m and _sub_at(s, m, m.group(0) + rng.choice(list(VULGAR)))


def m_full_stop(s, rng):
    return s + "."


def m_thousands(s, rng):
    m = re.fullmatch(r"(-?)(\d{4,})(\.\d+)?", s)
    if not m:
        return None
    digits = m.group(2).lstrip("0") or "0"
    grouped = f"{int(digits):,}"
    return m.group(1) + grouped + (m.group(3) or "") + rng.choice(["", "."])


def m_whitespace(s, rng):
    m = _pick(rng, r"(?<=[+\-,=}])(?<![eE][+-])|(?=[+\-,=\\])(?<![eE])", s)
    run = " " * rng.choice([1, 3, 40, 10_000])
    if rng.random() < 0.3:
        return s + run + rng.choice(["+1", "-1", "\\cdot 2", "0"])
    return m and _sub_at(s, m, run)


def m_implicit_product(s, rng):
    if re.search(r"[A-Za-z%]|\\[{}]|,", s.replace("\\frac", "")):
        return None
    return rng.choice(["2(%s)", "(%s)(3)", "(2)(%s)", "2\\cdot(%s)"]) % s


def m_product_split(s, rng):
    """An integer n written as the implicit product a(b) of two parts with a + b = n."""
    m = _pick(rng, r"(?<![\d.^{])[2-9]\d?(?![\d.])", s)
    if m is None:
        return None
    n = int(m.group(0))
    a = rng.randint(1, n - 1)
    return _sub_at(s, m, rng.choice(["%d(%d)", "(%d)(%d)"]) % (a, n - a))


def m_add_zero(s, rng):
    return s + rng.choice(["+0", "+0.0", "\\cdot 1", "+\\frac{0}{5}"])


def m_choice(s, rng):
    m = re.search(r"\(([A-E])\)|^([A-E])$", s)
    if m is None:
        return None
    letter = m.group(1) or m.group(2)
    other = rng.choice([c for c in "ABCDE" if c != letter])
    return rng.choice(["(%s)(%s)", "(%s)%s", "(%s)(%s)(C)(D)(E)", "(%s) \\text{ or } (%s)"]) % (letter, other)


def _decimal_digits(q, limit=12):
    """(whole, fixed digits, period) of the positive rational ``q``'s decimal expansion, or None past ``limit``."""
    whole, r = divmod(q.numerator, q.denominator)
    digits, seen = [], {}
    while r and r not in seen and len(digits) < limit:
        seen[r] = len(digits)
        d, r = divmod(r * 10, q.denominator)
        digits.append(str(d))
    if r == 0:
        return str(whole), "".join(digits), ""
    if r not in seen:
        return None
    start = seen[r]
    return str(whole), "".join(digits[:start]), "".join(digits[start:])


def m_repeating(s, rng):
    """A fraction written as its repeating decimal (``\\overline``, ``\\bar``, ``\\dot``), or a number written with
    a period of nines (``0.5`` as ``0.4\\overline{9}``, ``3`` as ``2.\\overline{9}``)."""
    m = _pick(rng, r"\\frac\{(\d+)\}\{(\d+)\}|\\frac(\d)(\d)", s)
    if m and int(m.group(2) or m.group(4)) > 0:
        q = Fraction(int(m.group(1) or m.group(3)), int(m.group(2) or m.group(4)))
        parts = _decimal_digits(q)
        if parts and parts[2]:
            whole, fixed, period = parts
            mark = rng.choice(["\\overline{%s}", "\\bar{%s}"] + (["\\bar%s", "\\dot%s"] if len(period) == 1 else []))
            return _sub_at(s, m, f"{whole}.{fixed}" + mark % period)
    m = _pick(rng, r"(?<![\d.\\])(\d+)(?:\.(\d+))?(?![\d.])", s)
    if m is None or int(m.group(0).replace(".", "")) == 0:
        return None
    q = Fraction(m.group(0))
    unit = Fraction(1, 10 ** len(m.group(2) or ""))
    parts = _decimal_digits(q - unit, 20)
    if parts is None:
        return None  # more digits than the mutation writes (a long decimal seed)
    whole, fixed, _ = parts
    fixed = fixed.ljust(len(m.group(2) or ""), "0")
    return _sub_at(s, m, f"{whole}.{fixed}" + rng.choice(["\\overline{9}", "\\bar9", "\\dot{9}"]))


def m_base(s, rng):
    """A whole-item integer written in another base with its subscript; sometimes under the wrong base."""
    m = _pick(rng, r"(?:(?<=^)|(?<=[,(\[{] )|(?<=[,(\[{]))(\d+)(?=$|[,)\]}])", s)
    if m is None or int(m.group(1)) < 2:
        return None
    n, base = int(m.group(1)), rng.randint(2, 16)
    digits = ""
    while n:
        n, d = divmod(n, base)
        digits = "0123456789ABCDEF"[d] + digits
    label = base
    if rng.random() < 0.3:  # the wrong base: the written digits must still be digits of it
        label = rng.choice([b for b in range(2, 17) if b != base and b > max(int(c, 16) for c in digits)] or [base])
    return _sub_at(s, m, digits + rng.choice(["_%d", "_{%d}"]) % label if label < 10 else digits + "_{%d}" % label)


def m_euler(s, rng):
    """Euler's e inside an expression: ``+2e-2e`` keeps the value, ``+2\\mathrm{e}-2`` changes it (never e-notation)."""
    if re.search(r"[,=%]|\\[{}]|\\text|\\math|[A-Za-z]$", s):
        return None
    return s + rng.choice(["+2e-2e", "+e-e", "+3e-3", "+2\\mathrm{e}-2", "-2e+2e", "+1e-1", "+2e-2"])


def m_digit_space(s, rng):
    """A space between two digits: ``23`` as ``2 3`` (refused), ``10000`` as ``10 000`` (3-digit groups: kept)."""
    m = re.fullmatch(r"(-?)(\d{4,})", s)
    if m and rng.random() < 0.4:
        return m.group(1) + f"{int(m.group(2)):,}".replace(",", " ")
    m = _pick(rng, r"(?<=\d)(?=\d)", s)
    return m and _sub_at(s, m, " ")


def m_names(s, rng):
    """Named answers: two values exchanged between their names, a name changed, or the items reordered."""
    parts = _split_top(s)
    named = [i for i, p in enumerate(parts) if re.fullmatch(r"[a-z](?:_\{?\d\}?)?\s*=\s*[^=]+", p)]
    if not named:
        return None
    how = rng.randrange(3)
    if how == 0 and len(named) >= 2:
        i, j = rng.sample(named, 2)
        (ni, vi), (nj, vj) = (parts[k].split("=", 1) for k in (i, j))
        parts[i], parts[j] = f"{ni.strip()} = {vj.strip()}", f"{nj.strip()} = {vi.strip()}"
    elif how == 1:
        i = rng.choice(named)
        name, value = parts[i].split("=", 1)
        parts[i] = rng.choice([c for c in "abcnpqrtuvwz" if c != name.strip()]) + " = " + value.strip()
    else:
        rng.shuffle(parts)
    return ", ".join(parts)


def m_script_digits(s, rng):
    """A number written with the digits of another script (issue 42): the value is kept."""
    m = _pick(rng, r"\d+", s)
    base = rng.choice(DIGIT_SCRIPTS)
    return m and _sub_at(s, m, "".join(chr(base + int(d)) for d in m.group(0)))


def m_superscript(s, rng):
    """An integer exponent written as unicode superscripts: ``2^{10}`` as ``2¹⁰`` (issue 42)."""
    m = _pick(rng, r"\^(?:\{(\d+)\}|(\d))", s)
    return m and _sub_at(s, m, "".join(SUPERSCRIPT_DIGITS[int(d)] for d in (m.group(1) or m.group(2))))


def m_unit_letter(s, rng):
    """A unit letter appended (issue 42): after a plain number, or in a text wrapper, a unit (kept value); plain after
    anything else, the problem's variable (a changed value)."""
    letter = rng.choice(sorted(UNIT_LETTERS))
    return s + rng.choice([" %s", r"\,\text{%s}", r"\text{ %s}", " %s"]) % letter


MUTATIONS = {
    "digit": m_digit, "minus-drop": m_minus_drop, "minus-insert": m_minus_insert, "frac-swap": m_frac_swap,
    "divide-by-zero": m_divide_by_zero, "append-symbol": m_append_symbol, "wrap-text": m_wrap_text,
    "unit-word": m_unit_word, "number-word": m_number_word, "duplicate": m_duplicate, "reorder": m_reorder,
    "unicode-minus": m_unicode_minus, "vulgar-fraction": m_vulgar, "full-stop": m_full_stop,
    "thousands": m_thousands, "whitespace": m_whitespace, "implicit-product": m_implicit_product,
    "add-zero": m_add_zero, "choice": m_choice, "product-split": m_product_split,
    "repeating": m_repeating, "base": m_base, "euler-e": m_euler, "digit-space": m_digit_space, "names": m_names,
    "script-digits": m_script_digits, "superscript": m_superscript, "unit-letter": m_unit_letter,
}


# ============================================================================= the search
def seeds():
    """(answer, gold) pairs of the table that the reference reads and finds equal, both directions."""
    out = []
    for pred, gold, expected, _ in MATH_TABLE:
        if not expected:
            continue
        for a, g in ((pred, gold), (gold.rsplit("####", 1)[-1].strip(), pred)):
            try:
                if ref_equal(ref_read(a), ref_read(g)):
                    out.append((a, g))
            except Unknown:
                pass
    return sorted(set(out))


def mutants(n, seed=SEED):
    """``n`` distinct (mutation, mutant, gold, reference verdict) the reference can judge, deterministic."""
    rng = random.Random(seed)
    pool = seeds()
    names = sorted(MUTATIONS)
    out, seen, unread, tries = [], set(), Counter(), 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        answer, gold = rng.choice(pool)
        applied = []
        for _ in range(1 if rng.random() < 0.75 else 2):
            name = rng.choice(names)
            new = MUTATIONS[name](answer, rng)
            if new is not None and new != answer:
                answer = new
                applied.append(name)
        if not applied or (answer, gold) in seen:
            continue
        seen.add((answer, gold))
        try:
            verdict = ref_equal(ref_read(answer), ref_read(gold))
        except Unknown:
            unread["+".join(applied)] += 1
            continue
        out.append(("+".join(applied), answer, gold, verdict))
    return out, unread


def _judge(cases):
    """The mutants the reward scores differently from the reference: (mutation, mutant, gold, verdict, reward)."""
    completions = [f"So the answer is $\\boxed{{{m}}}$." for _, m, _, _ in cases]
    rewards = math_reward(completions, [g for _, _, g, _ in cases], math_timeout=3.0)
    return [(op, m if len(m) < 200 else m[:90] + f"…[{len(m)} chars]…" + m[-40:], g, v, r)
            for (op, m, g, v), r in zip(cases, rewards) if r != float(v)]


def _summary(cases, wrong, unread, seconds):
    """Counts per mutation (a mutant of two mutations counts under both)."""
    total, bad_pos, bad_neg = Counter(), Counter(), Counter()
    for op, _, _, _ in cases:
        for name in set(op.split("+")):
            total[name] += 1
    for op, _, _, verdict, _ in wrong:
        for name in set(op.split("+")):
            (bad_neg if verdict else bad_pos)[name] += 1
    false_pos = sum(1 for w in wrong if not w[3])
    lines = [f"red team: {len(cases)} mutants judged ({sum(unread.values())} left unread by the reference), "
             f"{sum(v for *_, v in cases)} value-preserving; {len(wrong)} disagreements: {false_pos} scored 1 for a "
             f"changed value, {len(wrong) - false_pos} scored 0 for a kept value; {seconds:.1f} s",
             f"  {'mutation':18s} {'mutants':>8s} {'scored 1, changed':>18s} {'scored 0, kept':>15s}"]
    lines += [f"  {op:18s} {total[op]:8d} {bad_pos[op]:18d} {bad_neg[op]:15d}" for op in sorted(total)]
    return "\n".join(lines)


def test_reference_reads_the_seeds():
    pool = seeds()
    assert len(pool) >= 120, len(pool)
    # the reference, checked on its own: what the rules say, independently of the reward
    assert ref_equal(ref_read("1,250."), ref_read("1250"))
    assert ref_equal(ref_read("\\{2, 2\\}"), ref_read("2"))
    assert not ref_equal(ref_read("\\frac{1}{0}"), ref_read("\\frac{1}{0}"))
    assert not ref_equal(ref_read("1+2\\mathrm{i}"), ref_read("3"))
    assert ref_equal(ref_read("5\\text{ million}"), ref_read("5000000"))
    assert ref_read("3\\text{ squared}") == NEVER
    assert ref_read("(A)(B)(C)(D)(E)") == NEVER
    assert ref_equal(ref_read("\u22125"), ref_read("-5")) and ref_equal(ref_read("2½"), ref_read("2.5"))
    assert not ref_equal(ref_read("5" + " " * 10_000 + "+1"), ref_read("5"))
    assert ref_equal(ref_read("0.333333"), ref_read("\\frac13"))
    assert not ref_equal(ref_read("0.33"), ref_read("\\frac13"))
    assert not ref_equal(ref_read("2(3)"), ref_read("5"))


def test_red_team_sample():
    """A fixed sample of the full search (CI): the reward agrees with the reference on every mutant."""
    t0 = time.monotonic()
    population, _ = mutants(FULL)
    by_kind = {}
    for case in population:  # stratified: each kind of mutation (as the first one applied) gets its share
        by_kind.setdefault(case[0].split("+")[0], []).append(case)
    rng = random.Random(SEED)
    share = SAMPLE // len(MUTATIONS)
    cases = [c for kind in sorted(by_kind) for c in rng.sample(by_kind[kind], min(share, len(by_kind[kind])))]
    assert len({op.split("+")[0] for op, *_ in cases}) >= len(MUTATIONS) - 1  # every kind of mutation is sampled
    wrong = _judge(cases)
    print(_summary(cases, wrong, Counter(), time.monotonic() - t0))
    assert not wrong, wrong


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_red_team_full():
    t0 = time.monotonic()
    cases, unread = mutants(FULL)
    assert len(cases) == FULL
    wrong = _judge(cases)
    print(_summary(cases, wrong, unread, time.monotonic() - t0))
    for w in wrong[:200]:
        print("  ", w)
    assert not wrong, wrong[:50]
