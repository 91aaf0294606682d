"""Judge: runs the TRUSTED unit tests of one completion and decides pass/fail.

Standalone program (stdlib only), started by :mod:`dllm_trl.rewards.code` as
``python -I -S -c <codec + this file>`` with an empty environment, in its own session. It reads the
job (JSON) from stdin and writes one JSON line per test to a private duplicate of its stdout
(fd 1 itself is pointed at /dev/null so prints from test code cannot forge lines).

The candidate program never runs here. It runs in a separate *executor* process (see
``_sandbox_executor.py``) that the judge starts, with lower privileges. Test code runs here and sees
the candidate's functions only as proxies: calling one ships the (builtin-valued) arguments to the
executor, which calls the real function and ships the result back as data (see
``_sandbox_codec.py``). Assertions and comparisons are evaluated here on plain builtin values.
Consequently the candidate cannot patch the test machinery or builtins used by the tests, cannot
see expected values (they never leave this process), cannot forge a pass by exiting / printing /
writing to the channel, and ``__eq__`` tricks do not survive the transport.

When running as root the judge also creates a mount + network + IPC namespace, mounts a size-capped
tmpfs on the scratch folder and builds a minimal root there (read-only bind mounts of the Python
stdlib, /dev/null, /dev/zero, /dev/urandom, a private /tmp owned by the sandbox uid) into which the
executor chroots.
"""

import ast
import builtins
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4

SAFE_IMPORTS = {
    "math", "cmath", "re", "string", "collections", "itertools", "functools", "heapq", "bisect",
    "operator", "copy", "fractions", "decimal", "statistics", "typing", "numbers", "datetime",
    "random", "array", "hashlib", "json", "textwrap", "unicodedata", "struct", "calendar", "time",
}


class InfraError(Exception):
    """The sandbox could not be set up (not the candidate's fault)."""


class TestBroken(Exception):
    """A test from the dataset does not compile (counted as failed, reported)."""


class CandidateError(Exception):
    """An exception raised by candidate code (type not a builtin exception)."""


class CandidateCrashed(Exception):
    """The executor died / broke the protocol / produced an untransportable value."""


class CandidateTimeout(BaseException):
    """Time budget exceeded (BaseException so that test code cannot swallow it)."""


_OUT = None


def emit(obj):
    os.write(_OUT, (json.dumps(obj) + "\n").encode("utf-8"))


# ----------------------------------------------------------------------------- filesystem / namespaces
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.unshare.argtypes = [ctypes.c_int]
    return libc


