r"""String side of the math reward: the last ``\boxed{}`` of a completion, the gold answer, and the normalisation
of an answer string (rules in ``docs/rewards.md``).

Standalone (stdlib only, no package imports), like ``_processes.py``: :mod:`dllm_trl.rewards.math` imports it for
extraction in the caller, and the math worker program is this file's source followed by ``_math_worker.py``'s
(``program_source("_math_text.py", "_math_worker.py")``), so that all cleanup of an answer runs in the worker,
under its time bound. Every step here is linear or bounded in the answer's length, and an answer longer than
:data:`MAX_ANSWER_CHARS` once its whitespace is normalised is equal to nothing.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

MAX_ANSWER_CHARS = 10_000  # after whitespace normalisation; a longer answer is equal to nothing


# =============================================================================== extraction
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _match_brace(text: str, start: int) -> int:
    """``text[start] == '{'``; return the index of the matching ``}`` or -1. ``\\{`` / ``\\}``
    (escaped braces, LaTeX set delimiters) do not count."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _box_at(text: str, m: re.Match) -> tuple[str | None, int]:
    """Content and end index of the box whose command matched at ``m``."""
    i = m.end()
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i < n and text[i] == "{":
        j = _match_brace(text, i)
        if j < 0:
            return None, n  # unclosed (e.g. truncated generation)
        return text[i + 1 : j], j + 1
    # brace-less form: \boxed 5  /  \boxed 5$
    j = i
    while j < n and not text[j].isspace() and text[j] != "$":
        j += 1
    if j == i:
        return None, i
    return text[i:j], j


def extract_boxed_answer(text: str | None) -> str | None:
    r"""Content of the LAST ``\boxed{...}`` / ``\fbox{...}`` in ``text`` (brace-matched, nested braces
    allowed, ``\{``/``\}`` are not grouping braces). ``\boxed 5`` (no braces) is accepted.

    "Last" means the last box that is not nested inside another one; if that box's content is
    itself a single box (``\boxed{\boxed{5}}``) it is unwrapped. If the last box is unclosed
    (truncated output) the result is ``None`` — an earlier box is *not* used instead, because it is
    typically an intermediate result. Returns ``None`` when there is no box.
    """
    if not isinstance(text, str) or not text:
        return None
    last: str | None = None
    found_any = False
    end = -1
    for m in _BOX_RE.finditer(text):
        if m.start() < end:
            continue  # nested inside the previous box
        content, end = _box_at(text, m)
        found_any = True
        last = content
    if not found_any or last is None:
        return None
    last = last.strip()
    inner = _BOX_RE.match(last)
    if inner is not None:
        content, e = _box_at(last, inner)
        if content is not None and e == len(last):
            last = content.strip()
    return last


def extract_gold_answer(answer: Any) -> str | None:
    r"""Ground-truth column value → answer string: a ``\boxed{}`` inside it (MATH solutions) wins,
    then the text after the last ``####`` (GSM8K), else the whole string."""
    if answer is None:
        return None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    if not isinstance(answer, str):
        answer = str(answer)
    if _BOX_RE.search(answer):
        boxed = extract_boxed_answer(answer)
        if boxed is not None:
            return boxed
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    return answer.strip()


