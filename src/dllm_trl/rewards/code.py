r"""Code reward: the last ```` ```python ```` block of a completion, run against unit tests in an
isolated process; reward = passed / total. What is supported and what is not: ``docs/rewards.md``.

Architecture (three processes per completion)
----------------------------------------------
* **caller** (the trainer): builds a job, starts a *judge* (``python -I -S``, empty environment,
  own session; judge and executor arrive as bytecode compiled once here, see
  :func:`~dllm_trl.rewards._processes.program_bytecode`) and reads its report line by line. Before each test the judge says until when the
  test may run; a judge still on that test a second past it (stuck in C code on a value the
  candidate returned, e.g. ``sum(range(10**18))``, which no alarm can interrupt) is SIGKILLed with
  its process group and every process of the completion's sandbox uid, the test fails, and a
  fresh judge runs the remaining tests. An overall hard limit (``total_timeout + 2 *
  boot_timeout + 5`` s) bounds everything else. The scratch folder is removed afterwards. All
  completions of a batch are evaluated at once (:attr:`SandboxConfig.workers`), so a hostile one
  costs its own budget, never a slot its neighbours wait for.
* **judge** (trusted, stdlib only, ``_sandbox_judge.py``): runs the *tests* and decides pass/fail.
* **executor** (untrusted, ``_sandbox_executor.py``): runs the *candidate program*, in the sandbox.
  The tests see the candidate's objects as proxies: arguments and results cross the process
  boundary as data (tagged JSON, ``_sandbox_codec.py``: builtin values, ``Fraction``, ``Decimal``,
  dates, ``Counter``, slices, namedtuples, dataclass records); other objects (instances, classes,
  closures, iterators) stay in the executor and are used through handles (calls, attributes,
  ``len``, iteration item by item, indexing and item assignment, ``str`` / ``repr``, ``float`` /
  ``int``, ``with``, ``isinstance``; ``x in obj`` is ``x`` among the object's items, compared in the
  judge); callables the tests pass in are called back in the judge; in-place changes to the tests'
  arguments are written back, nested ones included. Every assertion / comparison is evaluated in
  the judge on values of trusted types.
* **trust boundary**: what the judge knows about the program (is a name a class statement, a class
  it models, a stdlib import; what a test's call of a class gives) comes from the program's AST, read
  in the judge, and from the judge's own records of its requests; the executor's replies are only
  the program's answers to the test's requests, never facts the judge's rules rely on (see
  ``docs/rewards.md``, "Where the judge's knowledge comes from").

Guarantees when the trainer runs as **root** on Linux with namespaces available (checked by
``tests/test_rewards_code.py``; :func:`sandbox_capabilities` reports what holds at run time):

* the pass count cannot be forged: it is computed by the judge, which the executor cannot write to
  (it never inherits the judge's output pipe), signal, ptrace or read (other uid, non-dumpable, no
  /proc); replies are only accepted as data answering a request whose id is random, so exiting
  (``sys.exit``/``os._exit``/``SystemExit``), printing fake markers, writing forged protocol
  messages, patching builtins or the harness inside the executor, or returning an object whose
  ``__eq__`` / ``__bool__`` is always True cannot make a test pass; expected values and test code
  never enter the executor (it only sees the arguments of the calls made to it); the candidate's
  names never replace trusted test-setup names, and a builtin-named definition is used only as the
  function under test (``assert pow(2, 3) == 8`` calls the candidate's ``pow``; in ``assert
  len(f(1)) == 3`` the builtin ``len`` stays); a name the test reads as a standard-library module
  (``math`` in ``math.isclose(...)``) is never the candidate's definition, only the real module;
* time: per-test wall-clock budget (``timeout``, module loading is charged to the first test),
  also for the judge's own work on candidate values (see *caller*), per-completion budget,
  ``RLIMIT_CPU``; writes to a candidate that stopped reading are bounded too; the caller's own
  hard limit kills the judge's process group and all sandbox-uid processes;
* memory ``RLIMIT_AS`` (default 1 GiB); ``RLIMIT_FSIZE`` (16 MiB); scratch tmpfs capped (64 MiB);
  ``RLIMIT_NOFILE``; no core dumps; replies larger than 16 MiB are rejected;
* processes: the executor runs as a fresh, unused uid/gid (random in [2^30, 2^31), or in the
  mapped id range inside a user namespace; never an existing account) with no supplementary groups
  and ``RLIMIT_NPROC=1`` — effective because it is not root (the kernel ignores RLIMIT_NPROC for
  root) — so ``fork`` and thread creation fail with EAGAIN; it cannot signal or ptrace any other
  process (different uid, and seccomp blocks ``kill``/``tgkill``/``ptrace``/...);
  ``PR_SET_NO_NEW_PRIVS`` blocks set-uid binaries; regaining root is impossible;
* filesystem: private mount namespace; the executor is chroot()ed into a tmpfs mounted on the
  scratch folder, containing only read-only bind mounts of the Python stdlib (its
  ``site-packages`` covered by an empty read-only tmpfs: only the standard library is importable),
  /dev/{null,zero,random,urandom} and its private ``/tmp`` (working directory, shared by the tests
  of one completion); nothing else is visible, so nothing outside can be read, written or deleted;
  the scratch folder is removed afterwards;
* secrets: judge and executor start with an empty environment; ``/proc`` is not mounted in the
  chroot; other processes' memory/environ are unreadable (other uid);
* network: private (empty) network namespace, and seccomp rejects ``socket()`` of every family.

Not guaranteed: protection against kernel exploits (the sandbox shares the host kernel; seccomp is
a deny-list, not an allow-list); CPU/cache contention between concurrent sandboxes (budgets are
wall-clock); semantic reward hacking such as hard-coding the outputs for tests shown in the
prompt. The judge itself runs the dataset's test code as the caller's user (root here), inside its
own mount/network namespace.

Degraded modes (reported by :func:`sandbox_capabilities`): root without CAP_SYS_ADMIN (e.g.
Docker's default) → no mount/network namespace, no chroot: the executor runs in a 0700 scratch
folder as the sandbox uid, so it can read world-readable files (third-party packages included)
and write to world-writable places (/tmp, /dev/shm); ``socket()`` stays blocked by seccomp (no
network, no unix-socket connections); only the stdlib modules pre-imported before the privilege
drop are importable when the interpreter lives in an unreadable directory (as under /root here).
Not root → no uid change: RLIMIT_NPROC still blocks fork (the user already owns processes),
seccomp still blocks kill/ptrace/sockets, but every file writable by the user is writable by the
candidate (this mode is not exercised by the tests).

Semantics and limitations (each tested in ``tests/code_program_table.py``, listed in
``docs/rewards.md``): equality of a candidate object that is not data is identity (a class with its
own ``__eq__`` compared with a fresh instance fails; dataclasses compare by their fields); a test's
call of a class of the program that the judge models from the source (a plain dataclass, a
namedtuple, a builtin subclass without its own constructor) is evaluated in the judge from the
test's arguments, and the program never sees it; a call of any other class statement of the program
gives the program's object as a handle, equal only to itself and never the program's answer before
the test hands it over (a discarding constructor, a shared instance or a registry cannot make the
program's answer equal to it); any other name is the program answering, as in plain Python; ``x in obj`` is membership
among the object's items (never its ``__contains__``); truth-testing such an object raises,
operators (``+``, ``<``) on it are not forwarded, ``with obj:`` never suppresses the test's
exception; subclasses of builtins arrive as their base; objects the *tests* build from their own
classes cannot be passed in; the candidate cannot use threads or subprocesses; stdout/stdin are
/dev/null; the candidate module runs as ``__candidate__`` (its ``if __name__ == "__main__":`` block
does not run).
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ._processes import BYTECODE_LOADER, kill_process_group, program_bytecode, program_source, start_isolated, warn_once, workers_from_env
from .math import completion_to_text

logger = logging.getLogger(__name__)

__all__ = [
    "extract_python_block",
    "code_reward",
    "make_code_reward",
    "run_code_tests",
    "CodeTestResult",
    "SandboxConfig",
    "sandbox_capabilities",
]

MAX_CONCURRENT = 64  # most completions evaluated at once by default

PRELOAD_MODULES = [
    "math", "cmath", "re", "string", "collections", "itertools", "functools", "heapq", "bisect",
    "operator", "copy", "fractions", "decimal", "statistics", "typing", "numbers", "datetime",
    "random", "array", "hashlib", "json", "textwrap", "unicodedata", "struct", "calendar",
    "dataclasses", "enum", "time", "abc", "collections.abc", "contextlib", "types", "weakref",
]

PRELOAD_MODULES_MIN = ["math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string", "typing", "operator", "copy", "types"]


# =============================================================================== extraction
_PY_LANGS = {"python", "py", "python3", "py3"}


def extract_python_block(text: str | None) -> str | None:
    """The LAST fenced code block tagged ``python`` (also ``py``, ``python3``, ``py3``; any case).

    Fallback: when no python-tagged block exists, the last *untagged* fenced block (```` ``` ````
    alone); blocks tagged with another language are never used. Fences may be ``` or ~~~ (3+),
    optionally indented; a closing fence glued to the last code line (``return x```) is accepted; a
    final block left unclosed (truncated generation) still counts. Returns ``None`` when there is
    no usable block.
    """
    if not isinstance(text, str) or "```" not in text and "~~~" not in text:
        return None
    blocks: list[tuple[str, str]] = []
    lines = text.split("\n")
    inside = False
    fence = ""
    lang = ""
    buf: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not inside:
            if stripped.startswith("```") or stripped.startswith("~~~"):
                ch = stripped[0]
                n = len(stripped) - len(stripped.lstrip(ch))
                fence = ch * n
                info = stripped[n:].strip()
                if ch in info:  # ```inline``` on one line: not a block opener
                    continue
                lang = info.split()[0].lower() if info else ""
                lang = lang.lstrip("{.").rstrip("}")
                inside, buf = True, []
            continue
        if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            blocks.append((lang, "\n".join(buf)))
            inside = False
            continue
        if stripped.endswith(fence) and len(stripped) > len(fence):
            buf.append(line.rstrip()[: -len(fence)])
            blocks.append((lang, "\n".join(buf)))
            inside = False
            continue
        buf.append(line)
    if inside:
        blocks.append((lang, "\n".join(buf)))
    for want in (lambda l: l in _PY_LANGS, lambda l: l == ""):
        for lg, code in reversed(blocks):
            if want(lg) and code.strip():
                return code.rstrip("\n")
    return None


# =============================================================================== configuration
@dataclass
class SandboxConfig:
    """Limits of one completion's evaluation.

    timeout: wall-clock seconds per test (module loading is charged to the first test);
    total_timeout: seconds per completion (default ``timeout * n_tests``, capped by
    ``max_total_timeout``); memory_mb: RLIMIT_AS of the executor; file_size_mb: RLIMIT_FSIZE;
    scratch_mb: size of the scratch tmpfs; nofile: RLIMIT_NOFILE; max_procs: RLIMIT_NPROC (1 = no
    fork, no threads); namespaces / seccomp: ``"auto"`` (use when available), ``"require"``
    (infrastructure error when unavailable) or ``"off"``; workers: completions evaluated at once
    (default ``DLLM_TRL_CODE_WORKERS``, else as many as fit in 3/4 of the RAM at ``memory_mb``
    each, at most ``MAX_CONCURRENT``);
    boot_timeout: allowance for interpreter start-up (not charged to the candidate).
    """

    timeout: float = 5.0
    total_timeout: float | None = None
    max_total_timeout: float = 30.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    scratch_mb: int = 64
    nofile: int = 64
    max_procs: int = 1
    namespaces: str = "auto"
    seccomp: str = "auto"
    workers: int | None = None
    boot_timeout: float = 30.0
    max_message_mb: int = 16
    scratch_root: str | None = None
    python: str | None = None

    def n_workers(self) -> int:
        if self.workers:
            return max(1, int(self.workers))
        from_env = workers_from_env("DLLM_TRL_CODE_WORKERS")
        if from_env:
            return from_env
        # as many sandboxes as fit in 3/4 of the RAM if each used its whole memory_mb, at most 64
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = 8 << 30
        return max(1, min(MAX_CONCURRENT, int(0.75 * ram) // (max(1, self.memory_mb) << 20)))


@dataclass
class CodeTestResult:
    passed: int
    total: int
    tests: list[dict] = field(default_factory=list)
    error: str | None = None  # infrastructure error (not the candidate's fault)
    isolation: dict | None = None

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total > 0 else 0.0


# =============================================================================== sources
_JUDGE_FILES = ("_processes.py", "_sandbox_codec.py", "_sandbox_judge.py")
_EXECUTOR_FILES = ("_processes.py", "_sandbox_codec.py", "_sandbox_executor.py")


def _judge_src() -> str:
    return program_source(*_JUDGE_FILES)


def _executor_src() -> str:
    return program_source(*_EXECUTOR_FILES)


def _same_interpreter(python: str) -> bool:
    """Whether ``python`` is this interpreter (then judge and executor get bytecode compiled here)."""
    return python == sys.executable


# =============================================================================== running one completion
def _executor_program(python: str) -> dict:
    """How the judge starts the executor: bytecode compiled here (base64, framed) when it runs this
    interpreter, else the source."""
    if _same_interpreter(python):
        import base64

        return {"bytecode": base64.b64encode(program_bytecode(*_EXECUTOR_FILES)).decode("ascii"), "loader": BYTECODE_LOADER}
    return {"source": _executor_src()}


_UID_LOCK = threading.Lock()
_UIDS_IN_USE: set[int] = set()
_RNG = random.SystemRandom()


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    """[start, stop) id ranges usable in this user namespace (from /proc/self/{uid,gid}_map)."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 3:
                    start, count = int(parts[0]), int(parts[2])
                    out.append((start, start + count))
    except (OSError, ValueError):
        out = [(0, 1 << 32)]
    return out or [(0, 1 << 32)]


_SANDBOX_ID_RANGE: tuple[int, int] | None = None


def _sandbox_id_range() -> tuple[int, int]:
    """Ids for sandbox uids/gids: [2^30, 2^31) when mapped (the normal case), else (inside a user
    namespace with a small map, e.g. rootless containers) the upper part of the largest range that
    both the uid and the gid maps allow, above the usual system/user ids."""
    global _SANDBOX_ID_RANGE
    if _SANDBOX_ID_RANGE is None:
        best = (1 << 30, (1 << 31) - 2)
        spans = []
        for us, ue in _mapped_ranges("/proc/self/uid_map"):
            for gs, ge in _mapped_ranges("/proc/self/gid_map"):
                lo, hi = max(us, gs), min(ue, ge)
                if hi > lo:
                    spans.append((lo, hi))
        if not any(lo <= best[0] and best[1] <= hi for lo, hi in spans) and spans:
            lo, hi = max(spans, key=lambda r: r[1] - r[0])
            lo = max(lo, min(hi - 16, 40000))
            best = (lo, max(lo + 1, hi - 2))  # keep away from 65534/65535 (nobody / overflow id)
        _SANDBOX_ID_RANGE = best
    return _SANDBOX_ID_RANGE


def _id_exists(uid: int) -> bool:
    """A real account or group uses this id (then it is never used for a sandbox, so that the
    leftover sweep ``_kill_uid`` can never hit a real user's processes)."""
    import grp
    import pwd

    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except (KeyError, OverflowError):
            pass
    return False


def _alloc_uid() -> int | None:
    """A fresh sandbox uid (also used as gid), unused by any live sandbox of this process."""
    if os.geteuid() != 0:
        return None
    lo, hi = _sandbox_id_range()
    with _UID_LOCK:
        for _ in range(1000):
            uid = _RNG.randrange(lo, hi)
            if uid in _UIDS_IN_USE or uid in (0, 65534, 65535) or _id_exists(uid):
                continue
            _UIDS_IN_USE.add(uid)
            return uid
    raise RuntimeError("no free sandbox uid")


def _free_uid(uid: int | None) -> None:
    if uid is None:
        return
    with _UID_LOCK:
        _UIDS_IN_USE.discard(uid)


def _kill_uid(uid: int | None) -> int:
    """SIGKILL every process whose real uid is ``uid`` (sandbox leftovers). Returns the count."""
    if uid is None:
        return 0
    killed = 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(pid), signal.SIGKILL)
                            killed += 1
                        break
        except (OSError, ValueError, IndexError):
            continue
    return killed


def run_code_tests(
    program: str,
    tests: Sequence[str] | str | None = None,
    *,
    test: str | None = None,
    entry_point: str | None = None,
    test_setup_code: str | None = None,
    test_imports: Sequence[str] | None = None,
    config: SandboxConfig | None = None,
) -> CodeTestResult:
    """Run ``program`` (untrusted source) against unit tests in the sandbox.

    Either ``tests``: a list of statements (MBPP ``test_list``: ``"assert f(1) == 2"``), each one
    test; or a single string of test code, whose top-level ``assert`` statements are the tests and
    other top-level statements are shared setup. Or ``test`` + ``entry_point`` (HumanEval): ``test``
    defines ``check(candidate)``, called once with the candidate's ``entry_point`` (one test).
    ``test_setup_code`` / ``test_imports``: trusted code executed in the judge before the tests
    (e.g. helpers such as HumanEval's ``encode_cyclic``).
    """
    cfg = config or SandboxConfig()
    setup_parts: list[str] = []
    if test_imports:
        setup_parts.extend(str(x) for x in test_imports)
    if test_setup_code:
        setup_parts.append(str(test_setup_code))
    sequential = False
    if entry_point and test:
        mode, test_list, n = "check", [], 1
    else:
        mode = "asserts"
        test_list, extra_setup, sequential = _split_tests(tests)
        if extra_setup:
            setup_parts.append(extra_setup)
        n = len(test_list)
    if n == 0:
        return CodeTestResult(0, 0, error="no tests")
    if not isinstance(program, str) or not program.strip():
        return CodeTestResult(0, n, tests=[{"i": i, "passed": False, "err": "no program"} for i in range(n)])
    total = cfg.total_timeout if cfg.total_timeout is not None else min(cfg.timeout * n, cfg.max_total_timeout)
    total = max(total, cfg.timeout)
    uid = _alloc_uid()
    scratch = tempfile.mkdtemp(prefix="dllm_code_", dir=cfg.scratch_root)
    job = {
        "program": program,
        "mode": mode,
        "tests": test_list,
        "sequential": sequential,
        "check": test or "",
        "entry_point": entry_point or "",
        "setup": "\n".join(setup_parts),
        "executor": _executor_program(cfg.python or sys.executable),
        "python": cfg.python or sys.executable,
        "uid": uid,
        "gid": uid,
        "scratch": scratch,
        "limits": {
            "cpu_s": int(total) + 2,
            "as_bytes": int(cfg.memory_mb) << 20,
            "fsize_bytes": int(cfg.file_size_mb) << 20,
            "tmpfs_bytes": int(cfg.scratch_mb) << 20,
            "nofile": int(cfg.nofile),
            "nproc": int(cfg.max_procs),
        },
        "namespaces": cfg.namespaces,
        "seccomp": cfg.seccomp,
        "preload": PRELOAD_MODULES,
        "preload_min": PRELOAD_MODULES_MIN,
        "timeout": float(cfg.timeout),
        "total_timeout": float(total),
        "boot_timeout": float(cfg.boot_timeout),
        "max_message_bytes": int(cfg.max_message_mb) << 20,
        "judge_as_bytes": max(2 << 30, 3 * (int(cfg.memory_mb) << 20)),
    }
    results: dict[int, dict] = {}
    error: str | None = None
    iso: dict | None = None
    start = time.monotonic()
    hard_deadline = start + total + cfg.boot_timeout * 2 + 5.0
    first = 0
    try:
        while first < n:
            job["first_test"] = first
            job["total_timeout"] = max(0.0, total - (time.monotonic() - start))
            seg_error, seg_iso, stalled = _run_judge(job, n, results, hard_deadline)
            iso = iso or seg_iso
            if stalled is None:
                error = seg_error
                break
            # the judge was stuck on test `stalled` (C-level work on a candidate's value the alarm
            # cannot interrupt): it was killed; that test fails, the remaining ones get a new judge
            results[stalled] = {"i": stalled, "passed": False, "err": "timeout (the test's work on the candidate's value)"}
            _kill_uid(uid)
            first = stalled + 1
            if time.monotonic() - start >= total:
                break
    finally:
        _kill_uid(uid)
        _free_uid(uid)
        shutil.rmtree(scratch, ignore_errors=True)
    tests_out = [results.get(i, {"i": i, "passed": False, "err": "not run"}) for i in range(n)]
    passed = sum(1 for r in tests_out if r.get("passed") is True)
    if error is not None:
        warn_once(logger, "infra:" + error[:60], f"dllm_trl code reward: sandbox infrastructure error: {error}")
    return CodeTestResult(passed, n, tests=tests_out, error=error, isolation=iso)


_KILL_GRACE = 1.0  # seconds past a test's watched deadline before a stuck judge is killed


def _run_judge(job: dict, n: int, results: dict[int, dict], hard_deadline: float) -> tuple[str | None, dict | None, int | None]:
    """One judge process, from ``job["first_test"]`` on. Fills ``results``; returns (infrastructure
    error, isolation report, index of the test the judge was killed on or None)."""
    error: str | None = None
    iso: dict | None = None
    watched: tuple[int, float] | None = None
    try:
        bytecode = _same_interpreter(job["python"])
        program = BYTECODE_LOADER if bytecode else _judge_src()
        proc = start_isolated([job["python"], "-I", "-S", "-c", program], {}, stderr=subprocess.PIPE)
    except OSError as exc:
        return f"cannot start judge: {exc}", None, None
    try:
        try:
            if bytecode:
                proc.stdin.write(program_bytecode(*_JUDGE_FILES))
            proc.stdin.write(json.dumps(job).encode("utf-8"))
            proc.stdin.close()
        except OSError:
            pass
        fd = proc.stdout.fileno()
        buf = b""
        eof = False
        while not eof:
            limit = hard_deadline
            if watched is not None and watched[0] not in results:
                limit = min(limit, watched[1] + _KILL_GRACE)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                kill_process_group(proc)
                if watched is not None and watched[0] not in results and limit < hard_deadline:
                    return None, iso, watched[0]
                return "judge exceeded the hard time limit", iso, None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            eof = not chunk
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line.decode("utf-8", "replace"))
                except ValueError:
                    continue
                k = msg.get("k")
                if k == "test" and isinstance(msg.get("i"), int) and 0 <= msg["i"] < n:
                    results[msg["i"]] = msg
                elif k == "watch" and isinstance(msg.get("i"), int) and isinstance(msg.get("until"), (int, float)):
                    watched = (msg["i"], float(msg["until"]))
                elif k == "iso":
                    iso = msg
                elif k == "infra":
                    error = str(msg.get("e"))
        try:
            proc.wait(timeout=max(0.1, hard_deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_process_group(proc)
        if proc.returncode not in (0, None) and error is None and len(results) < n:
            err = proc.stderr.read() if proc.stderr is not None else b""
            error = f"judge exited with {proc.returncode}: {err.decode('utf-8', 'replace')[-500:]}"
        return error, iso, None
    finally:
        kill_process_group(proc, wait=5)


def _split_tests(tests: Sequence[str] | str | None) -> tuple[list[str], str, bool]:
    """``tests`` → (list of test sources, shared setup source, whether the tests run in order in one
    namespace). A string of test code: each top-level ``assert`` is a test; the statements before the
    first one that calls something (imports, definitions, constants) are trusted setup; from that one
    on (``result = rle('aaab')``) every other statement runs with the next assert, in order, where
    the program's names exist."""
    if tests is None:
        return [], "", False
    if isinstance(tests, str):
        import ast

        try:
            tree = ast.parse(tests)
        except SyntaxError:
            return [tests], "", False
        asserts, setup, pending = [], [], []
        for node in tree.body:
            src = ast.get_source_segment(tests, node) or ast.unparse(node)
            if isinstance(node, ast.Assert):
                asserts.append("\n".join(pending + [src]))
                pending = []
            elif pending or asserts or _runs_code(node):
                pending.append(src)
            else:
                setup.append(src)
        if not asserts:
            return [tests], "", False
        if pending:
            asserts[-1] += "\n" + "\n".join(pending)
        return asserts, "\n".join(setup), True
    return [str(t) for t in tests], "", False


def _runs_code(node: Any) -> bool:
    """A statement of test code that calls something when run (definitions and imports do not)."""
    import ast

    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    return any(isinstance(n, ast.Call) for n in ast.walk(node))


# =============================================================================== capabilities
_CAPS: dict | None = None


def sandbox_capabilities(config: SandboxConfig | None = None) -> dict:
    """Run a trivial job and report what the sandbox enforces here (cached)::

        {"fs": "chroot"|"chdir", "uid_drop": bool, "netns": bool, "mountns": bool,
         "seccomp": "on"|..., "rlimits": {...}, "root": bool (the caller)}
    """
    global _CAPS
    if _CAPS is not None and config is None:
        return _CAPS
    res = run_code_tests("def f():\n    return 1\n", ["assert f() == 1"], config=config)
    iso = res.isolation or {}
    ex = iso.get("executor") or {}
    fs = iso.get("fs") or {}
    caps = {
        "ok": res.passed == 1,
        "error": res.error,
        "root": os.geteuid() == 0,
        "fs": ex.get("fs"),
        "uid_drop": bool(os.geteuid() == 0 and ex.get("uid") not in (None, 0) and not ex.get("root")),
        "mountns": bool(fs.get("mountns")),
        "netns": bool(fs.get("netns")),
        "tmpfs": bool(fs.get("tmpfs")),
        "seccomp": ex.get("seccomp"),
        "no_new_privs": bool(ex.get("no_new_privs")),
        "rlimits": ex.get("rlimits"),
    }
    if config is None:
        _CAPS = caps
    return caps


# =============================================================================== TRL reward
def _score(args: tuple[Any, dict, SandboxConfig]) -> float:
    completion, row, cfg = args
    try:
        code = extract_python_block(completion_to_text(completion))
        if code is None:
            return 0.0
        prefix = row.get("code_prefix")
        if prefix:
            code = str(prefix) + "\n" + code
        entry = row.get("entry_point")
        test = row.get("test")
        tests = row.get("tests")
        setup = row.get("test_setup_code")
        if entry and test and prefix and not setup:
            setup = prefix  # trusted helpers of the prompt (HumanEval) are available to check()
        if tests is None and not (entry and test):
            tests = test
        res = run_code_tests(
            code,
            tests,
            test=test if entry else None,
            entry_point=entry,
            test_setup_code=setup,
            test_imports=row.get("test_imports"),
            config=cfg,
        )
        if res.error == "no tests":
            warn_once(logger, "no-tests", "dllm_trl code reward: a row has no tests (columns tests/test_list or test+entry_point); it scores 0.")
        return res.reward
    except Exception as exc:  # pragma: no cover - defensive
        warn_once(logger, "score", f"dllm_trl code reward: unexpected error {exc!r}")
        return 0.0


def _column(values: Any, n: int, name: str) -> list:
    """A dataset column → one entry per completion: a list of ``n`` entries (what TRL passes), or
    one string shared by every completion (direct calls)."""
    if values is None:
        return [None] * n
    if isinstance(values, str):
        return [values] * n
    if isinstance(values, (list, tuple)) and len(values) == n:
        return list(values)
    count = len(values) if hasattr(values, "__len__") else "?"
    raise ValueError(f"code reward: column '{name}' has {count} entries for {n} completions; pass one entry per completion")


def _single_assert(src: Any) -> bool:
    import ast

    try:
        body = ast.parse(src).body
    except (SyntaxError, ValueError):
        return False
    return len(body) == 1 and isinstance(body[0], ast.Assert)


def _tests_column(values: Any, n: int, name: str) -> list:
    """The ``tests`` / ``test_list`` column: per completion, a list of assert statements or one
    string of test code. A flat list of assert strings is refused: whether it is one test list
    shared by all completions or one test per completion would depend on the batch size."""
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, str) for v in values) and n > 1:
        if len(values) != n or all(_single_assert(v) for v in values):
            raise ValueError(
                f"code reward: column '{name}' is a flat list of {len(values)} assert strings for {n} completions, "
                f"which could mean one shared test list or one test per completion. Pass one list per completion: "
                f"{name}=[tests] * {n} to share the same asserts, or {name}=[[assert_1], [assert_2], ...]."
            )
    return _column(values, n, name)


def _rows(n: int, tests: Any, kwargs: dict) -> list[dict]:
    cols = {
        "tests": _tests_column(tests if tests is not None else kwargs.get("test_list"), n, "tests" if tests is not None else "test_list"),
        "test": _column(kwargs.get("test"), n, "test"),
        "entry_point": _column(kwargs.get("entry_point"), n, "entry_point"),
        "test_setup_code": _column(kwargs.get("test_setup_code"), n, "test_setup_code"),
        "code_prefix": _column(kwargs.get("code_prefix"), n, "code_prefix"),
    }
    imports = kwargs.get("test_imports")
    if imports is None or (isinstance(imports, (list, tuple)) and len(imports) == n and all(
        isinstance(x, (list, tuple)) or x is None for x in imports
    )):
        cols["test_imports"] = list(imports) if imports is not None else [None] * n
    else:
        cols["test_imports"] = [imports] * n
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def _evaluate_batch(completions: Sequence[Any], rows: list[dict], cfg: SandboxConfig) -> list[float]:
    jobs = [(c, r, cfg) for c, r in zip(completions, rows)]
    if not jobs:
        return []
    # every completion of the batch runs at once (up to ``n_workers``), each with its own deadlines:
    # a candidate that sleeps or spins costs its own budget, not a slot its neighbours wait for
    workers = min(cfg.n_workers(), len(jobs))
    if workers <= 1:
        return [_score(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(_score, jobs))


def code_reward(completions: Sequence[Any], tests: Any = None, **kwargs: Any) -> list[float]:
    """TRL reward function: fraction of unit tests passed by the last ```python block.

    Column conventions (TRL passes dataset columns as keyword arguments, one entry per completion):

    * ``tests`` (or MBPP's ``test_list``): a list of assert statements per row, e.g.
      ``["assert add(1, 2) == 3", ...]`` — each statement is one test; or a string of test code
      whose top-level ``assert`` statements are the tests. For direct calls, one test list shared
      by ``n`` completions is written ``tests=[asserts] * n``; a flat list of assert strings is
      refused with a ``ValueError`` (shared list or one test per completion? the answer would
      depend on the batch size); one string of test code is shared by every completion;
    * ``test`` + ``entry_point`` (HumanEval): ``test`` defines ``check(candidate)``; one test;
    * optional ``test_setup_code`` (str) / ``test_imports`` (list[str]): trusted code run before
      the tests, in the judge (never in the sandbox);
    * optional ``code_prefix`` (str): prepended to the extracted program (e.g. a HumanEval prompt
      for completion-style models); in HumanEval mode it also serves as trusted test setup.

    A completion without a python block scores 0.0. ``prompts``, ``completion_ids`` etc. are
    ignored. Limits: :class:`SandboxConfig` defaults; use :func:`make_code_reward` to change them.
    """
    cfg = kwargs.pop("sandbox_config", None) or SandboxConfig()
    n = len(completions)
    rows = _rows(n, tests, kwargs)
    return _evaluate_batch(list(completions), rows, cfg)


def make_code_reward(config: SandboxConfig | None = None, name: str = "code_reward", **overrides: Any) -> Callable[..., list[float]]:
    """Factory: a TRL reward function with custom sandbox limits, e.g.
    ``make_code_reward(timeout=2.0, memory_mb=512, workers=4)``."""
    cfg = config or SandboxConfig()
    if overrides:
        cfg = SandboxConfig(**{**cfg.__dict__, **overrides})

    def reward(completions: Sequence[Any], tests: Any = None, **kwargs: Any) -> list[float]:
        kwargs.pop("sandbox_config", None)
        return code_reward(completions, tests, sandbox_config=cfg, **kwargs)

    reward.__name__ = name
    reward.__qualname__ = name
    return reward
