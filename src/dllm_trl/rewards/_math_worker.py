r"""Worker process for the math-equivalence checks: cleanup of both answers, then structure + sympy.

This file is executed as a standalone program: :mod:`dllm_trl.rewards.math` passes ``python -c`` the source of
``_math_text.py`` followed by this file's (so it has no ``from __future__`` import, which must come first in a
program), so it must not import anything from ``dllm_trl`` (that would pull in torch). It can also be imported
(``heavy_equal``) for the in-process fallback, and then imports ``_math_text`` as a sibling module.

Both answers arrive *as written* (the content of a box, the gold answer) and are normalised here, under the
time bound (``_math_text.normalize_math_answer``: no whitespace, ``%`` kept as a marker, list separators written
as ``,``); equal normalised strings are equal unless the answer divides by zero. :func:`parse_answer` reads the answer's
structure itself (lists, sets, tuples / intervals, unions, inequalities, matrices, percentages,
multiple-choice letters, words) and hands only scalar leaves to a LaTeX parser
(``latex2sympy2_extended``; a leaf it cannot read in full is not read at all). Decimal literals are rewritten
as exact fractions before parsing, so no float ever enters a comparison. :func:`answers_equal`
then applies the rules documented in ``docs/rewards.md``:

* numbers are exact: two rational values compare with ``==`` (never by tolerance);
* a lone decimal literal written with at least ``APPROX_MIN_DIGITS`` significant digits also
  matches a value that no finite decimal can write (``1/3``, ``\sqrt2``, ``\pi``) when it is that
  value rounded or truncated to the digits written;
* other exact values are equal when sympy proves ``a - b == 0`` (and different when it proves
  ``a - b != 0``); when it can do neither, when its adaptive evaluation of ``a - b`` to
  ``EVAL_DIGITS`` digits finds no non-zero digit.

Values that are undefined (a division by zero: sympy's ``zoo`` or ``nan``, e.g. ``\frac{1}{0}``, ``\tan\frac{\pi}{2}``)
make the whole answer equal to nothing, itself included.

Protocol (one JSON object per line):
  parent -> worker (stdin):   {"id": int, "pred": str, "gold": str, "timeout": float, "final_form": bool}
  worker -> parent (a private duplicate of the original stdout; fd 1 itself is pointed at stderr so
  that library prints cannot corrupt the stream):
      first line: {"ready": true, "backends": {...}}
      then:       {"id": int, "equal": bool, "stage": str}

Time bounds: inside the worker each comparison runs under ``signal.setitimer`` (we are the main
thread of our own process, so the alarm is usable); that soft bound cannot interrupt long C-level
work (e.g. big-integer powers), so the parent additionally kills the whole worker process group
when no answer arrives in time and starts a fresh worker.
"""

import json
import logging
import os
import re
import signal
import sys
import threading
import warnings

try:  # imported as dllm_trl.rewards._math_worker (in-process fallback)
    from ._math_text import APPROX_MIN_DIGITS, normalize_math_answer, variable_letters
except ImportError:  # run as a program: _math_text.py's source comes first, its names are already defined
    pass

EVAL_DIGITS = 60  # digits asked of sympy's evaluation of a difference it cannot simplify
MAX_ITEMS = 64  # larger lists / sets / matrices are not compared (never equal)
MAX_STRUCTURAL_CHARS = 2000  # longer normalised answers are compared as strings only


class _SoftTimeout(BaseException):
    """Raised by the SIGALRM handler; BaseException so that library ``except Exception`` blocks
    inside sympy / math_verify do not swallow it."""


class _Undefined(BaseException):
    """A leaf of the answer is undefined (division by zero): the answer is equal to nothing. BaseException, so that
    no ``except Exception`` on the way up turns it into an ordinary parse failure."""


# ----------------------------------------------------------------------------- backend discovery
def _discover_backends():
    info = {"sympy_parser": None, "errors": []}
    parser = None
    try:
        from latex2sympy2_extended import latex2sympy

        import sympy

        if latex2sympy(r"\frac{1}{2}", normalization_config=None) == sympy.Rational(1, 2):
            parser = lambda s: latex2sympy(s, normalization_config=None)  # noqa: E731
            info["sympy_parser"] = "latex2sympy2_extended"
    except Exception as exc:  # pragma: no cover
        info["errors"].append(f"latex2sympy2_extended unusable: {type(exc).__name__}: {exc}")
    return parser, info


_BACKENDS = None


def _backends():
    global _BACKENDS
    if _BACKENDS is None:
        logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _BACKENDS = _discover_backends()
    return _BACKENDS


# ----------------------------------------------------------------------------- structure (string level)
_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = set(_OPEN.values())


def _tokens(s):
    r"""(index, token) pairs: ``\{`` ``\}`` ``\\`` and ``\command`` are single tokens."""
    i, n = 0, len(s)
    while i < n:
        if s[i] == "\\" and i + 1 < n:
            if s[i + 1].isalpha():
                j = i + 1
                while j < n and s[j].isalpha():
                    j += 1
                yield i, s[i:j]
                i = j
                continue
            yield i, s[i : i + 2]
            i += 2
            continue
        yield i, s[i]
        i += 1


def _split_top(s, seps):
    """Split ``s`` at the separators in ``seps`` (single characters or commands) that are not inside
    brackets, braces, ``\\{ \\}``, ``\\langle \\rangle`` or ``\\begin ... \\end``."""
    parts, depth, start = [], 0, 0
    for i, tok in _tokens(s):
        if tok in _OPEN or tok in ("\\{", "\\langle", "\\begin"):
            depth += 1
        elif tok in _CLOSE or tok in ("\\}", "\\rangle", "\\end"):
            depth -= 1
        elif depth == 0 and tok in seps:
            parts.append(s[start:i])
            start = i + len(tok)
    parts.append(s[start:])
    return parts