# =============================================================================== units
_UNIT = (
    "mm|cm|km|m|meters?|metres?|centimeters?|millimeters?|kilometers?|inches|inch|in|feet|foot|ft|yards?|yd|"
    "miles?|mi|mph|kph|units?|square\\s+units|sq\\s*units|cubic\\s+units|dollars?|cents?|euros?|pounds?|lbs?|"
    "kg|g|grams?|kilograms?|mg|l|liters?|litres?|ml|gallons?|quarts?|ounces?|oz|degrees?|radians?|rad|"
    "seconds?|secs?|s|minutes?|mins?|hours?|hrs?|h|days?|weeks?|months?|years?|"
    "people|persons?|students?|apples|marbles|cookies|books|points?|times"
)
_UNIT_POWER = r"(?:\^?\{?[23]\}?)?"
_PLAIN_UNIT_RE = re.compile(
    r"^(?P<num>.*?\d[^A-Za-z]*?)\s+(?:" + _UNIT + ")" + _UNIT_POWER
    + r"(?:\s*/\s*(?:" + _UNIT + ")" + _UNIT_POWER + r")?\s*$",
    re.I,
)
_UNIT_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z\s.]*(?:\^\{?[23]\}?)?(?:\s*/\s*[A-Za-z][A-Za-z\s.]*(?:\^\{?[23]\}?)?)?")
_TEXT_CMDS = r"(?:text|textrm|textnormal|textbf|textit|textsf|texttt|mbox|mathrm|mathbf|mathit|mathsf|operatorname)"
_TEXT_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{")


def _strip_text_units(s: str) -> str:
    r"""``5\text{ cm}`` / ``5\,\mbox{cm}^2`` / ``12\text{ km/h}`` → ``5`` / ``12``: a trailing text
    wrapper holding a unit-like phrase (words, ``/``, a power 2 or 3) after a prefix with a digit."""
    m = re.search(r"\\" + _TEXT_CMDS + r"\s*\{([^{}]*)\}\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*$", s)
    if m is None:
        return s
    prefix = s[: m.start()].strip()
    words = m.group(1).strip()
    if prefix and re.search(r"\d", prefix) and _UNIT_TEXT_RE.fullmatch(words or "-"):
        return prefix
    return s


# =============================================================================== normalisation
# "\d+(?:\.\d*)?" rather than "\d+\.?\d*": the latter backtracks quadratically over a long run of digits
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_E_NOTATION_RE = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,3})(?![\w.])")
_LIST_WORD_RE = re.compile(r"\s+(?:or|and)\s+|\\text\s*\{\s*(?:or|and)\s*\}|,\s*(?:or|and)\s+", re.I)
_LEADING_VAR_RE = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*(?:=|\\in(?![A-Za-z]))\s*(?P<rest>.+)$")
_PERCENT_WORD_RE = re.compile(r"\s*(?:\\text\s*\{\s*percent\s*\}|(?<![A-Za-z])percent)\s*$")


def _unwrap_command(s: str, cmd_re: re.Pattern) -> str:
    """Replace every ``\\cmd{X}`` matched by ``cmd_re`` (which ends at the ``{``) by ``X``."""
    for _ in range(100):
        m = cmd_re.search(s)
        if m is None:
            break
        j = _match_brace(s, m.end() - 1)
        if j < 0:
            s = s[: m.start()] + s[m.end() :]
            continue
        s = s[: m.start()] + s[m.end() : j] + s[j + 1 :]
    return s


def _expand_e_notation(s: str) -> str:
    """``1e3`` → ``1000``, ``2.5e-3`` → ``0.0025`` (exact decimal; exponents up to 3 digits)."""

    def repl(m: re.Match) -> str:
        d = Decimal(m.group(1) + "e" + m.group(2))
        return _canonical_number(format(d, "f"))

    return _E_NOTATION_RE.sub(repl, s)


def _canonical_number(s: str) -> str:
    """A lone decimal number written canonically (``0.50`` → ``0.5``, ``5.0`` → ``5``, ``042`` → ``42``, ``-0`` →
    ``0``). String operations only: linear in the length."""
    if not _NUMBER_RE.fullmatch(s):
        return s
    sign = "-" if s.startswith("-") else ""
    whole, _, frac = s.lstrip("+-").partition(".")
    frac = frac.rstrip("0")
    out = (whole.lstrip("0") or "0") + ("." + frac if frac else "")
    return out if out == "0" else sign + out


def normalize_math_answer(s: Any) -> str:
    r"""String normalisation of a final answer (never raises; rules in ``docs/rewards.md``).

    Reads ``−`` (U+2212) as ``-``; normalises whitespace, then refuses (returns ``""``, equal to nothing) an answer longer than :data:`MAX_ANSWER_CHARS`.
    Removes: surrounding ``$``/``\(``/``\[`` delimiters, ``\left``/``\right``/``\big``, ``\displaystyle``, LaTeX
    spacing (``\!`` ``\,`` ``\;`` ``\:`` ``\ `` ``~`` ``\quad``; a row break ``\\`` is kept), degree marks, ``\$``,
    trailing units (in ``\text{}``-like wrappers after a numeric prefix, or a known unit word, also ``km/h``-style,
    after a number), a leading ``x =`` / ``x \in``, thousands separators (``1{,}000``
    anywhere; ``1,000`` only when the *whole* answer is one number written with 3-digit groups and no spaces, so
    ``(1,2)`` and ``2, 300`` are lists), trailing full stops, all whitespace. Keeps ``\%``
    as ``%`` (the percent rule needs it), writes ``or`` / ``and`` between answers as ``,``, expands e-notation
    (``1e3`` → ``1000``), rewrites ``\dfrac``/``\tfrac``/``\cfrac`` → ``\frac``, ``\frac12`` → ``\frac{1}{2}``,
    ``\sqrt2`` → ``\sqrt{2}``, unwraps ``\text{..}``/``\mathrm{..}`` etc., and writes plain decimal numbers
    canonically (``0.50`` → ``0.5``, ``5.0`` → ``5``, ``.5`` → ``0.5``).
    """
    try:
        return _normalize(s)
    except Exception:  # pragma: no cover - defensive
        return ""