def _mount(libc, src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s -> %s: %s" % (src, dst, os.strerror(err)))


def _bind_ro(libc, root, path, is_file=False):
    target = root + path
    if is_file:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "a"):
            pass
        _mount(libc, path, target, None, MS_BIND)
        _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_NOSUID)
    else:
        os.makedirs(target, mode=0o755, exist_ok=True)
        _mount(libc, path, target, None, MS_BIND | MS_REC)
        _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def setup_fs(job):
    """Returns (chroot_dir or None, workdir, info)."""
    scratch = job["scratch"]
    uid, gid = job.get("uid"), job.get("gid")
    mode = job.get("namespaces", "auto")
    info = {"mountns": False, "netns": False, "ipcns": False, "tmpfs": False}
    is_root = os.geteuid() == 0
    chroot = None
    if mode != "off":
        libc = _libc()
        if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC) == 0:
            info.update(mountns=True, netns=True, ipcns=True)
            try:
                _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
                _mount(libc, "tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                       "size=%d,nr_inodes=16384,mode=755" % job["limits"]["tmpfs_bytes"])
                info["tmpfs"] = True
                paths = []
                for p in sys.path + [os.path.dirname(os.__file__)]:
                    if p and os.path.isdir(p) and p not in paths:
                        paths.append(os.path.realpath(p))
                for p in sorted(set(paths)):
                    _bind_ro(libc, scratch, p)
                for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
                    if os.path.exists(dev):
                        _bind_ro(libc, scratch, dev, is_file=True)
                tmp = scratch + "/tmp"
                os.makedirs(tmp, mode=0o700, exist_ok=True)
                if is_root and uid is not None:
                    os.chown(tmp, uid, gid)
                os.chmod(tmp, 0o700)
                chroot = scratch
            except OSError as exc:
                info["mount_error"] = str(exc)
                chroot = None
        elif libc.unshare(CLONE_NEWNET) == 0:
            info["netns"] = True
    if mode == "require" and not (chroot and info["netns"]):
        raise InfraError("namespaces required but unavailable: %s" % info)
    workdir = scratch
    if chroot is None:
        workdir = os.path.join(scratch, "work")
        os.makedirs(workdir, mode=0o700, exist_ok=True)
        if is_root and uid is not None:
            os.chown(workdir, uid, gid)
            os.chmod(scratch, 0o711)
    return chroot, workdir, info


# ----------------------------------------------------------------------------- executor handle
class Executor:
    def __init__(self, job, chroot, workdir):
        self.job = job
        self.chroot = chroot
        self.workdir = workdir
        self.proc = None
        self.iso = None
        self.load_error = None
        self._next = 0

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            p.kill()
        except OSError:
            pass
        try:
            p.wait(timeout=10)
        except Exception:
            pass
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except Exception:
                pass

    def start(self, boot_deadline, booted):
        """Start a fresh executor and load the program. Raises InfraError (sandbox broken),
        CandidateCrashed (load failed / died) or CandidateTimeout."""
        job = self.job
        self.proc = subprocess.Popen(
            [job["python"], "-I", "-S", "-c", job["executor_src"]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={}, close_fds=True, start_new_session=True, cwd="/",
        )
        cfg = {
            "program": job["program"], "uid": job.get("uid"), "gid": job.get("gid"),
            "chroot": self.chroot, "workdir": self.workdir, "limits": job["limits"],
            # in a chroot the stdlib stays importable, so only cheap common modules are preloaded
            "preload": job.get("preload_min" if self.chroot else "preload", []),
            "seccomp": job.get("seccomp", "auto"),
            "judge_pid": os.getpid(),
        }
        try:
            send_msg(self.proc.stdin.fileno(), cfg)  # noqa: F821
            boot = recv_msg(self.proc.stdout.fileno(), boot_deadline, 1 << 16)  # noqa: F821
        except ChannelTimeout:  # noqa: F821
            self.kill()
            raise InfraError("executor did not boot in time")
        except (ChannelClosed, CodecError, OSError) as exc:  # noqa: F821
            self.kill()
            raise InfraError("executor boot failed: %s" % type(exc).__name__)
        if boot.get("k") != "boot":
            self.kill()
            raise InfraError("executor boot error: %s" % str(boot.get("e"))[:300])
        # requests are written with deadlines from now on (the candidate may stop reading)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.iso = boot.get("iso")
        load_deadline = booted()
        # from here on, everything the executor sends is untrusted data
        try:
            msg = recv_msg(self.proc.stdout.fileno(), load_deadline, 1 << 16)  # noqa: F821
        except ChannelTimeout:  # noqa: F821
            self.kill()
            raise CandidateTimeout("load")
        except (ChannelClosed, CodecError, OSError):  # noqa: F821
            self.kill()
            raise CandidateCrashed("died while loading")
        if msg.get("k") != "loaded":
            self.kill()
            self.load_error = str(msg.get("e", "?"))[:300]
            raise CandidateCrashed("load failed: %s" % self.load_error)

    def call(self, name, args, kwargs, deadline):
        if not self.alive():
            raise CandidateCrashed("executor not running")
        self._next += 1
        rid = self._next
        try:
            req = {"k": "call", "id": rid, "name": name,
                   "args": encode_value(tuple(args)), "kwargs": encode_value(dict(kwargs))}  # noqa: F821
        except (TypeError, ValueError, RecursionError) as exc:
            raise TypeError("argument not transportable to the sandbox: %s" % exc)
        ok = False
        try:
            send_msg(self.proc.stdin.fileno(), req, deadline)  # noqa: F821
            msg = recv_msg(self.proc.stdout.fileno(), deadline, self.job["max_message_bytes"])  # noqa: F821
            if msg.get("id") != rid or msg.get("k") not in ("ret", "exc"):
                raise CandidateCrashed("protocol violation")
            if msg["k"] == "ret":
                value = decode_value(msg.get("v"))  # noqa: F821
                ok = True
                return value
            ok = True
            etype = str(msg.get("type", ""))
            emsg = str(msg.get("msg", ""))[:300]
            cls = getattr(builtins, etype, None)
            if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
                try:
                    exc = cls(emsg)
                except Exception:
                    exc = CandidateError("%s: %s" % (etype, emsg))
            else:
                exc = CandidateError("%s: %s" % (etype, emsg))
            raise exc
        except ChannelTimeout:  # noqa: F821
            raise CandidateTimeout("call")
        except (ChannelClosed, BrokenPipeError) as exc:  # noqa: F821
            raise CandidateCrashed("executor died: %s" % type(exc).__name__)
        except CodecError as exc:  # noqa: F821
            raise CandidateCrashed("bad reply: %s" % exc)
        finally:
            if not ok:
                self.kill()


class Remote:
    """Proxy the tests see in place of a candidate function."""

    __slots__ = ("_judge", "_name")

    def __init__(self, judge, name):
        self._judge = judge
        self._name = name

    def __call__(self, *args, **kwargs):
        return self._judge.remote_call(self._name, args, kwargs)

    def __repr__(self):
        return "<sandboxed %s>" % self._name


# ----------------------------------------------------------------------------- judge
def candidate_names(program):
    """Top-level names the candidate program defines (defs, classes, simple assignments)."""
    tree = ast.parse(program)
    names = []
    safe_imports = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        names.append(t.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.append(node.target.id)
            elif isinstance(node, ast.Import):
                # "import math" in the solution: MBPP tests often use math.isclose without importing
                # math themselves. Only whole stdlib *modules* from an allow-list are bound in the
                # judge (never names picked out of them), and never over a trusted name.
                if all(a.name.split(".")[0] in SAFE_IMPORTS for a in node.names):
                    safe_imports.append(node)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return names, safe_imports


class Judge:
    def __init__(self, job):
        self.job = job
        self.executor = None
        self.deadline = None
        self.load_failed = None
        self.iso = None

    def remote_call(self, name, args, kwargs):
        ex = self.ensure_executor()
        return ex.call(name, args, kwargs, self.deadline)

    def ensure_executor(self):
        if self.load_failed:
            raise CandidateCrashed(self.load_failed)
        if self.executor is not None and self.executor.alive():
            return self.executor
        if self.executor is not None:
            self.executor.kill()
        ex = Executor(self.job, self.chroot, self.workdir)
        t0 = time.monotonic()

        def booted():
            # executor start-up (trusted code) is not charged to the candidate's time budget
            self.deadline += time.monotonic() - t0
            signal.setitimer(signal.ITIMER_REAL, max(0.01, self.deadline - time.monotonic()) + 1.0)
            return self.deadline

        try:
            ex.start(t0 + self.job["boot_timeout"], booted)
        except CandidateCrashed:
            if ex.load_error is not None:
                self.load_failed = "load failed: %s" % ex.load_error
            raise
        except CandidateTimeout:
            ex.kill()
            self.load_failed = "load timed out"
            raise
        except BaseException:
            ex.kill()
            raise
        if self.iso is None:
            self.iso = ex.iso
            emit({"k": "iso", "executor": ex.iso, "fs": self.fs_info})
        self.executor = ex
        return ex

    def run(self):
        job = self.job
        self.chroot, self.workdir, self.fs_info = setup_fs(job)
        base = {"__name__": "__judge__", "__builtins__": builtins}
        try:
            exec(compile(job.get("setup") or "", "<test setup>", "exec"), base)
        except Exception as exc:
            raise InfraError("test setup code failed: %s: %s" % (type(exc).__name__, exc))
        try:
            names, safe_imports = candidate_names(job["program"])
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            n = len(job["tests"]) if job["mode"] == "asserts" else 1
            for i in range(n):
                emit({"k": "test", "i": i, "passed": False, "err": "SyntaxError"})
            return
        if job["mode"] == "asserts":
            for node in safe_imports:
                scratch_ns = {"__builtins__": builtins}
                try:
                    exec(compile(ast.Module(body=[node], type_ignores=[]), "<imports>", "exec"), scratch_ns)
                except Exception:
                    continue
                for k, v in scratch_ns.items():
                    if k != "__builtins__" and k not in base:
                        base[k] = v
            tests = []
            for i, src in enumerate(job["tests"]):
                try:
                    tests.append(compile(src, "<test %d>" % i, "exec"))
                except SyntaxError:
                    tests.append(None)
            proxied = [n for n in dict.fromkeys(names) if n not in base and not hasattr(builtins, n)]
            for i, code in enumerate(tests):
                def body(code=code, i=i):
                    if code is None:
                        raise TestBroken("test %d does not compile" % i)
                    self.ensure_executor()
                    ns = dict(base)
                    for n in proxied:
                        ns[n] = Remote(self, n)
                    exec(code, ns)
                self.run_test(i, body)
        else:
            try:
                exec(compile(job["check"], "<check>", "exec"), base)
            except Exception as exc:
                raise InfraError("check code failed: %s: %s" % (type(exc).__name__, exc))
            check = base.get("check")
            if not callable(check):
                raise InfraError("test code defines no check(candidate)")
            entry = job["entry_point"]
            # the standard HumanEval harness runs prompt + completion + test in one module, so a
            # test may also call the function under test by name (HumanEval/33 does)
            base[entry] = Remote(self, entry)

            def body():
                self.ensure_executor()
                check(Remote(self, entry))

            self.run_test(0, body)

    def run_test(self, i, body):
        job = self.job
        budget = job["timeout"]
        remaining_total = self.total_deadline - time.monotonic()
        if remaining_total <= 0:
            emit({"k": "test", "i": i, "passed": False, "err": "total time budget exhausted"})
            return
        budget = min(budget, remaining_total)
        self.deadline = time.monotonic() + budget
        passed, err = False, None
        armed = [True]

        def on_alarm(signum, frame):
            if armed[0]:
                raise CandidateTimeout("alarm")

        old = signal.signal(signal.SIGALRM, on_alarm)
        # backstop for long-running test code in this process (re-armed after an executor boot,
        # whose time is not charged to the candidate)
        will_boot = self.executor is None or not self.executor.alive()
        signal.setitimer(signal.ITIMER_REAL, budget + 1.0 + (job["boot_timeout"] if will_boot else 0.0))
        try:
            body()
            passed = True
        except InfraError:
            raise
        except TestBroken as exc:
            err = "broken test: %s" % exc
        except CandidateTimeout:
            err = "timeout"
        except BaseException as exc:
            err = "%s: %s" % (type(exc).__name__, str(exc)[:200])
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        if err == "timeout" and self.executor is not None:
            self.executor.kill()
        emit({"k": "test", "i": i, "passed": passed, "err": err})

    def close(self):
        if self.executor is not None:
            self.executor.kill()


def main():
    global _OUT
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    _OUT = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        cap = job.get("judge_as_bytes")
        if cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except Exception:
        pass
    judge = Judge(job)
    judge.total_deadline = time.monotonic() + job["total_timeout"]
    try:
        judge.run()
        emit({"k": "done"})
    except InfraError as exc:
        emit({"k": "infra", "e": str(exc)[:500]})
    except BaseException as exc:
        emit({"k": "infra", "e": "judge error %s: %s" % (type(exc).__name__, str(exc)[:300])})
    finally:
        judge.close()
        os._exit(0)


if __name__ == "__main__":
    main()