def _wrapped(s, opener, closers):
    """Inner text when ``s`` is ``opener ... closer`` with the opener's match at the very end."""
    if not s.startswith(opener):
        return None
    depth = 0
    for i, tok in _tokens(s):
        if tok in _OPEN or tok in ("\\{", "\\langle", "\\begin"):
            depth += 1
        elif tok in _CLOSE or tok in ("\\}", "\\rangle", "\\end"):
            depth -= 1
            if depth == 0:
                if i + len(tok) == len(s) and tok in closers:
                    return s[len(opener) : i]
                return None
    return None


_REL_TOKENS = {"<", ">", "\\le", "\\ge", "\\leq", "\\geq", "\\lt", "\\gt", "\\ne", "\\neq", "\\leqslant", "\\geqslant"}
_CHOICE_RE = re.compile(r"^\(?([A-E])\)(.*)$|^([A-E])()$|^\(([a-e])\)()$")  # (c) alone is choice C too
_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
# a number (not an exponent's or subscript's digit) or a closing parenthesis directly before a group: a product.
# latex2sympy reads "2(3)", "(2)(3)", "2{3}" as the mixed numbers 2 + 3; "2\frac{1}{2}" stays a mixed number.
_IMPLICIT_PRODUCT_RE = re.compile(r"((?<![_^])\d|\))(?=\(|\[|\\\{|\{)")
_MAY_BE_UNDEFINED_RE = re.compile(
    r"/|\\frac|\\div|\^\{?-|\^\{?0(?![\d.])|\\(?:tan|cot|sec|csc|log|ln|lg|infty)(?![A-Za-z])"
)
# a set in set-builder notation: {x | ...}, {x : ...}, {x \in R | ...}
_SET_BUILDER_RE = re.compile(r"^(?P<var>[A-Za-z])(?:\\in ?(?:\\mathbb\{R\}|\\R))?(?:\\mid ?|\||:)(?P<cond>.+)$")
# a fraction after a number: a mixed number (2\frac{1}{2} = 2.5) only between a plain integer and a fraction of integers
_NUMBER_BEFORE_FRAC_RE = re.compile(r"(?<![\d.])(\d+)(?=\\frac)")
_MIXED_FRAC_RE = re.compile(r"\\frac\{\d+\}\{\d+\}")
# what would multiply a mixed number written before it (2\frac{1}{2}x): a letter, a digit, a group, a command
_FACTOR_AFTER_RE = re.compile(r"[A-Za-z0-9(\[{]|\\(?!cdot|times|div|pm|mp|le|ge|lt|gt|ne)[A-Za-z]")
_WORD_RE = re.compile(r"^[A-Za-z]{2,}$")
_DECIMAL_RE = re.compile(r"(?<![\d.])(\d+\.\d*|\.\d+)(?![\d.])")
_LONE_DECIMAL_RE = re.compile(r"^[-+]?(\d+\.\d*|\.\d+)$")
_MATRIX_RE = re.compile(r"^\\begin\{(pmatrix|bmatrix|Bmatrix|matrix|smallmatrix)\}(.*)\\end\{\1\}$", re.S)
_PM_RE = re.compile(r"\\(?:pm|mp)(?![A-Za-z])")
_VAR_RE = re.compile(r"^(?:[A-Za-z]|[A-Z]{2}|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?(?:\([A-Za-z]\))?$")  # AB: a segment
# a numeral with a base subscript: 1011_2, 1A_{16} (digits 0-9 and upper-case letters, base 2 to 36)
_BASE_RE = re.compile(r"^([0-9][0-9A-Z]*)_(?:\{(\d{1,2})\}|(\d))$")
_SUBSCRIPTED_NUMERAL_RE = re.compile(r"(?<![A-Za-z_^\\])\d+_")  # inside an expression: never read
_DOUBLE_FACTORIAL_RE = re.compile(r"(?<![\w.!}])(\d{1,4})!!(?!!)")
MAX_DOUBLE_FACTORIAL = 1000


class _Scalar:
    """A scalar leaf: its sympy value and, for a lone decimal literal, (significant digits, unit of
    the last written digit)."""

    __slots__ = ("_expr", "approx", "poly", "_value")

    def __init__(self, expr, approx=None, poly=None):
        self._expr = expr
        self.approx = approx
        self.poly = poly  # the canonical form of a polynomial read by _read_polynomial (expr is then built lazily)
        self._value = False  # not computed yet

    @property
    def expr(self):
        if self._expr is None:
            self._expr = _polynomial_expr(self.poly)
        return self._expr

    def value(self):
        """:func:`numeric_value` of the leaf, computed once."""
        if self._value is False:
            self._value = _polynomial_value(self.poly) if self.poly is not None else numeric_value(self.expr)
        return self._value


def _decimal_info(text):
    """(significant digits, unit of the last digit as a Rational) of a decimal literal."""
    import sympy

    body = text.lstrip("+-")
    whole, _, frac = body.partition(".")
    digits = (whole + frac).lstrip("0")
    return len(digits), sympy.Rational(1, 10 ** len(frac))


def _exact_decimals(text):
    """Decimal literals → exact fractions, so that the LaTeX parser never produces a float."""

    def repl(m):
        whole, _, frac = m.group(1).partition(".")
        num = int((whole or "0") + frac) if (whole or frac) else 0
        return r"(\frac{%d}{%d})" % (num, 10 ** len(frac))

    return _DECIMAL_RE.sub(repl, text)


def _double_factorial(m):
    n = int(m.group(1))
    if n > MAX_DOUBLE_FACTORIAL:
        return m.group(0)  # left as "!!": the leaf is not read
    value = 1
    for k in range(n, 1, -2):
        value *= k
    return "(%d)" % value


def _name(lhs):
    """The written name of an assigned variable, subscript braces dropped (``x_{1}`` is ``x_1``)."""
    return re.sub(r"_\{(\w)\}", r"_\1", lhs)


# ----------------------------------------------------------------------------- polynomials without the LaTeX parser
POLY_MIN_CHARS = 80  # a leaf this long that is a polynomial is read by _read_polynomial (the parser: ~2 ms a char)
MAX_POLY_TERMS = 2000  # larger expansions are left to the LaTeX parser
MAX_POLY_POWER = 200
_POLY_TOKEN_RE = re.compile(r"\d+(?:\.\d+)?|[A-Za-z]|\\(?:cdot|times)(?![A-Za-z])|[-+()^{}]|\s+")