def _normalize(s: Any) -> str:
    if s is None:
        return ""
    s = str(s).replace("\u2212", "-")
    s = " ".join(s.split())  # every whitespace run is one space: the length limit counts what the answer writes
    if len(s) > MAX_ANSWER_CHARS:
        return ""
    s = s.replace("\u00b0", "^\\circ").replace("\u03c0", "\\pi").replace("\u221e", "\\infty")
    if _BOX_RE.search(s):
        inner = extract_boxed_answer(s)
        if inner is not None:
            s = inner
    # math delimiters
    for _ in range(3):
        s = s.strip()
        if s.startswith("$$") and s.endswith("$$") and len(s) >= 4:
            s = s[2:-2]
        elif s.startswith("$") and s.endswith("$") and len(s) >= 2:
            s = s[1:-1]
        elif (s.startswith("\\(") and s.endswith("\\)")) or (s.startswith("\\[") and s.endswith("\\]")):
            s = s[2:-2]
    s = s.replace("\\$", "")  # escaped dollar sign (currency) before removing math-mode $
    s = s.replace("$", "")
    s = re.sub(r"\\(?:displaystyle|textstyle|scriptstyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:left|right)\s*\.", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:[dtc]frac)(?![A-Za-z])", r"\\frac", s)
    # degrees / percent
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}", "", s)
    s = re.sub(r"\^\s*\\circ(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:circ|degree)(?![A-Za-z])", "", s)
    s = s.replace("\\%", "%")
    s = _PERCENT_WORD_RE.sub("%", s)
    # thousands separators in LaTeX form: 1{,}000
    s = re.sub(r"(?<=\d)\{,\}(?=\d{3})", "", s)
    # spacing commands (before unit handling, so "5\,\text{cm}" works); "\\" (a row break) stays
    s = re.sub(r"\\\\|\\[,;:! ]", lambda m: m.group(0) if m.group(0) == "\\\\" else " ", s)
    s = re.sub(r"\\(?:q?quad|enspace|thinspace|medspace|thickspace)(?![A-Za-z])", " ", s)
    s = s.replace("~", " ")
    s = _LIST_WORD_RE.sub(",", s)
    s = _strip_text_units(s.strip())
    s = _unwrap_command(s, _TEXT_RE)
    s = _LIST_WORD_RE.sub(",", s)
    s = s.strip()
    m = _PLAIN_UNIT_RE.match(s)
    if m is not None and not re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", m.group("num"))):
        s = m.group("num").strip()
    # leading "x =" / "x \in"
    m = _LEADING_VAR_RE.match(s)
    if m is not None and "=" not in m.group("rest"):
        s = m.group("rest")
    # "\log_2 8": a one-character subscript stays one once the spaces are gone
    s = re.sub(r"_(\w) (?=\w)", r"_{\1}", s)
    # 1,000,000 -> 1000000 (whole answer only, and only without spaces: "2, 300" is a list)
    if _THOUSANDS_RE.fullmatch(s.strip()):
        s = s.replace(",", "")
    s = s.replace(" ", "")
    s = s.rstrip(".")
    if s.endswith("\\") and not s.endswith("\\\\"):
        s = s[:-1]
    if s.startswith("{") and _match_brace(s, 0) == len(s) - 1:
        s = s[1:-1]  # one pair of grouping braces around the whole answer
    # \frac12 -> \frac{1}{2}, \frac1{2}, \frac{1}2 ; \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\sqrt\{(\d+)\}(?=\d)", r"\\sqrt{\1}", s)
    s = _expand_e_notation(s)
    if s.startswith("+") and len(s) > 1:
        s = s[1:]
    return _canonical_number(s)
