"""rewards/_processes.py: the one place the rewards start, silence and kill worker processes and warn once."""

import logging
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest

from dllm_trl.rewards import _processes
from dllm_trl.rewards._processes import (
    kill_process_group,
    program_source,
    start_isolated,
    warn_once,
    workers_from_env,
)

pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_start_isolated_gives_a_session_of_its_own():
    probe = "import os; print(os.getsid(0), os.getpgid(0), os.getcwd(), sorted(os.listdir('/proc/self/fd')))"
    proc = start_isolated([sys.executable, "-c", probe], {})
    out, _ = proc.communicate(timeout=60)
    sid, pgid, cwd, fds = out.decode().split(" ", 3)
    assert int(sid) == int(pgid) == proc.pid != os.getpgid(0)
    assert cwd == "/"
    assert fds.strip() == "['0', '1', '2', '3']"  # the standard streams (+ the listing's own descriptor)


def test_kill_process_group_reaches_what_the_worker_started():
    child = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
             " print(p.pid, flush=True); time.sleep(300)")
    proc = start_isolated([sys.executable, "-c", child], dict(os.environ))
    grandchild = int(proc.stdout.readline())
    assert _alive(grandchild)
    t0 = time.monotonic()
    kill_process_group(proc, wait=5)
    assert time.monotonic() - t0 < 5
    assert proc.returncode == -9  # SIGKILL, and reaped
    assert proc.stdin.closed and proc.stdout.closed
    assert _gone(grandchild), "the worker's own child survived"


def test_kill_after_reaping_never_signals_the_old_group_id(monkeypatch):
    """Once reaped, the pid (= group id) may belong to someone else: only the Popen object is told to kill."""
    proc = start_isolated([sys.executable, "-c", "pass"], {})
    proc.wait(timeout=60)
    signalled = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append(pgid))
    kill_process_group(proc, wait=1)
    assert signalled == []
    assert proc.stdout.closed


def test_quiet_stdio_keeps_prints_off_the_channel():
    program = program_source("_processes.py") + (
        "\n(channel,) = quiet_stdio(1)\n"
        "print('library noise')\n"
        "import sys; sys.stderr.write('more noise\\n')\n"
        "import os; os.write(1, b'raw noise'); os.write(channel, b'the answer')\n"
    )
    done = subprocess.run([sys.executable, "-I", "-S", "-c", program], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == (b"the answer", b"")


def test_warn_once_per_logger_and_key_from_many_threads(caplog):
    key = f"test-{time.monotonic_ns()}"
    first, second = logging.getLogger("dllm_trl.test.a"), logging.getLogger("dllm_trl.test.b")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.ERROR):
        warnings.simplefilter("always")
        threads = [threading.Thread(target=warn_once, args=(first, key, "broken")) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        warn_once(first, key, "broken")
        warn_once(second, key, "broken elsewhere")  # another module's problem with the same name
    assert [str(w.message) for w in caught] == ["broken", "broken elsewhere"]
    assert all(w.category is RuntimeWarning for w in caught)
    assert [r.getMessage() for r in caplog.records] == ["broken", "broken elsewhere"]


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("3", 3), ("0", 1), ("-2", 1), ("two", None)])
def test_workers_from_env(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("DLLM_TRL_TEST_WORKERS", raising=False)
    else:
        monkeypatch.setenv("DLLM_TRL_TEST_WORKERS", value)
    assert workers_from_env("DLLM_TRL_TEST_WORKERS") == expected


def test_program_source_joins_files_and_runs_standalone():
    source = program_source("_processes.py", "_sandbox_codec.py")
    assert source.startswith('"""' + _processes.__doc__.split("\n")[0])
    done = subprocess.run([sys.executable, "-I", "-S", "-c", source + "\nprint(callable(kill_process_group), "
                           "callable(send_msg))"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True True", done.stderr


def test_bytecode_loader_runs_the_program_and_leaves_the_rest_of_stdin():
    """The judge and executor arrive as bytecode on stdin; what follows the code (the job, the
    executor's first framed message) must stay readable by the program, byte for byte."""
    import marshal

    from dllm_trl.rewards._processes import BYTECODE_LOADER, program_bytecode

    framed = program_bytecode("_processes.py", "_sandbox_codec.py")
    assert int.from_bytes(framed[:4], "big") == len(framed) - 4 and framed is program_bytecode("_processes.py", "_sandbox_codec.py")
    probe = "import os\nos.write(1, repr((callable(send_msg), __name__, os.read(0, 100))).encode())\n"
    program = marshal.dumps(compile(program_source("_processes.py", "_sandbox_codec.py") + "\n" + probe, "p", "exec"))
    done = subprocess.run([sys.executable, "-I", "-S", "-c", BYTECODE_LOADER],
                          input=len(program).to_bytes(4, "big") + program + b"REST", capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == repr((True, "__main__", b"REST")).encode()


def test_math_worker_leaves_no_process_behind():
    from dllm_trl.rewards import math as m

    w = m._Worker(m._worker_source())
    assert w.ensure_ready() is not None
    pid = w.proc.pid
    assert w.compare("2", r"\frac{4}{2}", timeout=5) == (True, "sympy")
    w.kill()
    assert w.proc is None and _gone(pid)