def _poly_mul(a, b):
    out = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            exps = dict(ma)
            for v, k in mb:
                exps[v] = exps.get(v, 0) + k
            m = tuple(sorted(exps.items()))
            out[m] = out.get(m, 0) + ca * cb
            if len(out) > MAX_POLY_TERMS:
                raise ValueError("too many terms")
    return {m: c for m, c in out.items() if c}


def _read_polynomial(text):
    r"""A polynomial written with integers, decimals, letters (not ``e`` / ``i``), ``+ - ( )``, implicit products,
    ``\cdot`` / ``\times`` and non-negative integer powers (``^2``, ``^{12}``) → its canonical form, a dict
    {monomial: Fraction} (letters lower-cased, as the LaTeX parser reads them); None for anything else. Linear in the
    text (and bounded by MAX_POLY_TERMS), unlike the LaTeX parser."""
    from fractions import Fraction

    toks = []
    pos = 0
    while pos < len(text):
        m = _POLY_TOKEN_RE.match(text, pos)
        if m is None:
            return None
        if not m.group(0).isspace():
            toks.append(m.group(0))
        pos = m.end()
    k = 0

    def peek():
        return toks[k] if k < len(toks) else None

    def exponent():
        nonlocal k
        t = peek()
        if t == "{":
            k += 1
            t = peek()
            if t is None or not t.isdigit() or (k + 1 < len(toks) and toks[k + 1] != "}") or k + 1 >= len(toks):
                raise ValueError("exponent")
            k += 2
            return int(t)
        if t is not None and t.isdigit() and len(t) == 1:  # x^23 is not read here (the parser reads x**23)
            k += 1
            return int(t)
        raise ValueError("exponent")

    def power(base):
        nonlocal k
        if peek() != "^":
            return base
        k += 1
        n = exponent()
        if n > MAX_POLY_POWER or peek() == "^" or (n == 0 and not base):
            raise ValueError("power")  # (x-x)^0 is 0^0: left to the parser, which refuses it
        if len(base) == 1:  # a monomial: multiply its exponents
            ((m, c),) = base.items()
            return {tuple((v, e * n) for v, e in m) if n else (): c**n}
        out = {(): Fraction(1)}
        for _ in range(n):
            out = _poly_mul(out, base)
        return out

    def factor(number_allowed):
        nonlocal k
        t = peek()
        if t is None:
            raise ValueError("end")
        if t[0].isdigit():
            if not number_allowed:
                raise ValueError("number after a factor")
            k += 1
            whole, _, frac = t.partition(".")
            value = Fraction(int(whole + frac), 10 ** len(frac))
            if peek() == "^":
                k += 1
                n = exponent()
                if n > MAX_POLY_POWER or (n == 0 and not value):
                    raise ValueError("power")
                value = value**n
            return {(): value} if value else {}
        if t.isalpha():
            if t in "eiEI":
                raise ValueError("e or i")
            k += 1
            return power({((t.lower(), 1),): Fraction(1)})
        if t == "(":
            k += 1
            inner = expression()
            if peek() != ")":
                raise ValueError("parenthesis")
            k += 1
            return power(inner)
        raise ValueError("token")

    def term():
        nonlocal k
        out = factor(True)
        while True:
            t = peek()
            if t in ("\\cdot", "\\times"):
                k += 1
                out = _poly_mul(out, factor(True))
            elif t is not None and (t.isalpha() or t == "("):
                out = _poly_mul(out, factor(False))
            else:
                return out

    def expression():
        nonlocal k
        out = {}
        first = True
        while True:
            sign = 1
            t = peek()
            if t in ("+", "-"):
                sign = -1 if t == "-" else 1
                k += 1
            elif not first:
                return out
            for m, c in term().items():
                out[m] = out.get(m, 0) + sign * c
            out = {m: c for m, c in out.items() if c}
            first = False
            if peek() not in ("+", "-"):
                return out

    try:
        poly = expression()
    except (ValueError, RecursionError):
        return None
    return poly if k == len(toks) else None


def _polynomial_value(poly):
    """:func:`numeric_value` of a canonical polynomial, without sympy (exact, then one conversion)."""
    from fractions import Fraction

    points = {}
    total = Fraction(0)
    for m, c in poly.items():
        term = c
        for v, n in m:
            if v not in points:
                p = _generic_point(v)
                points[v] = Fraction(int(p.p), int(p.q))
            term *= points[v] ** n
        total += term
    try:
        return complex(float(total))
    except OverflowError:
        return None


def _polynomial_expr(poly):
    """The sympy expression of a canonical polynomial (symbols as the LaTeX parser makes them)."""
    import sympy

    return sympy.Add(*[
        sympy.Rational(c.numerator, c.denominator) * sympy.Mul(*[sympy.Symbol(v) ** n for v, n in m])
        for m, c in poly.items()
    ])


def _fraction_products(text):
    r"""``X\frac{a}{b}`` is the product ``X \cdot \frac{a}{b}`` unless ``X`` is a plain integer and ``a``, ``b`` are
    integers (a mixed number: ``2\frac{1}{2}`` = 2.5). The LaTeX parser also read ``(2)\frac12``, ``{2}\frac12`` and
    ``\frac{2}{1}\frac12`` as mixed numbers (2.5). A mixed number followed by a factor (``2\frac12 x``: 5x/2 or x?)
    is not read (None)."""
    if "\\frac" not in text:
        return text
    text = re.sub(r"(?<=[)\]}])(?=\\frac)", r"\\cdot ", text)
    out, last = [], 0
    for m in _NUMBER_BEFORE_FRAC_RE.finditer(text):
        before = text[m.start() - 1] if m.start() else ""
        frac = _MIXED_FRAC_RE.match(text, m.end())
        if before and (before.isalpha() or before in "^_!'") or frac is None:
            out.append(text[last : m.end()] + "\\cdot ")  # x2\frac12, 2^2\frac12, 2\frac{x}{3}: products
            last = m.end()
        elif _FACTOR_AFTER_RE.match(text, frac.end()):
            return None
    out.append(text[last:])
    return "".join(out)


