"""Process plumbing of the rewards: isolated worker processes, their process groups, one-time warnings.

Every rewards module goes through here: :mod:`dllm_trl.rewards.math` (its pool of sympy workers),
:mod:`dllm_trl.rewards.code` (one judge per completion) and the judge itself (one executor per candidate).

Standalone as well (stdlib only, no package imports, nothing that must come first in a file): the code reward
prepends this file's source to the judge and executor programs it runs with ``python -I -S -c``, as it does
``_sandbox_codec.py``. Modules those programs need only in some functions are imported inside them.

* :func:`start_isolated`: a worker process in a session (and process group) of its own, working directory ``/``,
  no inherited descriptors besides its three standard streams;
* :func:`kill_process_group`: SIGKILL such a worker with everything it started in its group, optionally reap it;
* :func:`quiet_stdio` (worker side): move the channel off the standard descriptors and point 0/1/2 at
  /dev/null, so nothing a library or a candidate prints can reach the channel;
* :func:`program_source`: the text of sibling files, joined, for ``python -c``;
* :func:`program_bytecode` / :data:`BYTECODE_LOADER`: the same program compiled once by the caller and
  handed to a child of the same interpreter on its stdin (``python -c BYTECODE_LOADER``), so that no
  child compiles the judge or executor again (that was about a third of a completion's CPU time);
* :func:`warn_once`: a warning (and a logged error) the first time a given problem occurs in this process;
* :func:`workers_from_env`: a worker count set in the environment.
"""

import os
import signal
import sys
import threading


def start_isolated(argv, env, stderr=None):
    """Start ``argv`` in a new session, cwd ``/``, only fds 0-2 inherited; stdin and stdout are pipes.

    ``env``: the complete environment (``{}`` for none). ``stderr``: ``subprocess.PIPE``, or None for
    ``/dev/null``. The child leads its own process group, so :func:`kill_process_group` reaches whatever it starts
    there too, and signals sent to the caller's group (Ctrl-C) do not reach it.
    """
    import subprocess

    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if stderr is None else stderr,
        env=env,
        cwd="/",
        close_fds=True,
        start_new_session=True,
    )


def kill_process_group(proc, wait=None):
    """SIGKILL the process group that ``proc`` (a :func:`start_isolated` child) leads, and ``proc``.

    The group is only signalled while ``proc`` has not been reaped: its id is ``proc``'s pid, which the system may
    hand to another process once reaped. With ``wait`` (seconds), ``proc`` is then reaped (waiting at most that
    long) and its pipes are closed. Never raises.
    """
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.kill()
    except OSError:
        pass
    if wait is None:
        return
    try:
        proc.wait(timeout=wait)
    except Exception:  # subprocess.TimeoutExpired: left to the kernel, already killed
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except Exception:  # a flush into a dead or full pipe
                pass


def quiet_stdio(*channel_fds):
    """Worker side: duplicate ``channel_fds`` (the descriptors the parent talks over, e.g. 0 and 1) to fresh
    descriptors, then point 0, 1 and 2 at /dev/null and ``sys.stdout`` / ``sys.stderr`` at a /dev/null file.
    Returns the fresh descriptors, in the order given."""
    private = [os.dup(fd) for fd in channel_fds]
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    return private


_SOURCES = {}


def program_source(*names):
    """The source of the files ``names`` of this folder, joined by blank lines, for ``python -c`` (cached)."""
    parts = []
    for name in names:
        if name not in _SOURCES:
            with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), encoding="utf-8") as fh:
                _SOURCES[name] = fh.read()
        parts.append(_SOURCES[name])
    return "\n\n".join(parts)


# run as ``python -c``: reads a 4-byte big-endian length and that many bytes of marshalled code from
# fd 0, unbuffered (what follows on fd 0 stays for the program), and runs it as __main__
BYTECODE_LOADER = (
    "import marshal, os\n"
    "def _read_stdin(n):\n"
    "    data = b''\n"
    "    while len(data) < n:\n"
    "        chunk = os.read(0, n - len(data))\n"
    "        if not chunk:\n"
    "            raise SystemExit(3)\n"
    "        data += chunk\n"
    "    return data\n"
    "exec(marshal.loads(_read_stdin(int.from_bytes(_read_stdin(4), 'big'))))\n"
)
_BYTECODE = {}


def program_bytecode(*names):
    """:func:`program_source` of ``names`` compiled and marshalled, framed for :data:`BYTECODE_LOADER`
    (cached). Only for a child run by this same interpreter (marshal and bytecode are version-specific)."""
    if names not in _BYTECODE:
        import marshal

        code = compile(program_source(*names), "<%s>" % names[-1], "exec")
        data = marshal.dumps(code)
        _BYTECODE[names] = len(data).to_bytes(4, "big") + data
    return _BYTECODE[names]


_WARNED = set()
_WARNED_LOCK = threading.Lock()


def warn_once(logger, key, message):
    """Log ``message`` as an error and warn (``RuntimeWarning``, at the caller's caller) the first time ``key``
    occurs for ``logger`` in this process; later calls with the same key do nothing. Thread-safe."""
    import warnings

    with _WARNED_LOCK:
        if (logger.name, key) in _WARNED:
            return
        _WARNED.add((logger.name, key))
    logger.error(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def workers_from_env(variable):
    """The worker count the environment variable ``variable`` sets (at least 1), or None when it is unset or not
    an integer."""
    value = os.environ.get(variable)
    if not value:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        return None
