"""Judge: runs the TRUSTED unit tests of one completion and decides pass/fail.

Standalone program (stdlib only), started by :mod:`dllm_trl.rewards.code` as
``python -I -S -c <_processes + codec + this file>`` with an empty environment, in its own session. It reads the
job (JSON) from stdin and writes one JSON line per message to a private duplicate of its stdout
(fd 1 itself is pointed at /dev/null so prints from test code cannot forge lines): a ``watch``
line before each test (until when it may run: the caller kills a judge stuck past that, e.g. in C
code the alarm cannot interrupt, and restarts one for the remaining tests) and a ``test`` line
with its outcome.

The candidate program never runs here. It runs in a separate *executor* process (see
``_sandbox_executor.py``) that the judge starts, with lower privileges. Test code runs here and sees
the candidate's objects only as :class:`RemoteObject` proxies: calling one ships the arguments to
the executor, which calls the real function and ships the result back as data (see
``_sandbox_codec.py``); objects that are not data stay in the executor and come back as proxies
again; callables the test passes in (``key=len``, a lambda) are called back here; in-place changes
to the test's list / dict / set arguments are written back. Assertions and comparisons are
evaluated here on values of trusted types; ``x in obj`` on a proxy is membership among its items.
A value the test builds by calling a class of the candidate is kept as data only when it holds
the test's own arguments (:func:`_constructed`); names the test reads as modules are never the
candidate's (:meth:`Judge.namespace`). Consequently the candidate cannot patch the test machinery
or builtins used by the tests, cannot see expected values (they never leave this process, except
as arguments of the test's own calls of the candidate's code), cannot forge a pass by exiting /
printing / writing to the channel (requests carry unpredictable ids), and ``__eq__`` /
``__contains__`` / ``__bool__`` tricks never run here.

When running as root the judge also creates a mount + network + IPC namespace, mounts a size-capped
tmpfs on the scratch folder and builds a minimal root there (read-only bind mounts of the Python
stdlib, /dev/null, /dev/zero, /dev/urandom, a private /tmp owned by the sandbox uid) into which the
executor chroots.
"""

import ast
import builtins
import collections
import ctypes
import json
import os
import random
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4

_RNG = random.SystemRandom()

SAFE_IMPORTS = {
    "math", "cmath", "re", "string", "collections", "itertools", "functools", "heapq", "bisect",
    "operator", "copy", "fractions", "decimal", "statistics", "typing", "numbers", "datetime",
    "random", "array", "hashlib", "json", "textwrap", "unicodedata", "struct", "calendar", "time",
}