def _indeterminate(expr):
    r"""``0^0``, ``\infty^0``, ``1^\infty`` somewhere in the (unevaluated) expression: sympy evaluates the first
    two to 1."""
    import sympy

    for p in expr.atoms(sympy.Pow):
        base, exp = _doit(p.base), _doit(p.exp)
        if exp == 0 and (base == 0 or getattr(base, "is_infinite", False)):
            return True
        if base == 1 and getattr(exp, "is_infinite", False):
            return True
    return False


def _parse_scalar(text):
    import sympy

    parser, _ = _backends()
    if not text or parser is None:
        return None
    if _SUBSCRIPTED_NUMERAL_RE.search(text):
        return None  # 1011_2 + 1: the parser would drop the base
    if "!!" in text:
        text = _DOUBLE_FACTORIAL_RE.sub(_double_factorial, text)
        if "!!" in text:
            return None  # n!! of anything but a literal (the parser reads it as (n!)!)
    long_poly = len(text) >= POLY_MIN_CHARS and not _LONE_DECIMAL_RE.match(text)  # a decimal keeps its precision
    poly = _read_polynomial(text) if long_poly else None
    if poly is not None:
        return _Scalar(None, None, poly)  # no decimal-precision rule for a polynomial of 80+ characters
    else:
        rewritten = _fraction_products(_exact_decimals(_IMPLICIT_PRODUCT_RE.sub(r"\1\\cdot ", text)))
        if rewritten is None:
            return None
        try:
            expr = parser(rewritten)
        except _SoftTimeout:
            raise
        except Exception:
            return None
    if expr is None or not isinstance(expr, sympy.Basic):
        return None
    if _indeterminate(expr):
        raise _Undefined()
    if isinstance(expr, sympy.Set) or getattr(expr, "is_Relational", False):
        return None
    if isinstance(expr, sympy.logic.boolalg.Boolean) and not isinstance(expr, sympy.Symbol):
        return None  # a sympy Symbol is a Boolean too: a lone variable is a value
    if _doit(expr).has(sympy.zoo, sympy.nan):
        raise _Undefined()
    i = sympy.Symbol("i")
    if i in getattr(expr, "free_symbols", ()):
        expr = expr.subs(i, sympy.I)  # "i" is the imaginary unit
    m = _LONE_DECIMAL_RE.match(text)
    return _Scalar(expr, _decimal_info(m.group(0)) if m else None)


def parse_answer(s):
    """Normalised answer string → comparable structure (nested tuples), or ``None``. A top-level
    comma list (or a ``\\pm``) is a ``("list", items)``."""
    eq = _split_top(s, {"="})
    if len(eq) == 2 and "," in eq[1] and _is_name(eq[0]):  # x = 2, 3: every value is assigned to x
        node = parse_answer(eq[1])
        if node is None:
            return None
        values = node[1] if node[0] == "list" else [node]
        named = [("assign", _name(eq[0]), v) for v in values]
        return ("list", named) if len(named) > 1 else named[0]
    items = _parse_items(s)
    if not items:
        return None
    return ("list", items) if len(items) > 1 else items[0]


def _is_name(lhs):
    return bool(_VAR_RE.match(lhs)) or (
        _wrapped(lhs, "(", ")") is not None and all(_VAR_RE.match(v) for v in _split_top(lhs[1:-1], {","}))
    )


def _parse_items(inner):
    parts = _split_top(inner, {","})
    if len(parts) > MAX_ITEMS:
        return None
    out = []
    for p in parts:
        node = _parse_item(p)
        if node is None:
            return None
        out.extend(node[1] if node[0] == "pm" else [node])
    return out


