r"""Math answer reward: last ``\boxed{...}`` of the completion vs. the ground truth, binary.

Pipeline of :func:`math_answers_equal` (the rules are in ``docs/rewards.md``), all of it in a worker process
under the time bound; the caller only sends the two answers as written:

1. string normalisation (:func:`normalize_math_answer`, ``_math_text.py``) and exact comparison of the
   normalised strings (equal unless the answer divides by zero);
2. structural comparison (``_math_worker.py``): the answer's structure (lists, sets,
   tuples / intervals, inequalities, matrices, percentages, choice letters) is read by our own
   parser, scalar leaves by ``latex2sympy2_extended`` (a leaf it cannot read in full is not
   equal to anything), with decimal literals rewritten as exact fractions; numbers compare exactly
   (integers and rationals never by tolerance, decimals by their written precision), expressions
   by sympy.

``math_verify`` (which brings ``latex2sympy2_extended``) is not used to decide: its ``verify``
rounds floats to 6 decimal places (``0.1234567`` = ``0.1234568``) and equates ``(2,3)`` with
``2, 3``, and its ``parse`` reads the longest answer-like prefix (``72(0`` is 72), which the
reward-hacking search (``tests/test_reward_hacking.py``) turned into false positives.

Time bound (steps 1 and 2): they run in a persistent **worker process** (started lazily, a pool of
``DLLM_TRL_MATH_WORKERS`` processes, default ``min(2, cpu_count)``). Inside the worker a
``signal.setitimer`` alarm (the worker's main thread) gives a soft bound; because that cannot
interrupt long C-level work (e.g. ``9^{9^{9^9}}`` evaluates a huge integer power), the caller waits
at most ``timeout + 1 s`` for the answer and otherwise SIGKILLs the worker's process group and
counts the pair as *not equal*; a fresh worker is started for the next comparison. The caller's
thread is never blocked longer than that, and no signal handler is installed in the caller, so
this works from any thread. If worker processes cannot be started at all, the checks run in
process, bounded by SIGALRM only when called from the main thread; from other threads the structural checks are
skipped (normalised strings compared only, without a time bound) with a one-time warning.

No parse is done with ``eval``: sympy's ``parse_expr`` is never applied to model output here.

Missing backends are not silent: importing this module warns (``RuntimeWarning``) when
``latex2sympy2_extended`` is not installed, and the first heavy comparison
warns and logs an error when the worker reports that a backend is unusable (e.g. the antlr
runtime version does not match).
"""

from __future__ import annotations

import atexit
import errno
import importlib.util
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ._math_text import extract_boxed_answer, extract_gold_answer, normalize_math_answer
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
# an answer (a box's content, a gold) longer than this, before any cleanup, is not sent to a worker: equal to nothing.
# The cleanup's own limit (_math_text.MAX_ANSWER_CHARS, after whitespace normalisation) is the one that decides.
_MAX_RAW_CHARS = 1_000_000

if importlib.util.find_spec("latex2sympy2_extended") is None:  # pragma: no cover - environment dependent
    warnings.warn(
        "dllm_trl.rewards.math: 'latex2sympy2_extended' is not installed; the math reward compares "
        "normalised strings only. Install math-verify>=0.8 (it brings latex2sympy2_extended[antlr]).",
        RuntimeWarning,
        stacklevel=2,
    )


# =============================================================================== heavy checks (worker pool)
def _worker_source() -> str:
    return program_source("_math_text.py", "_math_worker.py")


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

    def _send(self, data: bytes, deadline: float) -> bool:
        """Write ``data`` to the worker's stdin by the deadline (a stopped worker never blocks the caller)."""
        assert self.proc is not None and self.proc.stdin is not None
        fd = self.proc.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _, w, _ = select.select([], [fd], [], remaining)
            if not w:
                return False
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                return False
        return True

    def compare(self, pred: str, gold: str, timeout: float, final_form: bool = False) -> tuple[bool, str]:
        """Send two answers as written; the worker cleans them up and compares them within ``timeout``."""
        backends = self.ensure_ready()
        if backends is None:
            raise OSError("math worker failed to start")
        if backends:
            _check_backends(backends)
        self._next_id += 1
        req = json.dumps({"id": self._next_id, "pred": pred, "gold": gold, "timeout": timeout,
                          "final_form": final_form}) + "\n"
        deadline = time.monotonic() + timeout + _GRACE
        try:
            sent = self._send(req.encode(), deadline)
        except (OSError, ValueError):
            sent = False
        if not sent:
            self.kill()
            return False, "worker-died"
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

    def compare(self, pred: str, gold: str, timeout: float, final_form: bool = False) -> tuple[bool, str]:
        w = self._free.get()
        try:
            return w.compare(pred, gold, timeout, final_form)
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


def _heavy_inline(pred: str, gold: str, timeout: float, final_form: bool) -> bool:
    if threading.current_thread() is not threading.main_thread():
        warn_once(
            logger,
            "inline-thread",
            "dllm_trl math reward: worker processes unavailable and not on the main thread, so the "
            "structural/sympy checks cannot be time-bounded and are SKIPPED (string comparison only).",
        )
    from . import _math_worker

    _check_backends(_math_worker._backends()[1])
    return _math_worker.heavy_equal(pred, gold, timeout, final_form)[0]