# names a test may mean as a module: what it reads as ``name.attr`` among these is never the program's
STDLIB_MODULES = frozenset(getattr(sys, "stdlib_module_names", ())) | SAFE_IMPORTS


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
                    for extra in ("site-packages", "dist-packages"):
                        # third-party packages are not part of the promise: hide them
                        hidden = scratch + p + "/" + extra
                        if os.path.isdir(hidden):
                            _mount(libc, "tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                   "size=4k,nr_inodes=8,mode=555")
                            info["hidden"] = info.get("hidden", 0) + 1
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
        self.names = {}
        self.values = {}
        # handles of sandboxed objects: received by the judge; handed by the test to the program
        # (as an argument, or by using the object); returned again by a class call (a shared instance)
        self.seen = set()
        self.released = set()
        self.shared = set()

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        p, self.proc = self.proc, None
        if p is not None:
            kill_process_group(p, wait=10)  # noqa: F821 (_processes.py prepended)

    def start(self, boot_deadline, booted, resolve):
        """Start a fresh executor and load the program. Raises InfraError (sandbox broken),
        CandidateCrashed (load failed / died) or CandidateTimeout."""
        job = self.job
        self.proc = start_isolated([job["python"], "-I", "-S", "-c", job["executor_src"]], {})  # noqa: F821
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
            msg = recv_msg(self.proc.stdout.fileno(), load_deadline, self.job["max_message_bytes"])  # noqa: F821
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
        names, values = msg.get("names"), msg.get("values")
        if not isinstance(names, dict) or not isinstance(values, dict):
            self.kill()
            raise CandidateCrashed("load failed: malformed names")
        for name, hid in list(names.items())[:10000]:
            if _is_name(name) and type(hid) is int:
                self.names[name] = RemoteObject(self, hid, name)
                self.seen.add(hid)
        for name, enc in list(values.items())[:10000]:
            if _is_name(name) and name not in self.names:
                try:
                    self.values[name] = decode_value(enc, resolve)  # noqa: F821
                except CodecError:  # noqa: F821
                    continue

    def request(self, msg, deadline, callbacks, resolve):
        """Send one request and wait for its reply, answering the executor's callback requests
        (``callbacks``: id -> trusted callable of the test) meanwhile. Returns the decoded reply."""
        if not self.alive():
            raise CandidateCrashed("executor not running")
        rid = msg["id"] = _RNG.getrandbits(62)  # unpredictable: replies cannot be written in advance
        ok = False
        try:
            send_msg(self.proc.stdin.fileno(), msg, deadline)  # noqa: F821
            while True:
                reply = recv_msg(self.proc.stdout.fileno(), deadline, self.job["max_message_bytes"])  # noqa: F821
                kind = reply.get("k")
                if kind == "cb":
                    self._answer_callback(reply, deadline, callbacks, resolve)
                    continue
                if reply.get("id") != rid or kind not in ("ret", "exc"):
                    raise CandidateCrashed("protocol violation")
                ok = True
                return reply
        except ChannelTimeout:  # noqa: F821
            raise CandidateTimeout("call")
        except (ChannelClosed, BrokenPipeError) as exc:  # noqa: F821
            raise CandidateCrashed("executor died: %s" % type(exc).__name__)
        except CodecError as exc:  # noqa: F821
            raise CandidateCrashed("bad reply: %s" % exc)
        finally:
            if not ok:
                self.kill()

    def _answer_callback(self, msg, deadline, callbacks, resolve):
        fn = callbacks.get(msg.get("fn")) if type(msg.get("fn")) is int else None
        if fn is None:
            raise CandidateCrashed("unknown callback")
        args = decode_value(msg.get("args"), resolve)  # noqa: F821
        kwargs = decode_value(msg.get("kwargs"), resolve)  # noqa: F821
        if type(args) is not tuple or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise CandidateCrashed("bad callback arguments")
        try:
            result = fn(*args, **kwargs)
            reply = {"k": "cbret", "id": msg.get("id"), "v": self.encode(result, callbacks)}
        except CandidateTimeout:
            raise
        except (CandidateCrashed, InfraError):
            raise
        except Exception as exc:
            reply = {"k": "cbexc", "id": msg.get("id"), "type": type(exc).__name__, "msg": str(exc)[:300]}
        send_msg(self.proc.stdin.fileno(), reply, deadline)  # noqa: F821

    def encode(self, value, callbacks):
        """Judge value -> tagged data for the executor: handles go back as their number, callables
        of the test become callbacks."""

        def fallback(obj):
            if isinstance(obj, Record):  # noqa: F821
                obj = obj._handle
            if isinstance(obj, RemoteObject):
                if obj._executor is not self:
                    raise TypeError("object of an earlier sandbox run")
                self.released.add(obj._hid)
                return {"h": obj._hid}
            if callable(obj):
                fid = len(callbacks) + 1
                callbacks[fid] = obj
                return {"cb": fid}
            raise TypeError("cannot send a value of type %s to the sandbox" % type(obj).__name__)

        try:
            return encode_value(value, fallback)  # noqa: F821
        except (TypeError, ValueError, RecursionError) as exc:
            raise TypeError("argument not transportable to the sandbox: %s" % exc)


def _is_name(name):
    return isinstance(name, str) and 0 < len(name) <= 200 and name.isidentifier() and not name.startswith("__")


class RemoteObject:
    """What the tests see in place of a candidate object (a function, a class, an instance): calls,
    attribute reads and writes, ``len``, iteration and indexing are forwarded to the executor; the
    replies are data. ``x in obj`` looks for ``x`` among the object's items (its iteration, received
    as data) with the judge's own comparison, never the candidate's ``__contains__``. Equality is
    identity of the sandboxed object (never the candidate's ``__eq__``), and truth testing is refused
    (never the candidate's ``__bool__``)."""

    __slots__ = ("_executor", "_hid", "_label", "_built")

    def __init__(self, executor, hid, label, built=False):
        object.__setattr__(self, "_executor", executor)
        object.__setattr__(self, "_hid", hid)
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_built", built)  # made by the test's call of a class of the program

    def _op(self, kind, **fields):
        return _JUDGE.remote(self, kind, fields)

    def __call__(self, *args, **kwargs):
        return self._op("call", args=args, kwargs=kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._op("op", op="getattr", arg=name)

    def __setattr__(self, name, value):
        if name.startswith("__"):
            raise AttributeError(name)
        self._op("op", op="setattr", arg=(name, value))

    def __len__(self):
        n = self._op("op", op="len")
        if type(n) is not int or n < 0:
            raise TypeError("len() of a sandboxed object must be a non-negative int")
        return n

    def __iter__(self):
        items = self._op("op", op="iter")
        if type(items) is not list:
            raise TypeError("iteration over a sandboxed object failed")
        return iter(items)

    def __getitem__(self, key):
        return self._op("op", op="getitem", arg=key)

    def __contains__(self, item):
        # never the candidate's __contains__ (it could answer True to anything): membership among
        # the object's items, received as data and compared here, as ``in`` on a list does
        return item in self.__iter__()

    def __bool__(self):
        raise TypeError("the truth value of a sandboxed object is not taken")

    def __str__(self):
        text = self._op("op", op="str")
        if type(text) is not str:
            raise TypeError("str() of a sandboxed object must be a str")
        return text

    def __eq__(self, other):
        if isinstance(other, Record):  # noqa: F821
            other = other._handle
        if not isinstance(other, RemoteObject):
            return NotImplemented
        return _same_object(self, other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash((id(self._executor), self._hid))

    def __repr__(self):
        return "<sandboxed %s>" % self._label


def _same_object(a, b):
    """Equality of two handles: the same sandboxed object. An object the test built with a class of
    the program equals only itself until the test has handed it to the program (then also the
    handles the program returns for it), and never anything else when the class gave an object that
    existed already (a shared or cached instance: the program could return it unasked)."""
    if a is b:
        return True
    if a._executor is not b._executor or a._hid != b._hid:
        return False
    ex = a._executor
    for side in (a, b):
        if side._built and (side._hid in ex.shared or side._hid not in ex.released):
            return False
    return True


# classes the judge rebuilds itself when a test calls the program's import of them (their values
# arrive as plain dicts, which ``dict(...)`` would not rebuild from the same arguments)
_TRUSTED_CLASSES = {
    "collections.Counter": collections.Counter,
    "collections.defaultdict": collections.defaultdict,
    "collections.OrderedDict": collections.OrderedDict,
}


def _constructed(ex, value, made, args, kwargs, known):
    """The value of the test's call ``C(*args, **kwargs)`` of a class of the program. A value that
    travels as data is kept only when it is an instance of the class called and holds the test's
    own arguments: a dataclass record or a
    namedtuple whose fields given by the call equal the arguments given for them; another value (an
    ``int`` / ``list`` / ``dict`` subclass, ``Fraction``, a date) when the judge's own constructor
    of its type gives an equal value from the same arguments. Otherwise (a constructor that
    discards or rewrites its arguments) it is the sandboxed object itself, a handle: usable through
    calls, attributes, iteration, but equal only as :func:`_same_object` says."""
    hid = made["obj"]
    if known:
        ex.shared.add(hid)
    if isinstance(value, RemoteObject):
        return RemoteObject(ex, value._hid, value._label, built=True) if value._hid == hid else value
    if type(value) is type(iter([])):
        return value  # an iterator, exhausted in the sandbox: equal only to itself anyway
    try:
        # a value of another type than the class called (a __new__ returning a range, a bool, None,
        # another class's record) could pick a constructor that loses its arguments: an object
        faithful = made.get("own") is True and _holds_arguments(value, made, args, kwargs)
    except Exception:
        faithful = False
    if not faithful:
        return RemoteObject(ex, hid, str(made.get("name", "object"))[:100], built=True)
    if isinstance(value, Record) and isinstance(value._handle, RemoteObject):  # noqa: F821
        handle = value._handle
        object.__setattr__(value, "_handle", RemoteObject(ex, handle._hid, handle._label, built=True))
    return value


def _holds_arguments(value, made, args, kwargs):
    if isinstance(value, Record):  # noqa: F821
        return _bound_fields_equal(value._fields, value._values, made.get("init"), args, kwargs)
    if isinstance(value, tuple) and _is_namedtuple(value):  # noqa: F821
        fields = tuple(type(value)._fields)
        return _bound_fields_equal(fields, tuple.__iter__(value), list(fields), args, kwargs)
    cls = _TRUSTED_CLASSES.get(made.get("name"))
    if cls is None:
        cls = type(value)  # a type the decoder made: a trusted builtin / stdlib value type
        if cls in (bool, type(None)):
            return False  # no class makes these; bool(x) is True for every truthy argument
        rebuilt = cls(*args, **kwargs)
        return type(rebuilt) is cls and (rebuilt is value or rebuilt == value)
    return cls(*args, **kwargs) == value


def _bound_fields_equal(fields, values, params, args, kwargs):
    """Whether the call's arguments, bound to the constructor's field parameters ``params`` (from
    the sandbox: only trusted as far as this check goes), each land in a field that holds them."""
    fields, values = tuple(fields), tuple(values)
    params = params if isinstance(params, list) else []
    if len(args) > len(params):
        return False
    bound = list(zip(params, args))
    for key, v in kwargs.items():
        if key not in params or any(name == key for name, _ in bound):
            return False
        bound.append((key, v))
    for name, v in bound:
        if not isinstance(name, str) or name not in fields:
            return False  # an argument that lands in no field (an InitVar, a made-up parameter)
        held = values[fields.index(name)]
        if not (held is v or held == v):
            return False
    return True


# ----------------------------------------------------------------------------- judge
def candidate_safe_imports(program):
    """``import math``-style statements of the program whose modules are on the allow-list: MBPP
    tests often use ``math.isclose`` without importing math themselves. Only whole stdlib
    *modules* are bound in the judge (never names picked out of them), never over a trusted name."""
    tree = ast.parse(program)
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                if all(a.name.split(".")[0] in SAFE_IMPORTS for a in node.names):
                    found.append(node)
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
    return found


def _names_used(code_ast):
    return {n.id for n in ast.walk(code_ast) if isinstance(n, ast.Name)}


def _modules_read(code_ast):
    """Names of standard-library modules that the test reads as modules: the base of an attribute
    (``math.isclose``, ``re.match``, ``os.path.join``)."""
    return {n.value.id for n in ast.walk(code_ast)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in STDLIB_MODULES}


class Judge:
    def __init__(self, job):
        self.job = job
        self.executor = None
        self.deadline = None
        self.load_failed = None
        self.iso = None
        self.current = None

    # calls from the tests ----------------------------------------------------------------------
    def remote(self, obj, kind, fields):
        ex = obj._executor
        if ex is not self.executor or not ex.alive():
            raise CandidateCrashed("object of an earlier sandbox run")
        ex.released.add(obj._hid)  # the test uses the object: the program now holds it
        callbacks = {}
        msg = {"k": kind, "target": obj._hid}
        if kind == "call":
            args, kwargs = fields["args"], fields["kwargs"]
            msg["args"] = ex.encode(tuple(args), callbacks)
            msg["kwargs"] = ex.encode(dict(kwargs), callbacks)
        else:
            msg["op"] = fields["op"]
            if "arg" in fields:
                msg["arg"] = ex.encode(fields["arg"], callbacks)
        resolve = self._resolve_from(ex, callbacks)
        reply = ex.request(msg, self.deadline, callbacks, resolve)
        if reply["k"] == "exc":
            raise _candidate_exception(reply)
        made = reply.get("cls") if kind == "call" else None  # the call was a class's: what it made
        if made is not None and not (isinstance(made, dict) and type(made.get("obj")) in (int, type(None))):
            ex.kill()
            raise CandidateCrashed("bad reply: malformed construction")
        known = made is not None and made.get("obj") in ex.seen
        try:
            value = decode_value(reply.get("v"), resolve)  # noqa: F821
            if kind == "call":
                _write_back(fields["args"], fields["kwargs"], reply.get("mut"), resolve)
            if made is not None and made.get("obj") is not None:
                # the arguments as the program received them (the judge's own encoding, read back)
                def sent(tag, v):
                    return RemoteObject(ex, v, "argument") if tag == "h" and type(v) is int else resolve(tag, v)

                args, kwargs = decode_value(msg["args"], sent), decode_value(msg["kwargs"], sent)  # noqa: F821
                value = _constructed(ex, value, made, args, kwargs, known)
        except CodecError as exc:  # noqa: F821
            ex.kill()
            raise CandidateCrashed("bad reply: %s" % exc)
        return value

    def _resolve_from(self, ex, callbacks):
        def resolve(tag, v):
            if tag == "h" and isinstance(v, list) and len(v) == 2 and type(v[0]) is int:
                ex.seen.add(v[0])
                return RemoteObject(ex, v[0], str(v[1])[:100])
            if tag == "cb" and type(v) is int and v in callbacks:
                return callbacks[v]  # one of the test's own callables, handed back
            raise CodecError("unknown reference")  # noqa: F821

        return resolve

    # executor lifecycle --------------------------------------------------------------------------
    def ensure_executor(self):
        if self.load_failed:
            raise CandidateCrashed(self.load_failed)
        if self.executor is not None and self.executor.alive():
            return self.executor
        if self.executor is not None:
            self.executor.kill()
        ex = Executor(self.job, self.chroot, self.workdir)
        t0 = time.monotonic()
        watch(self.current, t0 + self.job["boot_timeout"] + (self.deadline - t0))

        def booted():
            # executor start-up (trusted code) is not charged to the candidate's time budget
            self.deadline += time.monotonic() - t0
            watch(self.current, self.deadline)
            signal.setitimer(signal.ITIMER_REAL, max(0.01, self.deadline - time.monotonic()) + 1.0)
            return self.deadline

        self.executor = ex
        try:
            ex.start(t0 + self.job["boot_timeout"], booted, self._resolve_from(ex, {}))
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
        return ex

    def run(self):
        job = self.job
        self.chroot, self.workdir, self.fs_info = setup_fs(job)
        base = {"__name__": "__judge__", "__builtins__": builtins}
        try:
            exec(compile(job.get("setup") or "", "<test setup>", "exec"), base)
        except Exception as exc:
            raise InfraError("test setup code failed: %s: %s" % (type(exc).__name__, exc))
        first = int(job.get("first_test", 0))
        try:
            safe_imports = candidate_safe_imports(job["program"])
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            n = len(job["tests"]) if job["mode"] == "asserts" else 1
            for i in range(first, n):
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
            for i, src in enumerate(job["tests"]):
                if i < first:
                    continue
                try:
                    tree = ast.parse(src)
                    code = compile(tree, "<test %d>" % i, "exec")
                    used, modules = _names_used(tree), _modules_read(tree)
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    code, used, modules = None, set(), set()

                def body(code=code, used=used, modules=modules, i=i):
                    if code is None:
                        raise TestBroken("test %d does not compile" % i)
                    ex = self.ensure_executor()
                    exec(code, self.namespace(base, ex, used, modules))

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

            def body():
                ex = self.ensure_executor()
                fn = ex.names.get(entry)
                if fn is None:
                    raise NameError("the program defines no %s" % entry)
                # the standard HumanEval harness runs prompt + completion + test in one module, so a
                # test may also call the function under test by name (HumanEval/33 does)
                check.__globals__[entry] = fn
                check(fn)

            self.run_test(0, body)

    def namespace(self, base, ex, used, modules=()):
        """The test's globals: trusted setup first (never overridden), then what the candidate
        defines. A candidate name that shadows a builtin is bound only when the test calls no other
        candidate name (``assert pow(2, 3) == 8`` tests the candidate's ``pow``); when the test does
        (``assert len(f(1)) == 3``), builtin-named definitions stay the candidate's own helpers.
        A name the test reads as a module (``modules``: ``math`` in ``math.isclose(...)``) is never
        the candidate's: it is the module when the setup or one of the program's allow-listed
        ``import`` statements (run here, see :func:`candidate_safe_imports`) provides it, else unbound."""
        ns = dict(base)
        candidate = dict(ex.values)
        candidate.update(ex.names)
        for name in modules:
            candidate.pop(name, None)
        primary = [n for n in candidate if n in used and n not in base and not hasattr(builtins, n)]
        for name, value in candidate.items():
            if name in base:
                continue
            if hasattr(builtins, name) and (primary or name not in used):
                continue
            ns[name] = value
        return ns

    def run_test(self, i, body):
        job = self.job
        budget = job["timeout"]
        remaining_total = self.total_deadline - time.monotonic()
        if remaining_total <= 0:
            emit({"k": "test", "i": i, "passed": False, "err": "total time budget exhausted"})
            return
        budget = min(budget, remaining_total)
        self.current = i
        self.deadline = time.monotonic() + budget
        watch(i, self.deadline)
        passed, err = False, None
        armed = [True]

        def on_alarm(signum, frame):
            if armed[0]:
                raise CandidateTimeout("alarm")

        old = signal.signal(signal.SIGALRM, on_alarm)
        # backstop for long-running test code in this process (re-armed after an executor boot,
        # whose time is not charged to the candidate); C-level work that the alarm cannot
        # interrupt is bounded by the caller, which kills this process after the watched deadline
        will_boot = self.executor is None or not self.executor.alive()
        signal.setitimer(signal.ITIMER_REAL, budget + 1.0 + (job["boot_timeout"] if will_boot else 0.0))
        try:
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
        except CandidateTimeout:  # the alarm fired while the outcome was being recorded
            passed, err = False, "timeout"
        signal.signal(signal.SIGALRM, old)
        if err == "timeout" and self.executor is not None:
            self.executor.kill()
        emit({"k": "test", "i": i, "passed": passed, "err": err})

    def close(self):
        if self.executor is not None:
            self.executor.kill()


def _candidate_exception(reply):
    """An exception raised in the sandbox, re-created here: a builtin exception type by name (so
    ``except ValueError`` in a test works), anything else as CandidateError."""
    etype = str(reply.get("type", ""))
    emsg = str(reply.get("msg", ""))[:300]
    cls = getattr(builtins, etype, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        try:
            return cls(emsg)
        except Exception:
            pass
    return CandidateError("%s: %s" % (etype, emsg))


def _write_back(args, kwargs, mutations, resolve):
    """Apply the executor's report of in-place changes to the test's own mutable arguments."""
    if not isinstance(mutations, list):
        raise CodecError("malformed mutations")  # noqa: F821
    for item in mutations[: len(args) + len(kwargs)]:
        if not (isinstance(item, list) and len(item) == 2):
            raise CodecError("malformed mutations")  # noqa: F821
        key, enc = item
        if type(key) is int and 0 <= key < len(args):
            target = args[key]
        elif type(key) is str and key in kwargs:
            target = kwargs[key]
        else:
            raise CodecError("malformed mutations")  # noqa: F821
        new = decode_value(enc, resolve)  # noqa: F821
        if type(new) is not type(target):
            raise CodecError("mutation changed the type")  # noqa: F821
        if type(target) in (list, bytearray):
            target[:] = new
        elif type(target) in (dict, set):
            target.clear()
            target.update(new)


_JUDGE = None


def watch(i, until):
    """Tell the caller until when test ``i`` may run; past that (plus a grace) it kills this
    process, which is how C-level work on a candidate's value (``sum(range(10**18))``) is bounded."""
    if i is not None:
        emit({"k": "watch", "i": i, "until": until})


def main():
    global _OUT, _JUDGE
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    (_OUT,) = quiet_stdio(1)  # noqa: F821 (_processes.py prepended)
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
    judge = _JUDGE = Judge(job)
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