def _parse_item(s):
    import sympy

    if not s:
        return None
    if _PM_RE.search(s):  # a \pm b: the two answers a + b and a - b (every \pm alike)
        plus = _PM_RE.sub(lambda m: "+" if m.group(0) == "\\pm" else "-", s)
        minus = _PM_RE.sub(lambda m: "-" if m.group(0) == "\\pm" else "+", s)
        a, b = _parse_item(plus.replace("(+", "(").lstrip("+")), _parse_item(minus)
        return ("pm", [a, b]) if a is not None and b is not None else None
    eq = _split_top(s, {"="})
    if len(eq) >= 2:
        lhs, rhs = eq[0], eq[-1]
        if _is_name(lhs):
            node = parse_answer(rhs)  # x = 5, (x, y) = (1, 2), x = 2+3 = 5: the name and its (last) value
            if node is None:
                return None
            if node[0] == "list":
                return ("pm", [n if n[0] == "assign" else ("assign", _name(lhs), n) for n in node[1]])
            return ("assign", _name(lhs), node)
        if len(eq) == 2:
            a, b = _parse_scalar(lhs), _parse_scalar(rhs)
            return ("eq", a.expr - b.expr) if a is not None and b is not None else None
        return None
    if s.endswith("%"):
        inner = _parse_scalar(s[:-1])
        return ("pct", inner) if inner is not None else None
    m = _CHOICE_RE.match(s)
    if m is not None:
        rest = m.group(2) or ""
        letter = (m.group(1) or m.group(3) or m.group(5)).upper()
        if re.search(r"[A-E]", _COMMAND_RE.sub("", rest)):
            return None  # one choice only: "(A)(B)", "(A)B" name two
        if rest and _MAY_BE_UNDEFINED_RE.search(rest):
            _parse_scalar(rest)  # the choice's value, when written, must not divide by zero: (C) 12/0 is nothing
        return ("choice", letter)
    inner = _wrapped(s, "\\{", {"\\}"})
    builder = _SET_BUILDER_RE.match(inner) if inner is not None else None
    if builder is not None:
        return _set_builder(builder.group("var"), builder.group("cond"))
    for seps, combine in (({"\\lor", "\\vee"}, sympy.Union), ({"\\land", "\\wedge"}, sympy.Intersection)):
        parts = _split_top(s, seps)  # "or" / "and" between relations: a union / an intersection of solution sets
        if len(parts) > 1:
            sets = [_as_set(_parse_item(p.strip())) for p in parts]
            return ("rset", combine(*sets)) if all(x is not None for x in sets) else None
    cup = _split_top(s, {"\\cup"})
    if len(cup) > 1:
        sets = [_as_set(_parse_item(p)) for p in cup]
        return ("rset", sympy.Union(*sets)) if all(x is not None for x in sets) else None
    if any(tok in _REL_TOKENS for _, tok in _tokens(s)):
        return _parse_relation(s)
    if s in ("\\emptyset", "\\varnothing", "\\{\\}"):
        return ("set", [])
    if s in ("\\mathbb{R}", "\\R"):
        return ("rset", sympy.Reals)
    m = _MATRIX_RE.match(s)
    if m is not None:
        rows = [r for r in _split_top(m.group(2), {"\\\\"}) if r != ""]
        cells = [_split_top(r, {"&"}) for r in rows]
        if not cells or len({len(r) for r in cells}) != 1 or sum(len(r) for r in cells) > MAX_ITEMS:
            return None
        parsed = [[_parse_scalar(c) for c in r] for r in cells]
        if any(c is None for r in parsed for c in r):
            return None
        return ("matrix", parsed)
    inner = _wrapped(s, "\\{", {"\\}"})
    if inner is not None:
        items = _parse_items(inner) if inner else []
        return ("set", items) if items is not None else None
    inner = _wrapped(s, "\\langle", {"\\rangle"})
    if inner is not None:
        items = _parse_items(inner)
        return ("tuple", "(", ")", items) if items is not None else None
    for opener in ("(", "["):
        inner = _wrapped(s, opener, {")", "]"})
        if inner is not None:
            items = _parse_items(inner)
            if items is None:
                return None
            if len(items) == 1 and ((opener == "(" and s.endswith(")")) or items[0][0] == "matrix"):
                return items[0]  # grouping parentheses; a matrix in brackets (an array between \left[ \right])
            return ("tuple", opener, s[-1], items)
    m = _BASE_RE.match(s)
    if m is not None:
        base = int(m.group(2) or m.group(3))
        try:
            value = int(m.group(1), base) if 2 <= base <= 36 else None
        except ValueError:
            value = None  # a digit the base does not have
        return ("base", sympy.Integer(value), m.group(1)) if value is not None else None
    if _WORD_RE.match(s):
        return ("text", s.lower())
    leaf = _parse_scalar(s)
    return ("num", leaf) if leaf is not None else None


def _set_builder(var, cond):
    """``{x | cond}``: the real solution set of ``cond``, relations in ``var`` alone joined by ``,`` (and), ``\\land``,
    ``\\lor``."""
    import sympy

    sets = []
    for part in _split_top(cond, {","}):
        part = part.strip()
        if not part or not set(re.findall(r"[A-Za-z]", _COMMAND_RE.sub("", part))) <= {var}:
            return None
        solved = _as_set(_parse_item(part))
        if solved is None:
            return None
        sets.append(solved)
    return ("rset", sympy.Intersection(*sets))


def _parse_relation(s):
    """An inequality (chain) in one variable → its real solution set."""
    import sympy

    parser, _ = _backends()
    if parser is None:
        return None
    try:
        rel = parser(_exact_decimals(s))
    except _SoftTimeout:
        raise
    except Exception:
        return None
    syms = getattr(rel, "free_symbols", set())
    if len(syms) != 1:
        return None
    (x,) = syms
    try:
        real = sympy.Symbol(x.name, real=True)
        solved = rel.subs(x, real).as_set()
    except _SoftTimeout:
        raise
    except Exception:
        return None
    return ("rset", solved)


def _as_set(node):
    """A node that denotes a set of reals (interval, union, finite set, solution set) → sympy Set."""
    import sympy

    if node is None:
        return None
    kind = node[0]
    if kind == "rset":
        return node[1]
    if kind == "tuple" and len(node[3]) == 2 and all(n[0] == "num" for n in node[3]):
        lo, hi = node[3][0][1].expr, node[3][1][1].expr
        try:
            if not (lo.is_extended_real and hi.is_extended_real) or not bool(lo < hi):
                return None
            return sympy.Interval(lo, hi, left_open=node[1] == "(", right_open=node[2] == ")")
        except (TypeError, ValueError):
            return None
    if kind in ("set", "list") and all(n[0] == "num" for n in node[1]):
        return sympy.FiniteSet(*[n[1].expr for n in node[1]])
    if kind == "list":
        parts = [_as_set(n) for n in node[1]]
        return sympy.Union(*parts) if all(p is not None for p in parts) else None
    if kind == "num":
        return sympy.FiniteSet(node[1].expr)
    return None


# ----------------------------------------------------------------------------- comparison
def _is_rational_number(e):
    return getattr(e, "is_Rational", False) is True


