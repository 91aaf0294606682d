r"""Math answer reward: last ``\boxed{...}`` of the completion vs. the ground truth, binary.

Pipeline of :func:`math_answers_equal` (first success wins; the rules are in ``docs/rewards.md``):

1. string normalisation (:func:`normalize_math_answer`) and exact comparison — in process, cheap;
2. structural comparison in a worker (``_math_worker.py``): the answer's structure (lists, sets,
   tuples / intervals, inequalities, matrices, percentages, choice letters) is read by our own
   parser, scalar leaves by ``latex2sympy2_extended`` (a leaf it cannot read in full is not
   equal to anything), with decimal literals rewritten as exact fractions; numbers compare exactly
   (integers and rationals never by tolerance, decimals by their written precision), expressions
   by sympy.

``math_verify`` (which brings ``latex2sympy2_extended``) is not used to decide: its ``verify``
rounds floats to 6 decimal places (``0.1234567`` = ``0.1234568``) and equates ``(2,3)`` with
``2, 3``, and its ``parse`` reads the longest answer-like prefix (``72(0`` is 72), which the
reward-hacking search (``tests/test_reward_hacking.py``) turned into false positives.

Time bound (step 2): it runs in a persistent **worker process** (started lazily, a pool of
``DLLM_TRL_MATH_WORKERS`` processes, default ``min(2, cpu_count)``). Inside the worker a
``signal.setitimer`` alarm (the worker's main thread) gives a soft bound; because that cannot
interrupt long C-level work (e.g. ``9^{9^{9^9}}`` evaluates a huge integer power), the caller waits
at most ``timeout + 1 s`` for the answer and otherwise SIGKILLs the worker's process group and
counts the pair as *not equal*; a fresh worker is started for the next comparison. The caller's
thread is never blocked longer than that, and no signal handler is installed in the caller, so
this works from any thread. If worker processes cannot be started at all, the checks run in
process, bounded by SIGALRM only when called from the main thread; from other threads they are
skipped (string comparison only) with a one-time warning.

No parse is done with ``eval``: sympy's ``parse_expr`` is never applied to model output here.

Missing backends are not silent: importing this module warns (``RuntimeWarning``) when
``latex2sympy2_extended`` is not installed, and the first heavy comparison
warns and logs an error when the worker reports that a backend is unusable (e.g. the antlr
runtime version does not match).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Sequence

from ._processes import kill_process_group, program_source, start_isolated, warn_once, workers_from_env

logger = logging.getLogger(__name__)

__all__ = [
    "extract_boxed_answer",
    "normalize_math_answer",
    "math_answers_equal",
    "math_reward",
    "make_math_reward",
    "extract_gold_answer",
    "completion_to_text",
]

DEFAULT_TIMEOUT = 5.0
_GRACE = 1.0  # extra seconds the caller waits beyond the worker's own soft timeout
_STARTUP_TIMEOUT = 180.0  # importing sympy + the LaTeX parser on a loaded machine

if importlib.util.find_spec("latex2sympy2_extended") is None:  # pragma: no cover - environment dependent
    warnings.warn(
        "dllm_trl.rewards.math: 'latex2sympy2_extended' is not installed; the math reward compares "
        "normalised strings only. Install math-verify>=0.8 (it brings latex2sympy2_extended[antlr]).",
        RuntimeWarning,
        stacklevel=2,
    )


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


# =============================================================================== normalisation
_TEXT_CMDS = r"(?:text|textrm|textnormal|textbf|textit|textsf|texttt|mbox|mathrm|mathbf|mathit|mathsf|operatorname)"
_TEXT_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{")
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
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_E_NOTATION_RE = re.compile(r"(?<![\w.\\])(\d+\.?\d*|\.\d+)[eE]([+-]?\d{1,3})(?![\w.])")
_LIST_WORD_RE = re.compile(r"\s+(?:or|and)\s+|\\text\s*\{\s*(?:or|and)\s*\}|,\s*(?:or|and)\s+", re.I)
_LEADING_VAR_RE = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*(?:=|\\in(?![A-Za-z]))\s*(?P<rest>.+)$")


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


def _expand_e_notation(s: str) -> str:
    """``1e3`` → ``1000``, ``2.5e-3`` → ``0.0025`` (exact decimal; exponents up to 3 digits)."""

    def repl(m: re.Match) -> str:
        d = Decimal(m.group(1) + "e" + m.group(2))
        return _canonical_number(format(d, "f"))

    return _E_NOTATION_RE.sub(repl, s)


def _canonical_number(s: str) -> str:
    if not _NUMBER_RE.fullmatch(s):
        return s
    try:
        d = Decimal(s)
    except InvalidOperation:
        return s
    if d == d.to_integral_value():
        return str(int(d))
    out = format(d.normalize(), "f")
    return out


def normalize_math_answer(s: Any) -> str:
    r"""String normalisation of a final answer (never raises; rules in ``docs/rewards.md``).

    Removes: surrounding ``$``/``\(``/``\[`` delimiters, ``\left``/``\right``/``\big``,
    ``\displaystyle``, LaTeX spacing (``\!`` ``\,`` ``\;`` ``\:`` ``\ `` ``~`` ``\quad``; a row
    break ``\\`` is kept), degree marks, ``\$``, trailing units (in ``\text{}``-like wrappers after a
    numeric prefix, or a known unit word, also ``km/h``-style, after a number), a leading ``x =`` /
    ``x \in``, thousands separators (``1{,}000`` anywhere; ``1,000`` only when the *whole* answer is
    one number written with 3-digit groups and no spaces, so ``(1,2)`` and ``2, 300`` are lists),
    trailing full stops, all whitespace. Keeps ``\%`` as ``%`` (the percent rule needs it), writes
    ``or`` / ``and`` between answers as ``,``, expands e-notation (``1e3`` → ``1000``), rewrites
    ``\dfrac``/``\tfrac``/``\cfrac`` → ``\frac``, ``\frac12`` → ``\frac{1}{2}``, ``\sqrt2`` →
    ``\sqrt{2}``, unwraps ``\text{..}``/``\mathrm{..}`` etc., and writes plain decimal numbers
    canonically (``0.50`` → ``0.5``, ``5.0`` → ``5``, ``.5`` → ``0.5``).
    """
    try:
        return _normalize(s)
    except Exception:  # pragma: no cover - defensive
        return str(s).strip() if s is not None else ""


def _normalize(s: Any) -> str:
    if s is None:
        return ""
    s = str(s)
    if len(s) > 10_000:
        s = s[:10_000]
    s = s.replace("\u2212", "-").replace("\u00b0", "^\\circ").replace("\u03c0", "\\pi").replace("\u221e", "\\infty")
    s = s.strip()
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
    s = s.replace("\n", " ")
    s = re.sub(r"\\(?:displaystyle|textstyle|scriptstyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:left|right)\s*\.", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:[dtc]frac)(?![A-Za-z])", r"\\frac", s)
    # degrees / percent
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}", "", s)
    s = re.sub(r"\^\s*\\circ(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:circ|degree)(?![A-Za-z])", "", s)
    s = s.replace("\\%", "%")
    s = re.sub(r"\s*(?:\\text\s*\{\s*percent\s*\}|(?<![A-Za-z])percent)\s*$", "%", s)
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
    s = re.sub(r"_(\w)\s+(?=\w)", r"_{\1}", s)
    # 1,000,000 -> 1000000 (whole answer only, and only without spaces: "2, 300" is a list)
    if _THOUSANDS_RE.fullmatch(s.strip()):
        s = s.replace(",", "")
    s = re.sub(r"\s+", "", s)
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
    s = _canonical_number(s)
    # -0 -> 0
    if s == "-0":
        s = "0"
    return s


# =============================================================================== heavy checks (worker pool)
def _worker_source() -> str:
    return program_source("_math_worker.py")


class _Worker:
    """One persistent worker process. Not thread-safe by itself: the pool hands it to one thread."""

    def __init__(self, source: str):
        self._source = source
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        self._ready = False
        self._next_id = 0

    def _start(self) -> None:
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        self.proc = start_isolated([sys.executable, "-c", self._source], env)
        self._buf = b""
        self._ready = False

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        self._ready = False
        if proc is not None:
            kill_process_group(proc, wait=5)

    def _readline(self, deadline: float) -> dict | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            r, _, _ = select.select([fd], [], [], remaining)
            if not r:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # worker died
            self._buf += chunk
            if len(self._buf) > 1 << 20:
                return None
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def ensure_ready(self) -> dict | None:
        if self.proc is not None and self.proc.poll() is None and self._ready:
            return {}
        self.kill()
        self._start()
        msg = self._readline(time.monotonic() + _STARTUP_TIMEOUT)
        if not msg or not msg.get("ready"):
            self.kill()
            return None
        self._ready = True
        return msg.get("backends") or {}

    def compare(self, pred: str, gold: str, timeout: float) -> tuple[bool, str]:
        backends = self.ensure_ready()
        if backends is None:
            raise OSError("math worker failed to start")
        if backends:
            _check_backends(backends)
        self._next_id += 1
        req = json.dumps({"id": self._next_id, "pred": pred, "gold": gold, "timeout": timeout}) + "\n"
        try:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(req.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.kill()
            return False, "worker-died"
        deadline = time.monotonic() + timeout + _GRACE
        while True:
            msg = self._readline(deadline)
            if msg is None:
                # hard bound: the worker is stuck in C code or dead -> kill the process group
                self.kill()
                return False, "hard-timeout"
            if msg.get("id") == self._next_id:
                return bool(msg.get("equal")), str(msg.get("stage", ""))


def _check_backends(info: dict) -> None:
    if not info.get("sympy_parser"):
        warn_once(
            logger,
            "sympy",
            "dllm_trl math reward: no LaTeX parser for the structural stage (latex2sympy2_extended "
            f"unusable: {'; '.join(info.get('errors', []))}). Only normalised strings are compared.",
        )


class _Pool:
    """``size`` :class:`_Worker` processes handed to one calling thread at a time.

    Not a multiprocessing-based pool (e.g. ``pebble.ProcessPool``, measured in ``benchmarks/math_reward_pool.py``):
    those workers either fork the trainer (torch, CUDA, threads) or re-import its ``__main__`` module, and their
    per-task timeout starts when a worker picks the task up, so a wedged worker can hold a caller indefinitely; here
    the deadline runs from the request and a worker is a fresh ``python -c`` of ``_math_worker.py``.
    """

    def __init__(self, size: int):
        self.size = max(1, int(size))
        self._source = _worker_source()
        self._free: queue.Queue[_Worker] = queue.Queue()
        for _ in range(self.size):
            self._free.put(_Worker(self._source))
        self._all: list[_Worker] = list(self._free.queue)
        self.broken = False

    def compare(self, pred: str, gold: str, timeout: float) -> tuple[bool, str]:
        w = self._free.get()
        try:
            return w.compare(pred, gold, timeout)
        finally:
            self._free.put(w)

    def close(self) -> None:
        for w in self._all:
            w.kill()


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _default_workers() -> int:
    return workers_from_env("DLLM_TRL_MATH_WORKERS") or max(1, min(2, os.cpu_count() or 1))


def _get_pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Pool(_default_workers())
        return _POOL


def shutdown_math_workers() -> None:
    """Kill the worker processes (they are restarted on demand)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_math_workers)


def _heavy_inline(pred: str, gold: str, timeout: float) -> bool:
    if threading.current_thread() is not threading.main_thread():
        warn_once(
            logger,
            "inline-thread",
            "dllm_trl math reward: worker processes unavailable and not on the main thread, so the "
            "structural/sympy checks cannot be time-bounded and are SKIPPED (string comparison only).",
        )
        return False
    from . import _math_worker

    _check_backends(_math_worker._backends()[1])
    return _math_worker.heavy_equal(pred, gold, timeout)[0]


def _heavy_equal(pred: str, gold: str, timeout: float) -> bool:
    if os.environ.get("DLLM_TRL_MATH_INLINE") == "1":
        return _heavy_inline(pred, gold, timeout)
    pool = _get_pool()
    if not pool.broken:
        try:
            return pool.compare(pred, gold, timeout)[0]
        except OSError as exc:
            pool.broken = True
            warn_once(logger, "pool",
                      f"dllm_trl math reward: cannot start worker processes ({exc}); running in process.")
    return _heavy_inline(pred, gold, timeout)


# =============================================================================== public API
def math_answers_equal(pred: Any, gold: Any, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """True when ``pred`` and ``gold`` denote the same answer. Never raises.

    Normalised string equality first; then the structural / sympy comparison in a worker process
    whose answer is awaited at most ``timeout + 1`` seconds (see the module docstring).
    """
    try:
        if pred is None or gold is None:
            return False
        p, g = normalize_math_answer(pred), normalize_math_answer(gold)
        if not p or not g:
            return False
        if p == g:
            return True
        if len(p) > 2000 or len(g) > 2000:
            return False
        return bool(_heavy_equal(p, g, float(timeout)))
    except Exception as exc:  # pragma: no cover - defensive: nothing escapes
        logger.debug("math_answers_equal failed: %r", exc)
        return False


def completion_to_text(completion: Any) -> str:
    """A TRL completion (string, or list of chat messages) → its text (last assistant message)."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_to_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        msgs = [m for m in completion if isinstance(m, dict)]
        assistant = [m for m in msgs if m.get("role", "assistant") == "assistant"]
        pick = assistant[-1] if assistant else (msgs[-1] if msgs else None)
        return _content_to_text(pick.get("content")) if pick is not None else ""
    return str(completion)


def _content_to_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # multimodal-style parts
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type", "text") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
        return "".join(parts)
    return str(content)


def _broadcast(values: Any, n: int, name: str) -> list:
    if values is None or isinstance(values, (str, int, float)):
        return [values] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} completions")
    return values


def _score_one(completion: Any, gold: Any, timeout: float) -> float:
    try:
        pred = extract_boxed_answer(completion_to_text(completion))
        if pred is None:
            return 0.0
        g = extract_gold_answer(gold)
        if g is None:
            return 0.0
        return 1.0 if math_answers_equal(pred, g, timeout=timeout) else 0.0
    except Exception:  # pragma: no cover - defensive
        return 0.0


def _score_batch(completions: Sequence[Any], golds: Sequence[Any], timeout: float, num_threads: int | None) -> list[float]:
    n = len(completions)
    if n == 0:
        return []
    threads = num_threads or _default_workers()
    if n == 1 or threads <= 1:
        return [_score_one(c, g, timeout) for c, g in zip(completions, golds)]
    with ThreadPoolExecutor(max_workers=min(threads, n)) as ex:
        return list(ex.map(lambda cg: _score_one(cg[0], cg[1], timeout), zip(completions, golds)))


def math_reward(completions: Sequence[Any], answer: Sequence[Any] | Any, **kwargs: Any) -> list[float]:
    r"""TRL reward function: 1.0 when the last ``\boxed{}`` of a completion equals the answer, else 0.0.

    Args:
        completions: list of strings, or (conversational data) list of message lists
            ``[{"role": "assistant", "content": "..."}]`` — the last assistant message is used.
        answer: the dataset's ``answer`` column (TRL passes every dataset column as a keyword
            argument, repeated per generation). Each entry may be a bare answer (``"\frac12"``), a
            solution containing ``\boxed{}`` (MATH) or a GSM8K ``"... #### 42"`` string.
        **kwargs: ``prompts``, ``completion_ids`` and the other dataset columns are ignored;
            ``math_timeout`` (seconds per comparison) is honoured.

    For datasets whose ground-truth column has another name (``solution``, ``ground_truth``...),
    use :func:`make_math_reward(answer_key=...)`. A completion without a box scores 0.0.
    """
    n = len(completions)
    timeout = float(kwargs.get("math_timeout", DEFAULT_TIMEOUT))
    golds = _broadcast(answer, n, "answer")
    return _score_batch(list(completions), golds, timeout, None)


def make_math_reward(
    answer_key: str = "answer",
    timeout: float = DEFAULT_TIMEOUT,
    num_threads: int | None = None,
    name: str | None = None,
) -> Callable[..., list[float]]:
    """Factory: a TRL reward function reading the ground truth from column ``answer_key``
    (e.g. ``"solution"`` for MATH, ``"ground_truth"``). The returned function's ``__name__`` is
    ``name`` (default ``"math_reward"`` / ``"math_reward_<key>"``), which TRL uses for logging."""

    def reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        if answer_key not in kwargs:
            raise KeyError(f"math reward: dataset column '{answer_key}' was not passed to the reward function")
        golds = _broadcast(kwargs[answer_key], len(completions), answer_key)
        return _score_batch(list(completions), golds, timeout, num_threads)

    reward.__name__ = name or ("math_reward" if answer_key == "answer" else f"math_reward_{answer_key}")
    reward.__qualname__ = reward.__name__
    return reward
