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
import unicodedata
from decimal import Decimal
from typing import Any

MAX_ANSWER_CHARS = 10_000  # after whitespace normalisation; a longer answer is equal to nothing
APPROX_MIN_DIGITS = 6  # a decimal with this many significant digits keeps its trailing zeros (written precision)


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
    typically an intermediate result. Boxes before the last one that only separators divide from it (commas,
    ``and`` / ``or``, spacing, math delimiters: ``\boxed{1} and \boxed{-2}``) are part of the answer, which is
    then the list of their contents (``1, -2``); a word between two boxes (``\boxed{1}, then \boxed{2}``) ends it.
    Returns ``None`` when there is no box.
    """
    if not isinstance(text, str) or not text:
        return None
    boxes = _top_level_boxes(text)
    if not boxes or boxes[-1][2] is None:
        return None
    first = len(boxes) - 1
    while first > 0 and boxes[first - 1][2] is not None and _BOX_SEPARATOR_RE.fullmatch(
        text[boxes[first - 1][1] : boxes[first][0]]
    ):
        first -= 1
    return ", ".join(_unwrap_single_box(content.strip()) for _, _, content in boxes[first:])  # type: ignore[union-attr]


def _unwrap_single_box(content: str) -> str:
    inner = _BOX_RE.match(content)
    if inner is not None:
        unwrapped, e = _box_at(content, inner)
        if unwrapped is not None and e == len(content):
            return unwrapped.strip()
    return content


# what may stand between two boxes of one final answer: commas, "and" / "or", spacing, math delimiters
_BOX_SEPARATOR_RE = re.compile(
    r"(?:\s|[,;$]|\\[()\[\]]|\\(?:q?quad|[,;:! ])|~|\\text\s*\{\s*,?\s*(?:and|or)?\s*\}"
    r"|(?<![A-Za-z])(?:and|or)(?![A-Za-z]))*"
)


def _top_level_boxes(text: str) -> list[tuple[int, int, str | None]]:
    """(start, end, content) of the boxes of ``text`` that are not nested in another box (content ``None`` for an
    unclosed one)."""
    out: list[tuple[int, int, str | None]] = []
    end = -1
    for m in _BOX_RE.finditer(text):
        if m.start() < end:
            continue
        content, end = _box_at(text, m)
        out.append((m.start(), end, content))
    return out


def extract_gold_answer(answer: Any) -> str | None:
    r"""Ground-truth column value → answer string: a ``\boxed{}`` inside it (MATH solutions) wins, then the text
    after the last ``####`` (GSM8K), else the whole string. A gold with several boxes (``\boxed{1}`` and
    ``\boxed{-2}``) is the list of all of them (``1, -2``): its answer is all the boxes, never the last one alone."""
    if answer is None:
        return None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    if not isinstance(answer, str):
        answer = str(answer)
    if _BOX_RE.search(answer):
        boxes = [content for _, _, content in _top_level_boxes(answer)]
        if len(boxes) > 1 and all(b is not None and b.strip() for b in boxes):
            return ", ".join(b.strip() for b in boxes)  # type: ignore[union-attr]
        boxed = extract_boxed_answer(answer)
        if boxed is not None:
            return boxed
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    return answer.strip()


# =============================================================================== trailing words: units and number words
# Unit words (case-insensitive; plurals and a trailing "." too) that a trailing phrase may be made of. A single letter
# is a unit only if it is listed here (the SI symbols m, g, s, h, l / L); any other letter is a symbol (i, e, x, ...).
_UNIT_WORDS = frozenset(
    """
    mm cm dm m km meter meters metre metres millimeter millimeters centimeter centimeters kilometer kilometers
    in inch inches ft foot feet yd yard yards mi mile miles mph kph kmh
    mg g gram grams kg kilogram kilograms lb lbs pound pounds oz ounce ounces ton tons tonne tonnes
    ml l liter liters litre litres gallon gallons quart quarts pint pints cup cups
    s sec secs second seconds min mins minute minutes h hr hrs hour hours day days week weeks month months
    year years yr yrs decade decades century centuries
    dollar dollars cent cents euro euros penny pennies usd
    degree degrees deg rad radian radians
    unit units times people person persons
    """.split()
)
_UNIT_MODIFIERS = frozenset({"square", "sq", "cubic", "cu"})
_UNIT_CONNECTIVES = frozenset({"per"})
# number words: a multiplier multiplies a plain number in front of it (5 million = 5000000, 3 crore = 30000000,
# 5 hundred thousand = 500000: a run of multipliers, each larger than the one before, multiplies by their product);
# any other number word makes the answer equal to nothing (3 squared, 2 halves, 5 thousands are refused, never read
# as 3, 2 or 5). The table holds the multipliers of the languages the answers use (English, Indian English, Spanish,
# French), each with the number it means; a plural multiplies only where the language counts with it (3 crores,
# 2 lakhs, 3 millones, 2 milliards); elsewhere (thousands, millions, myriads) it is a number word and refuses
_MULTIPLIERS = {
    "hundred": 100, "thousand": 1000, "myriad": 10**4, "lakh": 10**5, "lac": 10**5, "million": 10**6,
    "crore": 10**7, "milliard": 10**9, "billion": 10**9, "trillion": 10**12, "quadrillion": 10**15, "dozen": 12,
    "mille": 1000,
}
_PLURAL_MULTIPLIERS = {"lakhs": 10**5, "lacs": 10**5, "crores": 10**7, "millones": 10**6, "milliards": 10**9}
_CARDINALS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety score gross"
).split() + list(_MULTIPLIERS)
_NUMBER_WORDS = frozenset(
    _CARDINALS
    + [w + "s" for w in _CARDINALS if not w.endswith("x") and not w.endswith("y")] + ["sixes", "twenties", "thirties",
       "forties", "fifties", "sixties", "seventies", "eighties", "nineties"]
    + """
    half halves third thirds quarter quarters fourth fourths fifth fifths sixth sixths seventh sevenths eighth eighths
    ninth ninths tenth tenths hundredth hundredths thousandth thousandths millionth millionths
    squared cubed square cube percent percents pct factorial double triple twice thrice
    """.split()
    + list(_PLURAL_MULTIPLIERS)
)
_PHRASE_WORD_RE = re.compile(r"[A-Za-z]+\.?")
# stems of the cardinals and ordinals: a word made of one (plus "th", "ths", "s", "ieth", "ieths") is a number word
# ("twelfths", "sixteenths", "twentieths", "elevens"), whether or not it is listed above
_NUMBER_STEMS = frozenset(_CARDINALS + "first second fif eigh nin twelf".split())
_NUMBER_SUFFIX_RE = re.compile(r"(?:ieths?|ths?|s|es)$")


def _is_number_word(lw: str) -> bool:
    """``lw`` (lowercase) names a number, a fraction or an ordinal: listed, or a number stem with a number suffix."""
    if lw in _NUMBER_WORDS:
        return True
    for m in _NUMBER_SUFFIX_RE.finditer(lw):
        stem = lw[: m.start()]
        if stem in _NUMBER_STEMS or (m.group(0).startswith("ieth") and stem + "y" in _NUMBER_STEMS):
            return True
    return False


# the power a unit may carry: ^2, ^3, ^{2}, ^{-1}, ^{-2}, ^{-3} (s^{-1}, m^{-3})
_UNIT_POWER = r"\^\s*(?:[23]|\{\s*-?[1-3]\s*\})"
_PHRASE_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z\s./]{0,60}(?:" + _UNIT_POWER + ")?")


def _is_unit(word: str) -> bool:
    w = word.rstrip(".")
    if len(w) == 1:
        return w in ("m", "g", "s", "h", "l", "L")
    lw = w.lower()
    if lw in _UNIT_WORDS:
        return True  # listed units first: "seconds" is a unit
    if _is_number_word(lw):
        return False
    # a plural count noun (apples, eggs, clips): 4+ lowercase letters ending in "s", not "ss" / "us" / "is"
    return bool(re.fullmatch(r"[a-z]{3,}s", w)) and not re.search(r"(?:ss|us|is)$", w)


def _classify_phrase(phrase: str) -> tuple[str, int]:
    """``("unit", 0)`` for a unit phrase (``cm``, ``km/h``, ``square units``, ``miles per hour``, ``m/s^2``),
    ``("multiplier", k)`` for a multiplier optionally followed by units (``million``, ``million dollars``),
    ``("number", 0)`` for a phrase with another number word, ``("other", 0)`` for anything else (kept as written)."""
    body = re.sub(_UNIT_POWER, " ", phrase)
    words = [w for w in re.split(r"[\s/]+", body) if w]
    if not words or not all(_PHRASE_WORD_RE.fullmatch(w) for w in words):
        return "other", 0
    lowered = [w.rstrip(".").lower() for w in words]
    multiplier, k = 1, 0
    while k < len(words) and words[k].islower():
        value = _MULTIPLIERS.get(lowered[k]) or _PLURAL_MULTIPLIERS.get(lowered[k])
        if value is None:
            break
        if k and value <= last:
            return "number", 0  # "thousand hundred": not a run of growing multipliers, refused
        multiplier, last, k = multiplier * value, value, k + 1
    rest, rest_lower = words[k:], lowered[k:]
    units = [w for w, lw in zip(rest, rest_lower) if lw not in _UNIT_MODIFIERS and lw not in _UNIT_CONNECTIVES]
    if all(_is_unit(w) for w in units) and (units or k):
        if k:
            return "multiplier", multiplier
        return "unit", 0
    if any(_is_number_word(lw) for lw in lowered):
        return "number", 0
    return "other", 0


_TEXT_CMDS = r"(?:text|textrm|textnormal|textbf|textit|textsf|texttt|mbox|mathrm|mathbf|mathit|mathsf|operatorname)"
_TEXT_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{")
_TEXT_TAIL_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{([^{}]{0,80})\}\s*(" + _UNIT_POWER + r")?\s*$")
_PLAIN_TAIL_RE = re.compile(r"(?<=[\d}).%])\s+([A-Za-z][A-Za-z\s./]{0,60}?(?:" + _UNIT_POWER + r")?)\s*$")
# letters only (single letters, a power aside): "s", "m s^{-1}" -- a unit only after a plain number
_LETTERS_PHRASE_RE = re.compile(r"[A-Za-z]\.?(?:[\s/]+[A-Za-z]\.?)*\s*(?:" + _UNIT_POWER + ")?")
# a plain number (the last item of a list), perhaps after "\$" or an assigned name: "12", "-3.5", "2e-3", "x = 5", "x_1 = 3"
_PLAIN_PREFIX_RE = re.compile(
    r"(?:[A-Za-z](?:_\{?\w+\}?)?\s*=\s*)?(?:\\\$)?\s*[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?"
    r"(?:[eE][-+]?\d{1,3})?"
)
# the unit letters (the SI symbols a single letter may be)
UNIT_LETTERS = frozenset("mgshlL")
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")

_REFUSED = "\x00refused"  # the answer is equal to nothing (a number word it does not multiply)
_BOX_OPEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SPACED_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?")
_COMMAND_SPACE_RE = re.compile(r"(\\[A-Za-z]+) +(?=[A-Za-z])")
_BRACELESS_ARGS_RE = re.compile(r"\\(frac|binom)\s*(\d)\s*(\d)(?!\d)")


def _join_spaces(s: str) -> str:
    r"""Remove the spaces of ``s`` without joining what they separate: a command keeps one space before a letter
    (``5 \geq x``, ``\sqrt x``), ``\frac 1 2`` is ``\frac{1}{2}``, and two digits separated only by a space
    (``2 3``, ``1 1/2``) refuse the answer (neither 23 nor a product: the grader does not guess)."""
    s = _BRACELESS_ARGS_RE.sub(r"\\\1{\2}{\3}", s)
    s = re.sub(r"\\sqrt\s+([A-Za-z0-9])", r"\\sqrt{\1}", s)  # \sqrt x: one token, as TeX reads it
    if re.search(r"\d +\d", s):
        return _REFUSED
    s = _COMMAND_SPACE_RE.sub("\\1\x01", s)
    return s.replace(" ", "").replace("\x01", " ")


def _trailing_words(s: str, wrapped: bool, variables: frozenset = frozenset()) -> str:
    r"""Apply the trailing-word rule to ``s``: a trailing ``\text{...}``-like phrase (``wrapped``) or a plain phrase
    after a number and a space: units are dropped, a multiplier multiplies a plain number, another number word refuses
    the answer, anything else stays (a symbol such as ``\mathrm{i}`` is unwrapped later and read as a symbol).
    A phrase of single letters (``s``, ``m s^{-1}``) is a unit only after a plain number (when plain) and only when
    none of its letters is in ``variables`` (the letters the other answer uses as variables)."""
    if wrapped:
        m = _TEXT_TAIL_RE.search(s)
        if m is None:
            return s
        phrase = m.group(1).strip() + (m.group(2) or "")
        if not _PHRASE_TEXT_RE.fullmatch(phrase):
            return s
    else:
        m = _PLAIN_TAIL_RE.search(s)
        if m is None:
            return s
        phrase = m.group(1).strip()
    prefix = s[: m.start()].strip()
    if not re.search(r"\d", prefix):
        return s
    kind, factor = _classify_phrase(phrase)
    last_item = prefix.rsplit(",", 1)[-1].strip().rstrip(".")
    if kind == "unit" and _LETTERS_PHRASE_RE.fullmatch(phrase) and (
        (not wrapped and not _PLAIN_PREFIX_RE.fullmatch(last_item)) or variables & set(re.findall(r"[A-Za-z]", phrase))
    ):
        # after anything but a plain number ("\frac{\sqrt3}{4} s^2", "2x + 3 m"), a plain letter is the problem's
        # variable, and so is a unit letter that the other answer uses as a variable ("4 s" against "4s")
        return s
    if kind == "unit":
        return prefix
    if kind == "multiplier":
        number = re.sub(r"^\\\$|\\?\s", "", prefix)
        m_var = _LEADING_VAR_RE.match(number)
        head = ""
        if m_var is not None and "=" not in m_var.group("rest"):
            head, number = number[: m_var.start("rest")], m_var.group("rest")
        if not _PLAIN_NUMBER_RE.fullmatch(number):
            return _REFUSED
        value = Decimal(number.replace(",", "")) * factor
        return head + _canonical_number(format(value.normalize(), "f"))
    if kind == "number":
        return _REFUSED
    return s


# =============================================================================== normalisation
# "\d+(?:\.\d*)?" rather than "\d+\.?\d*": the latter backtracks quadratically over a long run of digits
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_E_NOTATION_RE = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,3})(?![\w.])")
# e-notation is read only as a whole item (the answer, or one item of a list / tuple / set): never inside an
# expression, where "2e+1" is 2e + 1 with Euler's e
_E_NOTATION_ITEM_RE = re.compile(
    r"(?<![^,(\[{=])([-+]?)(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,3})(?=$|[,)\]}]|\\\})"
)
# "or" / "and" between answers, with the commas around them: "1, 2, \text{and } 3", "2 or 3", "2, or 3"
_LIST_WORD_RE = re.compile(
    r"\s*,?\s*\\text\s*\{\s*,?\s*(?:or|and)\s*,?\s*\}\s*,?\s*|\s*,\s*(?:or|and)\s+|\s+(?:or|and)\s+"
    r"|(?<=[)\]])\s*or\s*(?=[(\[])",
    re.I,
)
_LEADING_VAR_RE = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*(?:=|\\in(?![A-Za-z]))\s*(?P<rest>.+)$")
# only "x \in S" loses its variable; an assignment "x = 5" keeps its name (the worker compares the names)
_LEADING_MEMBER_RE = re.compile(
    r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*\\in(?![A-Za-z])\s*(?P<rest>.+)$"
)
# a repeating decimal: 0.\overline{3}, 0.1\overline{6}, 0.\bar6, 0.\dot3, 0.\dot{1}4\dot{2} (the dots mark the period)
_REPEATING_RE = re.compile(
    r"(?<![\d.])(\d*)\.(\d*)(?:\\(?:overline|bar)\s*(?:\{\s*(\d+)\s*\}|(\d))"
    r"|\\dot\s*(?:\{\s*(\d)\s*\}|(\d))(?:(\d*)\\dot\s*(?:\{\s*(\d)\s*\}|(\d)))?)"
    r"(?P<after>\s*(?:[\d.(\[{]|\\[dtc]?frac(?![A-Za-z]))|)"
)
# Euler's number written upright or as text: kept apart from any digit before it, so that it is never e-notation
_EULER_RE = re.compile(r"\\(?:mathrm|text|textrm|mathit|operatorname|mathnormal)\s*\{\s*e\s*\}")
# relations written in ASCII or unicode
_RELATIONS = ((">=", "\\geq "), ("<=", "\\leq "), ("!=", "\\neq "), ("\u2265", "\\geq "), ("\u2264", "\\leq "),
              ("\u2260", "\\neq "))
_ARRAY_BEGIN_RE = re.compile(r"\\begin\s*\{array\}\s*\{[^{}]*\}")
# hyphen, non-breaking hyphen, figure dash, en dash, minus sign, small and fullwidth hyphen-minus
_MINUS_LOOKALIKES = "\u2010\u2011\u2012\u2013\u2212\ufe63\uff0d"
_MINUS_TABLE = str.maketrans({c: "-" for c in _MINUS_LOOKALIKES})
_PERCENT_WORD_RE = re.compile(
    r"\s*(?:\\text\s*\{\s*(?:percent|percentage|pct|per\s*cent)\s*\}|(?<![A-Za-z])(?:percent|percentage|pct|per\s*cent))"
    r"\s*$"
)


def variable_letters(normalised: str) -> frozenset:
    """The unit letters (``m g s h l L``) that a normalised answer uses as variables: single letters, neither part of
    a command nor of a word (``4s``, ``\\frac{\\sqrt{3}}{4}s^2``; not ``Monday``, ``\\sqrt``)."""
    bare = re.sub(r"\\[A-Za-z]+", " ", normalised)
    return frozenset(re.findall(r"(?<![A-Za-z])[mgshlL](?![A-Za-z])", bare))


_SUPERSCRIPTS = dict(zip("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b\u207c\u207d\u207e\u207f\u2071",
                         "0123456789+-=()ni"))
_SUBSCRIPTS = dict(zip("\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089\u208a\u208b\u208c\u208d\u208e",
                       "0123456789+-=()"))
# operators and symbols written as unicode characters -> LaTeX (a trailing space ends a command before a letter)
_UNICODE_COMMANDS = {
    "\u00d7": "\\times ", "\u00f7": "\\div ", "\u00b7": "\\cdot ", "\u22c5": "\\cdot ", "\u2219": "\\cdot ",
    "\u00b1": "\\pm ", "\u2213": "\\mp ", "\u222a": "\\cup ", "\u2229": "\\cap ", "\u2208": "\\in ",
    "\u2205": "\\emptyset ", "\u211d": "\\mathbb{R}", "\u2223": "\\mid ", "\u2a7e": "\\geq ", "\u2a7d": "\\leq ",
    "\u2227": "\\land ", "\u2228": "\\lor ", "\u066b": ".", "\u066c": ",", "\u2032": "'",
    # multiplier characters of Chinese and Japanese numerals after a number: 3万 = 30000, 2億 = 200000000
    "\u4e07": " myriad", "\u842c": " myriad", "\u4ebf": " hundred million", "\u5104": " hundred million",
}
_ROOTS = {"\u221a": "\\sqrt", "\u221b": "\\sqrt[3]", "\u221c": "\\sqrt[4]"}
_GREEK_NAMES = {"lamda": "lambda"}


def _unicode_char(ch: str) -> str | None:
    """LaTeX / ASCII for one non-ASCII character, or None to keep it: a decimal digit of any script (Arabic-Indic,
    Devanagari, fullwidth, mathematical bold, ...) is that digit, a mathematical or fullwidth letter its letter, a
    Greek letter its command."""
    if ch in _UNICODE_COMMANDS:
        return _UNICODE_COMMANDS[ch]
    digit = unicodedata.decimal(ch, None)
    if digit is not None:
        return str(digit)
    code = ord(ch)
    if 0x1D400 <= code <= 0x1D7FF or 0xFF01 <= code <= 0xFF5E:  # mathematical alphanumerics, fullwidth ASCII
        folded = unicodedata.normalize("NFKC", ch)
        if folded.isascii():
            return folded
        ch = folded
    name = unicodedata.name(ch, "")
    if name.startswith(("GREEK SMALL LETTER ", "GREEK CAPITAL LETTER ")) and len(name.split()) == 4:
        letter = _GREEK_NAMES.get(name.split()[-1].lower(), name.split()[-1].lower())
        if name.startswith("GREEK CAPITAL"):
            if letter not in ("gamma", "delta", "theta", "lambda", "xi", "pi", "sigma", "upsilon", "phi", "psi", "omega"):
                return None
            letter = letter.capitalize()
        return "\\" + letter + " "
    return None


def _radicand(s: str, i: int) -> tuple[str, int]:
    """The operand of a unicode radical at ``s[i:]``: a parenthesised or braced group (its content), a number, a
    letter or a command; ``("", i)`` when there is none."""
    n = len(s)
    if i < n and s[i] in "({":
        close = ")" if s[i] == "(" else "}"
        depth = 0
        for j in range(i, min(n, i + 200)):  # bounded: linear in all
            if s[j] in "({":
                depth += 1
            elif s[j] in ")}":
                depth -= 1
                if depth == 0:
                    return (s[i + 1 : j], j + 1) if s[j] == close else ("", i)
        return "", i
    m = re.compile(r"\d+(?:\.\d+)?|[A-Za-z]|\\[A-Za-z]+").match(s, i)
    return (m.group(0), m.end()) if m else ("", i)


def _unicode_math(s: str) -> str:
    r"""Unicode notation → LaTeX: superscripts (``x²`` → ``x^{2}``, ``x⁻¹`` → ``x^{-1}``), subscripts (``x₁`` →
    ``x_{1}``), radicals (``√2`` → ``\sqrt{2}``, ``√(x+1)`` → ``\sqrt{x+1}``, ``∛8`` → ``\sqrt[3]{8}``), digits of
    every script, operators (``×`` ``÷`` ``·`` ``±``), Greek letters. Linear in the length."""
    if s.isascii():
        return s
    out: list[str] = []
    chars = list(s)
    k = 0
    while k < len(chars):
        ch = chars[k]
        if ch in _SUPERSCRIPTS or ch in _SUBSCRIPTS:
            table, mark = (_SUPERSCRIPTS, "^") if ch in _SUPERSCRIPTS else (_SUBSCRIPTS, "_")
            j = k
            while j < len(chars) and chars[j] in table:
                j += 1
            out.append(mark + "{" + "".join(table[c] for c in chars[k:j]) + "}")
            k = j
            continue
        if ord(ch) >= 128:
            rep = _unicode_char(ch)
            out.append(ch if rep is None else rep)
        else:
            out.append(ch)
        k += 1
    s = "".join(out)
    if any(r in s for r in _ROOTS):
        pieces: list[str] = []
        i = 0
        while i < len(s):
            if s[i] in _ROOTS:
                operand, end = _radicand(s, i + 1)
                pieces.append(_ROOTS[s[i]] + ("{" + operand + "}" if operand else ""))
                i = end if operand else i + 1
                continue
            pieces.append(s[i])
            i += 1
        s = "".join(pieces)
    return s


# \not= is \neq (and \not< / \not> the other relation of the reals)
_NOT_RELATION_RE = re.compile(r"\\not\s*(=|<|>)")
_NOT_RELATIONS = {"=": "\\neq ", "<": "\\geq ", ">": "\\leq "}
_COLOR_RE = re.compile(r"\\color\s*\{[^{}]{0,40}\}")
_TEXTCOLOR_RE = re.compile(r"\\(?:textcolor|colorbox)\s*\{[^{}]{0,40}\}\s*\{")


_RELATION_RE = re.compile(r"[<>]|\\(?:le|ge|leq|geq|lt|gt|ne|neq|leqslant|geqslant)(?![A-Za-z])")
_LIST_WORD_CONTEXT = 200  # characters looked at on each side of an "and" / "or" (bounded: linear in all)


def _list_words(s: str) -> str:
    r"""``or`` / ``and`` between answers → ``,``; between two relations (``x > 2 \text{ and } x < 5``) → ``\land`` /
    ``\lor``, so that the worker reads an intersection / a union of solution sets."""

    def repl(m: re.Match) -> str:
        before = s[max(0, m.start() - _LIST_WORD_CONTEXT) : m.start()].rsplit(",", 1)[-1]
        after = s[m.end() : m.end() + _LIST_WORD_CONTEXT].split(",", 1)[0]
        if _RELATION_RE.search(before) and _RELATION_RE.search(after):
            return "\\land " if re.search(r"and", m.group(0), re.I) else "\\lor "
        return ","

    return _LIST_WORD_RE.sub(repl, s)


def _vulgar_fractions(s: str) -> str:
    r"""``½`` → ``\frac{1}{2}`` (every character whose Unicode decomposition is a ``<fraction>``), ``⁄`` → ``/``.
    After a digit the result is a mixed number (``2½`` = ``2\frac{1}{2}``)."""
    if s.isascii():
        return s
    out = []
    for ch in s:
        if ord(ch) < 128:
            out.append(ch)
            continue
        if ch == "\u2044":  # fraction slash
            out.append("/")
            continue
        decomposition = unicodedata.decomposition(ch)
        if decomposition.startswith("<fraction>"):
            codes = decomposition.split()[1:]
            text = "".join(chr(int(c, 16)) for c in codes)
            num, _, den = text.partition("\u2044")
            if num.isdigit() and den.isdigit():
                out.append("\\frac{%s}{%s}" % (num, den))
                continue
        out.append(ch)
    return "".join(out)


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
    """``1e3`` → ``1000``, ``2.5e-3`` → ``0.0025`` (exact decimal; exponents up to 3 digits), for a number that is
    a whole item of the answer only (``1e3``, ``(1e3, 2)``), never inside an expression (``e^2-2e+1``)."""

    def repl(m: re.Match) -> str:
        d = Decimal(m.group(2) + "e" + m.group(3))
        return m.group(1).replace("+", "") + _canonical_number(format(d, "f"))

    return _E_NOTATION_ITEM_RE.sub(repl, s)


def _repeating_decimals(s: str) -> str:
    r"""``0.\overline{3}`` → ``\frac{3}{9}``, ``0.1\overline{6}`` → ``\frac{15}{90}`` (exact); a repeating decimal
    followed by what would continue a number (a digit, a point, a fraction, a bracket: ``0.\overline{3}3``,
    ``1.\overline{9}\frac12``) refuses the answer."""

    def repl(m: re.Match) -> str:
        if m.group("after"):
            return _REFUSED
        whole, fixed = m.group(1) or "0", m.group(2)
        if m.group(3) or m.group(4):
            period = m.group(3) or m.group(4)
        elif m.group(8) or m.group(9):  # \dot{a} ... \dot{b}: the period runs from a to b
            period = (m.group(5) or m.group(6)) + m.group(7) + (m.group(8) or m.group(9))
        else:
            period = m.group(5) or m.group(6)
        num = int(whole + fixed + period) - int(whole + fixed)
        den = (10 ** len(period) - 1) * 10 ** len(fixed)
        return "\\frac{%d}{%d}" % (num, den)

    return _REPEATING_RE.sub(repl, s) if "." in s else s


def _canonical_number(s: str) -> str:
    """A lone decimal number written canonically (``0.50`` → ``0.5``, ``5.0`` → ``5``, ``042`` → ``42``, ``-0`` →
    ``0``); a decimal with at least ``APPROX_MIN_DIGITS`` significant digits keeps its trailing zeros, which are its
    written precision (``0.3333330`` does not stand for 1/3). String operations only: linear in the length."""
    if not _NUMBER_RE.fullmatch(s):
        return s
    sign = "-" if s.startswith("-") else ""
    whole, dot, frac = s.lstrip("+-").partition(".")
    if not (dot and frac.endswith("0") and len((whole + frac).lstrip("0")) >= APPROX_MIN_DIGITS):
        frac = frac.rstrip("0")
    out = (whole.lstrip("0") or "0") + ("." + frac if frac else "")
    return out if out == "0" else sign + out


def normalize_math_answer(s: Any, variables: frozenset = frozenset()) -> str:
    r"""String normalisation of a final answer (never raises; rules in ``docs/rewards.md``).

    Reads unicode minus look-alikes as ``-`` and vulgar fractions (``½``) as ``\frac{1}{2}``; normalises
    whitespace, then refuses (returns ``""``, equal to nothing) an answer longer than :data:`MAX_ANSWER_CHARS`.
    Removes: surrounding ``$``/``\(``/``\[`` delimiters, ``\left``/``\right``/``\big``, ``\displaystyle``, LaTeX
    spacing (``\!`` ``\,`` ``\;`` ``\:`` ``\ `` ``~`` ``\quad``; a row break ``\\`` is kept), degree marks, ``\$``,
    a full stop after the answer, a trailing unit phrase (in a ``\text{}``-like wrapper after a numeric prefix, or
    plain words after a number and a space), a leading ``x \in`` (an assignment ``x = 5`` keeps its name),
    thousands separators (``1{,}000``, ``10,\!080``, ``1\,000`` anywhere; ``1,000`` and ``1 000`` only when the
    *whole* answer is one number written with 3-digit groups, so ``(1,2)`` and ``2, 300`` are lists), whitespace
    (a command keeps one space before a letter; two digits separated by a space refuse the answer). A box inside the
    answer is unwrapped; repeating decimals become exact fractions; ``\mathrm{e}`` is Euler's ``{e}``; ``>=`` is
    ``\geq``; an ``array`` is a ``matrix``. A trailing multiplier word multiplies a plain number
    (``5 million`` → ``5000000``); another number word (``3 squared``, ``2 halves``) refuses the answer; a single
    letter is never a unit unless it is an SI symbol (m, g, s, h, l), so ``1+2\mathrm{i}`` → ``1+2i``. Keeps ``\%``
    as ``%`` (the percent rule needs it), writes ``or`` / ``and`` between answers as ``,``, expands e-notation
    (``1e3`` → ``1000``), rewrites ``\dfrac``/``\tfrac``/``\cfrac`` → ``\frac``, ``\frac12`` → ``\frac{1}{2}``,
    ``\sqrt2`` → ``\sqrt{2}``, unwraps ``\text{..}``/``\mathrm{..}`` etc., and writes plain decimal numbers
    canonically (``0.50`` → ``0.5``, ``5.0`` → ``5``, ``.5`` → ``0.5``).
    """
    try:
        out = _normalize(s, frozenset(variables))
    except Exception:  # pragma: no cover - defensive
        return ""
    return "" if _REFUSED in out else out


def _normalize(s: Any, variables: frozenset = frozenset()) -> str:
    if s is None:
        return ""
    s = str(s).translate(_MINUS_TABLE)
    s = _vulgar_fractions(s)
    s = " ".join(s.split())  # every whitespace run is one space: the length limit counts what the answer writes
    if len(s) > MAX_ANSWER_CHARS:
        return ""
    s = s.replace("\u00b0", "^\\circ").replace("\u03c0", "\\pi").replace("\u221e", "\\infty")
    for ascii_rel, command in _RELATIONS:
        s = s.replace(ascii_rel, command)
    s = _unicode_math(s)
    s = _NOT_RELATION_RE.sub(lambda m: _NOT_RELATIONS[m.group(1)], s)
    s = _COLOR_RE.sub("", s)  # {\color{red} 5}: the colour switch goes, its text stays
    s = _unwrap_command(s, _TEXTCOLOR_RE)
    if _BOX_RE.search(s):
        s = _unwrap_command(s, _BOX_OPEN_RE)  # a box inside the answer is its content: \boxed{\boxed{5}+1} is 6
    s = s.strip().rstrip(".").rstrip()  # a full stop after the answer (also after its closing "$")
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
    s = s.strip().rstrip(".").rstrip()  # a full stop inside the delimiters
    s = _repeating_decimals(s)
    if _REFUSED in s:
        return s
    s = re.sub(r"\\(?:displaystyle|textstyle|scriptstyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:left|right)\s*\.", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:[dtc]|nice|s)frac(?![A-Za-z])", r"\\frac", s)
    # degrees / percent
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}", "", s)
    s = re.sub(r"\^\s*\\circ(?![A-Za-z])", "", s)
    s = re.sub(r"\\degree(?![A-Za-z])", "", s)  # a bare \circ is composition (f \circ g), never a degree mark
    s = s.replace("\\%", "%")
    s = _PERCENT_WORD_RE.sub("%", s)
    # thousands separators in LaTeX form: 1{,}000
    s = re.sub(r"(?<=\d)\{,\}(?=\d{3})", "", s)
    # MATH's 10,\!080 and a thin space 1\,000 between 3-digit groups: one number
    s = re.sub(r"(?<=\d)(?:,\s*\\!|\\,)\s*(?=\d{3}(?!\d))", "", s)
    s = _ARRAY_BEGIN_RE.sub(r"\\begin{matrix}", s).replace("\\end{array}", "\\end{matrix}")
    # spacing commands (before unit handling, so "5\,\text{cm}" works); "\\" (a row break) stays
    s = re.sub(r"\\\\|\\[,;:! ]", lambda m: m.group(0) if m.group(0) == "\\\\" else " ", s)
    s = re.sub(r"\\(?:q?quad|enspace|thinspace|medspace|thickspace)(?![A-Za-z])", " ", s)
    s = re.sub(r"  +", " ", s.replace("~", " "))  # spacing commands next to spaces: one space
    s = _list_words(s)
    s = _EULER_RE.sub("{e}", s)
    s = _trailing_words(s.strip(), True, variables)
    if _REFUSED in s:
        return s
    s = _unwrap_command(s, _TEXT_RE)
    s = _list_words(s)
    s = _PERCENT_WORD_RE.sub("%", s.strip().rstrip(".").rstrip())
    s = _trailing_words(s.strip(), False, variables)
    if _REFUSED in s:
        return s
    s = s.rstrip().rstrip(".").rstrip()  # a full stop before the dropped unit: "1,250. s"
    # leading "x \in" (an assignment "x = 5" keeps its name)
    m = _LEADING_MEMBER_RE.match(s)
    if m is not None and "=" not in m.group("rest"):
        s = m.group("rest")
    # "\log_2 8": a one-character subscript stays one once the spaces are gone
    s = re.sub(r"_(\w) (?=\w)", r"_{\1}", s)
    # 1,000,000 -> 1000000 (whole answer only, and only without spaces: "2, 300" is a list)
    if _THOUSANDS_RE.fullmatch(s.strip()) or _SPACED_THOUSANDS_RE.fullmatch(s.strip()):
        s = s.replace(",", "").replace(" ", "")
    s = _join_spaces(s)
    if _REFUSED in s:
        return s
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