def _heavy_equal(pred: str, gold: str, timeout: float, final_form: bool) -> bool:
    if os.environ.get("DLLM_TRL_MATH_INLINE") == "1":
        return _heavy_inline(pred, gold, timeout, final_form)
    pool = _get_pool()
    if not pool.broken:
        try:
            return pool.compare(pred, gold, timeout, final_form)[0]
        except OSError as exc:
            pool.broken = True
            warn_once(logger, "pool",
                      f"dllm_trl math reward: cannot start worker processes ({exc}); running in process.")
    return _heavy_inline(pred, gold, timeout, final_form)


def _check_final_form(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"math reward: {name} must be True or False (got {value!r}); True asks the prediction for a "
                         "final form (no integral, sum, binomial, factorial, mod, ... that the gold does not use)")
    return value


# =============================================================================== public API
def math_answers_equal(pred: Any, gold: Any, timeout: float = DEFAULT_TIMEOUT, final_form: bool = False) -> bool:
    """True when ``pred`` and ``gold`` denote the same answer. Never raises on the answers.

    Cleanup, normalised string equality, then the structural / sympy comparison, all in a worker process
    whose answer is awaited at most ``timeout + 1`` seconds (see the module docstring). ``final_form=True``: the
    prediction may not ask for a computation the gold does not (``\\int_0^1 x^2 dx``, ``\\binom{10}{3}``, ``10!``
    against ``120``... score 0); by default a value-equal answer is equal however it is written (``docs/rewards.md``).
    """
    final_form = _check_final_form(final_form, "final_form")
    try:
        if pred is None or gold is None:
            return False
        p, g = str(pred), str(gold)
        if not p.strip() or not g.strip() or len(p) > _MAX_RAW_CHARS or len(g) > _MAX_RAW_CHARS:
            return False
        return bool(_heavy_equal(p, g, float(timeout), final_form))
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


def _score_one(completion: Any, gold: Any, timeout: float, final_form: bool) -> float:
    try:
        pred = extract_boxed_answer(completion_to_text(completion))
        if pred is None:
            return 0.0
        g = extract_gold_answer(gold)
        if g is None:
            return 0.0
        return 1.0 if math_answers_equal(pred, g, timeout=timeout, final_form=final_form) else 0.0
    except Exception:  # pragma: no cover - defensive
        return 0.0


def _score_batch(completions: Sequence[Any], golds: Sequence[Any], timeout: float, num_threads: int | None,
                 final_form: bool = False) -> list[float]:
    n = len(completions)
    if n == 0:
        return []
    threads = num_threads or _default_workers()
    if n == 1 or threads <= 1:
        return [_score_one(c, g, timeout, final_form) for c, g in zip(completions, golds)]
    with ThreadPoolExecutor(max_workers=min(threads, n)) as ex:
        return list(ex.map(lambda cg: _score_one(cg[0], cg[1], timeout, final_form), zip(completions, golds)))


def math_reward(completions: Sequence[Any], answer: Sequence[Any] | Any, **kwargs: Any) -> list[float]:
    r"""TRL reward function: 1.0 when the last ``\boxed{}`` of a completion equals the answer, else 0.0.

    Args:
        completions: list of strings, or (conversational data) list of message lists
            ``[{"role": "assistant", "content": "..."}]`` — the last assistant message is used.
        answer: the dataset's ``answer`` column (TRL passes every dataset column as a keyword
            argument, repeated per generation). Each entry may be a bare answer (``"\frac12"``), a
            solution containing ``\boxed{}`` (MATH) or a GSM8K ``"... #### 42"`` string.
        **kwargs: ``prompts``, ``completion_ids`` and the other dataset columns are ignored;
            ``math_timeout`` (seconds per comparison) and ``math_final_form`` (bool, default False: see
            :func:`math_answers_equal`) are honoured.

    For datasets whose ground-truth column has another name (``solution``, ``ground_truth``...),
    use :func:`make_math_reward(answer_key=...)`. A completion without a box scores 0.0.
    """
    n = len(completions)
    timeout = float(kwargs.get("math_timeout", DEFAULT_TIMEOUT))
    final_form = _check_final_form(kwargs.get("math_final_form", False), "math_final_form")
    golds = _broadcast(answer, n, "answer")
    return _score_batch(list(completions), golds, timeout, None, final_form)


def make_math_reward(
    answer_key: str = "answer",
    timeout: float = DEFAULT_TIMEOUT,
    num_threads: int | None = None,
    name: str | None = None,
    final_form: bool = False,
) -> Callable[..., list[float]]:
    """Factory: a TRL reward function reading the ground truth from column ``answer_key``
    (e.g. ``"solution"`` for MATH, ``"ground_truth"``). The returned function's ``__name__`` is
    ``name`` (default ``"math_reward"`` / ``"math_reward_<key>"``), which TRL uses for logging.
    ``final_form=True`` asks each prediction for a final form (see :func:`math_answers_equal`)."""
    final_form = _check_final_form(final_form, "final_form")

    def reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        if answer_key not in kwargs:
            raise KeyError(f"math reward: dataset column '{answer_key}' was not passed to the reward function")
        golds = _broadcast(kwargs[answer_key], len(completions), answer_key)
        return _score_batch(list(completions), golds, timeout, num_threads, final_form)

    reward.__name__ = name or ("math_reward" if answer_key == "answer" else f"math_reward_{answer_key}")
    reward.__qualname__ = reward.__name__
    return reward