def _terminating(r):
    """A rational whose decimal expansion is finite (denominator 2^a 5^b)."""
    q = int(r.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def _approx_match(decimal, approx, value):
    """``decimal`` (exact Rational of a decimal literal with (digits, unit) = ``approx``) stands for
    ``value``: ``value`` cannot be written as a finite decimal, the literal has enough significant
    digits, and it is ``value`` rounded or truncated to the written digits."""
    import sympy

    digits, unit = approx
    if digits < APPROX_MIN_DIGITS:
        return False
    if _is_rational_number(value) and _terminating(value):
        return False
    v = sympy.N(value, digits + 30)
    if not v.is_real:
        return False
    d = sympy.N(decimal, digits + 30)
    if d == 0 or (v > 0) != (d > 0):
        return False
    dv, dd = abs(v), abs(d)
    return bool(dd - sympy.N(unit, 30) / 2 <= dv) and bool(dv < dd + sympy.N(unit, 30))


def _doit(e):
    try:
        return e.doit()
    except _SoftTimeout:
        raise
    except Exception:
        return e


# ----------------------------------------------------------------------------- numeric keys (a cheap filter)
SURELY_DIFFERENT_REL = 1e-4  # values further apart than this (relative) are never equal under any rule here
TINY = 1e-12  # below this a numeric value may be an undecided zero: never "surely different"


def _generic_point(name):
    """The value a free symbol takes in a numeric key: fixed per name, so that both answers use the same point."""
    import sympy

    code = sum((k + 1) * ord(c) for k, c in enumerate(name))
    return sympy.Rational(1000 + code % 997, 1009) + sympy.Rational(code % 13, 17)


def numeric_value(expr):
    """``expr``'s value as a Python complex, its free symbols at a generic point (None when it does not evaluate to
    a finite number). Equal values (``a - b`` proved 0, or a decimal within its written precision) have values
    within SURELY_DIFFERENT_REL of each other; the converse is not assumed."""
    import math

    import sympy

    try:
        e = _doit(expr)
        if not isinstance(e, sympy.Expr):
            return None
        if e.free_symbols:
            e = e.xreplace({v: _generic_point(v.name) for v in e.free_symbols})
        v = complex(sympy.N(e, 20))
    except _SoftTimeout:
        raise
    except Exception:
        return None
    return v if math.isfinite(v.real) and math.isfinite(v.imag) else None


def surely_different(u, v):
    """Two numeric values (from :func:`numeric_value`) that no rule of the comparison can make equal."""
    if u is None or v is None:
        return False
    scale = max(abs(u), abs(v))
    return scale > TINY and abs(u - v) > SURELY_DIFFERENT_REL * scale


def _real_reading(e):
    """``e`` with every odd root of a negative number read as the real root (``(-8)^{1/3}`` = -2; sympy's principal
    root is ``1 + \\sqrt{3} i``)."""
    import sympy

    def odd_root(p):
        return (isinstance(p, sympy.Pow) and p.exp.is_Rational and not p.exp.is_Integer and p.exp.q % 2 == 1
                and p.base.is_number and p.base.is_extended_negative is True)

    try:
        return e.replace(odd_root, lambda p: (-1) ** p.exp.p * (-p.base) ** p.exp)
    except _SoftTimeout:
        raise
    except Exception:
        return e


def scalars_equal(a, b):
    """Exact equality of two scalar leaves (see the module docstring for the decimal rule). An odd root of a negative
    number is read both ways: sympy's principal (complex) root, and the real root where both values are then real."""
    import sympy

    if _scalars_equal(a, b):
        return True
    if a.poly is not None and b.poly is not None:
        return a.poly == b.poly  # canonical forms of polynomials: equal exactly when the dicts are
    x, y = _doit(a.expr), _doit(b.expr)
    if not isinstance(x, sympy.Expr) or not isinstance(y, sympy.Expr):
        return False
    rx, ry = _real_reading(x), _real_reading(y)
    if (rx, ry) == (x, y) or rx.is_real is not True or ry.is_real is not True:
        return False
    return _scalars_equal(_Scalar(rx, a.approx), _Scalar(ry, b.approx))


def _no_nonzero_digit(v):
    """sympy's evaluation ``v`` of a difference found no non-zero digit: each of its real and imaginary parts is 0,
    or a bound below 10^-EVAL_DIGITS without a single correct bit (sympy writes such a part ``0.e-190``)."""
    import sympy

    for part in v.as_real_imag():
        if part == 0:
            continue
        if not (isinstance(part, sympy.Float) and part._prec <= 1 and abs(part) < sympy.Float(10) ** -EVAL_DIGITS):
            return False
    return True


def _scalars_equal(a, b):
    import sympy

    if a.poly is not None and b.poly is not None:
        return a.poly == b.poly  # canonical forms of polynomials: equal exactly when the dicts are
    x, y = _doit(a.expr), _doit(b.expr)
    try:
        if x == y:
            return True
    except Exception:
        pass
    if not isinstance(x, sympy.Expr) or not isinstance(y, sympy.Expr):
        return False
    if surely_different(a.value(), b.value()):
        return False  # apart at a generic point (or as numbers): no sympy simplification needed
    if x.free_symbols or y.free_symbols:
        try:
            return sympy.simplify(x - y) == 0
        except _SoftTimeout:
            raise
        except Exception:
            return False
    if _is_rational_number(x) and _is_rational_number(y):
        if a.approx is not None and b.approx is None and _approx_match(x, a.approx, y):
            return True
        if b.approx is not None and a.approx is None and _approx_match(y, b.approx, x):
            return True
        return False  # two rational numbers: exact, never by tolerance
    if a.approx is not None and b.approx is None:
        return _approx_match(x, a.approx, y)
    if b.approx is not None and a.approx is None:
        return _approx_match(y, b.approx, x)
    try:
        if x.is_infinite or y.is_infinite or x.has(sympy.zoo, sympy.nan) or y.has(sympy.zoo, sympy.nan):
            return False
        diff = sympy.simplify(x - y)
        if diff.is_zero is not None:
            return bool(diff.is_zero)
        # sympy can neither simplify the difference to 0 nor prove it non-zero (nested radicals):
        # its adaptive evaluation, asked for EVAL_DIGITS correct digits, finds none that is non-zero
        return _no_nonzero_digit(sympy.N(x - y, EVAL_DIGITS))
    except _SoftTimeout:
        raise
    except Exception:
        return False


def _node_key(node):
    """A cheap key of an item: the numeric value of a scalar, the tuple of its items' keys for a tuple; None
    otherwise. Items whose keys are :func:`surely_different` are never equal, so a list is matched with one numeric
    evaluation per item and exact (sympy) comparisons only between items whose keys agree."""
    if node[0] == "num":
        return node[1].value()
    if node[0] == "tuple":
        return (node[1], node[2], tuple(_node_key(n) for n in node[3]))
    return None


def _keys_apart(u, v):
    if isinstance(u, tuple) and isinstance(v, tuple):
        return u[:2] != v[:2] or len(u[2]) != len(v[2]) or any(_keys_apart(p, q) for p, q in zip(u[2], v[2]))
    if isinstance(u, complex) and isinstance(v, complex):
        return surely_different(u, v)
    return False


def _match_all(xs, ys):
    """Perfect matching between two lists under ``answers_equal`` (order-free, multiplicity kept). Pairs whose keys
    are apart are never compared; the others are compared when the matching asks for them (at most once)."""
    if len(xs) != len(ys):
        return False
    kx, ky = [_node_key(x) for x in xs], [_node_key(y) for y in ys]
    memo = {}

    def eq(i, j):
        if (i, j) not in memo:
            memo[i, j] = not _keys_apart(kx[i], ky[j]) and answers_equal(xs[i], ys[j], top=False)
        return memo[i, j]

    owner = [-1] * len(ys)

    def augment(i, seen):
        for j in range(len(ys)):
            if not seen[j] and eq(i, j):
                seen[j] = True
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(augment(i, [False] * len(ys)) for i in range(len(xs)))


def _dedupe(xs):
    out, keys = [], []
    for x in xs:
        kx = _node_key(x)
        if not any(not _keys_apart(kx, ky) and answers_equal(x, y, top=False) for y, ky in zip(out, keys)):
            out.append(x)
            keys.append(kx)
    return out


def _scaled(leaf, factor):
    import sympy

    approx = None if leaf.approx is None else (leaf.approx[0], leaf.approx[1] * factor)
    return _Scalar(sympy.Mul(leaf.expr, factor), approx)


def _sets_equal(a, b):
    import sympy

    if a is None or b is None:
        return False
    try:
        if a == b:
            return True
        diff = a.symmetric_difference(b)
        return diff.is_empty is True or diff == sympy.EmptySet
    except _SoftTimeout:
        raise
    except Exception:
        return False


def _equations_equal(da, db):
    """Two equations ``da = 0`` and ``db = 0`` (side differences) are one when ``da / db`` is a non-zero constant."""
    import sympy

    try:
        ratio = sympy.simplify(da / db)
        return bool(ratio.is_number and ratio != 0 and ratio.is_finite is True)
    except _SoftTimeout:
        raise
    except Exception:
        return False


def _as_equation(node):
    """``("assign", name, ("num", v))`` → the side difference ``name - v`` (None when the name is not readable)."""
    if node[2][0] != "num":
        return None
    name = _parse_scalar(node[1])
    return None if name is None else name.expr - node[2][1].expr


def _assignment_equal(a, b, top=True):
    """Same name: the values compare. Different names: equal only as the same equation (``y = 2x+3`` and
    ``x = \\frac{y-3}{2}``; ``x = 3`` and ``y = 3`` are not). Against an unnamed answer: its value compares."""
    if a[0] == b[0] == "assign":
        if a[1] == b[1]:
            return answers_equal(a[2], b[2], top)
        ea, eb = _as_equation(a), _as_equation(b)
        return ea is not None and eb is not None and _equations_equal(ea, eb)
    named, other = (a, b) if a[0] == "assign" else (b, a)
    if other[0] == "eq":
        e = _as_equation(named)
        return e is not None and _equations_equal(e, other[1])
    return answers_equal(named[2], other, top)


def _unpaired(xs, ys):
    """One side names two or more variables (``x = 3, y = 2``) and the other has an unnamed item (``2, 3``): the
    names say which value is which, the bare list does not, so the two are not equal."""
    for one, other in ((xs, ys), (ys, xs)):
        if len({n[1] for n in one if n[0] == "assign"}) >= 2 and any(n[0] != "assign" for n in other):
            return True
    return False


def _numeral_equal(a, b):
    """A base numeral (``1011_2``) is its value (11); against a plain integer it also matches the integer written
    with the same digits (``1011``), the answer without its subscript."""
    if a[0] == b[0] == "base":
        return a[1] == b[1]
    numeral, other = (a, b) if a[0] == "base" else (b, a)
    if other[0] != "num" or other[1].approx is not None:
        return False
    value = _doit(other[1].expr)
    if not _is_rational_number(value) or value.q != 1:
        return False
    return value == numeral[1] or (numeral[2].isdigit() and value == int(numeral[2]))


def answers_equal(a, b, top=True):
    """Equality of two parsed answers under the documented rules (symmetric). ``top``: ``a`` and ``b`` are whole
    answers (or assigned values), not items of a list, set or tuple: only there is a one-element set its element."""
    import sympy

    ka, kb = a[0], b[0]
    if ka == "num" and kb == "num":
        return scalars_equal(a[1], b[1])
    if ka == "assign" or kb == "assign":
        return _assignment_equal(a, b, top)
    if ka == "base" or kb == "base":
        return _numeral_equal(a, b)
    if ka == "pct" or kb == "pct":
        if ka == "pct" and kb == "pct":
            return scalars_equal(a[1], b[1])
        p, other = (a, b) if ka == "pct" else (b, a)
        if other[0] != "num":
            return False
        return scalars_equal(p[1], other[1]) or scalars_equal(_scaled(p[1], sympy.Rational(1, 100)), other[1])
    if ka == "choice" or kb == "choice":
        return ka == kb and a[1] == b[1]
    if ka == "text" or kb == "text":
        if ka == kb == "text" and a[1] == b[1]:
            return True
        return False
    if {ka, kb} <= {"list", "set"} and _unpaired(a[1], b[1]):
        return False
    if ka == "list" and kb == "list":
        return _match_all(a[1], b[1])
    if {ka, kb} <= {"list", "set"}:
        return _match_all(_dedupe(a[1]), _dedupe(b[1]))
    if (ka == "set" or kb == "set") and "rset" not in (ka, kb):  # duplicates collapse: {2, 2} = {2} = 2
        s, other = (a, b) if ka == "set" else (b, a)
        distinct = _dedupe(s[1])  # {{1}, {2}} is no {1, 2}, nor {{1, 2}} its element {1, 2}
        return (top and len(distinct) == 1 and distinct[0][0] not in ("set", "list")
                and answers_equal(distinct[0], other, top=False))
    if ka == "tuple" and kb == "tuple":
        return a[1] == b[1] and a[2] == b[2] and len(a[3]) == len(b[3]) and all(
            answers_equal(x, y, top=False) for x, y in zip(a[3], b[3])
        )
    if ka == "matrix" and kb == "matrix":
        return len(a[1]) == len(b[1]) and len(a[1][0]) == len(b[1][0]) and all(
            scalars_equal(x, y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb)
        )
    if {ka, kb} == {"matrix", "tuple"}:
        m, t = (a, b) if ka == "matrix" else (b, a)
        flat = [c for r in m[1] for c in r]
        vector = len(m[1]) == 1 or len(m[1][0]) == 1
        return vector and len(flat) == len(t[3]) and all(
            n[0] == "num" and scalars_equal(c, n[1]) for c, n in zip(flat, t[3])
        )
    if ka == "eq" and kb == "eq":
        return _equations_equal(a[1], b[1])
    if "rset" in (ka, kb):
        return _sets_equal(_as_set(a), _as_set(b))
    return False


def _undefined(answer):
    """The (normalised) answer divides by zero somewhere."""
    if not _MAY_BE_UNDEFINED_RE.search(answer):
        return False
    try:
        parse_answer(answer)
    except _Undefined:
        return True
    return False


# operations that ask for a computation: in final-form mode a prediction may use one only where the gold does
_UNEVALUATED_RE = re.compile(
    r"\\(?:i{0,3}int|oint|sum|prod|lim|limsup|liminf|binom|dbinom|tbinom|choose|bmod|pmod|mod|partial|nabla|det"
    r"|gcd|lcm|max|min)(?![A-Za-z])"
    r"|(?<![A-Za-z\\])(?:mod|gcd|lcm|max|min|det)(?![A-Za-z])"  # \operatorname{lcm}, \text{mod} once unwrapped
    r"|(?<![<>=\\])!+(?!=)"  # a factorial
    r"|\\frac\{d[^{}]*\}\{d[A-Za-z]"  # a derivative d/dx
)


def unevaluated_operations(answer):
    """The computations a normalised answer asks for (``\\int``, ``\\binom``, ``!``, ``\\bmod``, ``d/dx``...)."""
    return {m.group(0).lstrip("\\").rstrip("!") or "!" for m in _UNEVALUATED_RE.finditer(answer)}


def compare_normalised(p, g, final_form=False):
    """(equal, stage) of two normalised answers: the string stage, then structure + sympy. With ``final_form`` the
    prediction ``p`` may ask for no computation (integral, sum, binomial, factorial, mod, ...) that ``g`` does not."""
    if not p or not g:
        return False, "empty"
    if final_form and not unevaluated_operations(p) <= unevaluated_operations(g):
        return False, "not-final"
    if p == g:
        if _undefined(p):
            return False, "undefined"
        return True, "string"
    if len(p) > MAX_STRUCTURAL_CHARS or len(g) > MAX_STRUCTURAL_CHARS:
        return False, "too-long"
    parser, _ = _backends()
    if parser is None:
        return False, "no-parser"
    try:
        a, b = parse_answer(p), parse_answer(g)
    except _Undefined:
        return False, "undefined"
    if a is None or b is None:
        return False, "unparsed"
    return bool(answers_equal(a, b)), "sympy"


def normalise_pair(pred, gold):
    """Both answers normalised; a unit letter (``m g s h l L``) that one answer uses as a variable is a variable in
    the other too (``4 s`` against ``4s``: the letter is the problem's variable, not seconds)."""
    p, g = normalize_math_answer(pred), normalize_math_answer(gold)
    if p != g:
        in_gold, in_pred = variable_letters(g), variable_letters(p)
        if in_gold:
            p = normalize_math_answer(pred, in_gold)
        if in_pred:
            g = normalize_math_answer(gold, in_pred)
    return p, g


def heavy_equal(pred: str, gold: str, timeout: float = 5.0, final_form: bool = False) -> tuple[bool, str]:
    """Comparison of two answers as written (or already normalised; normalisation is idempotent): cleanup, string
    stage, structure + sympy, all under the time bound. Returns (equal, stage). Never raises (a soft timeout gives
    ``(False, "timeout")``). Uses SIGALRM only when called from the main thread; from another thread (the
    in-process fallback) only the normalised strings are compared."""
    if threading.current_thread() is not threading.main_thread():
        p, g = normalise_pair(pred, gold)
        if final_form and not unevaluated_operations(p) <= unevaluated_operations(g):
            return False, "not-final"
        return bool(p) and p == g, "string-only"
    use_alarm = bool(timeout and timeout > 0)

    def _handler(signum, frame):
        raise _SoftTimeout()

    old = None
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _handler)
        signal.setitimer(signal.ITIMER_REAL, float(timeout))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return compare_normalised(*normalise_pair(pred, gold), final_form)
    except _SoftTimeout:
        return False, "timeout"
    except BaseException:  # RecursionError, MemoryError, ...
        return False, "error"
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- worker main loop
def _main():
    try:
        import resource

        cap = int(os.environ.get("DLLM_TRL_MATH_WORKER_MEM_BYTES", str(4 << 30)))
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except Exception:
        pass
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, never into the protocol stream
    sys.stdout = sys.stderr
    _, info = _backends()
    out.write(json.dumps({"ready": True, "backends": info}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            equal, stage = heavy_equal(str(req["pred"]), str(req["gold"]), float(req.get("timeout", 5.0)),
                                       bool(req.get("final_form", False)))
            resp = {"id": req.get("id"), "equal": bool(equal), "stage": stage}
        except Exception as exc:
            resp = {"id": None, "equal": False, "stage": f"error: {type(exc).__name__}"}
        out.write(json.dumps(resp) + "\n")
        out.flush()


if __name__ == "__main__":
    _main()
