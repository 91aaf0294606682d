"""Judge: runs the TRUSTED unit tests of one completion and decides pass/fail.

Standalone program (stdlib only), started by :mod:`dllm_trl.rewards.code` as
``python -I -S -c <_processes + codec + this file>`` (as bytecode on stdin when the interpreter is the caller's) with an empty environment, in its own session. It reads the
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
again (iterators too, consumed on request); callables the test passes in (``key=len``, a lambda)
are called back here; in-place changes to the test's arguments are written back. Assertions,
comparisons and every operator of the test's own expressions are evaluated here on values of trusted
types: a value that crosses from the program into a test expression is data the judge understands or an
opaque handle, so arithmetic on a proxy is refused (a TypeError), never forwarded to the program;
``x in obj`` on a proxy is membership among its items.

What the judge knows about the program comes from the program's source (:func:`program_names`,
read here) and from its own records, never from the executor, which the candidate controls
entirely: a call of a class the judge models (:class:`ClassModel`) is evaluated here from the
test's arguments; a call of any other class statement of the program gives the sandboxed object
as a handle that the judge holds back (:func:`_same_object`);
names the test reads as modules are never the candidate's (:meth:`Judge.namespace`). Consequently
the candidate cannot patch the test machinery or builtins used by the tests, cannot see expected
values (they never leave this process, except as arguments of the test's own calls of the
candidate's code), cannot forge a pass by exiting / printing / writing to the channel (requests
carry unpredictable ids), and ``__eq__`` / ``__contains__`` / ``__bool__`` tricks never run here.

When running as root the judge also creates a mount + network + IPC namespace, mounts a size-capped
tmpfs on the scratch folder and builds a minimal root there (read-only bind mounts of the Python
stdlib, /dev/null, /dev/zero, /dev/urandom, a private /tmp owned by the sandbox uid) into which the
executor chroots.
"""

import ast
import base64
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
# (the standard library, and third-party packages with their usual import names / aliases)
THIRD_PARTY_MODULES = {
    "np", "numpy", "pd", "pandas", "sympy", "sp", "scipy", "torch", "tf", "tensorflow", "jax", "jnp", "plt",
    "matplotlib", "sklearn", "nx", "networkx", "mpmath", "numba", "polars", "pl", "cv2", "PIL", "requests",
}
STDLIB_MODULES = frozenset(getattr(sys, "stdlib_module_names", ())) | SAFE_IMPORTS | THIRD_PARTY_MODULES


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
    def __init__(self, job, chroot, workdir, kinds):
        self.job = job
        self.kinds = kinds  # the judge's reading of the program's names (program_names)
        self.chroot = chroot
        self.workdir = workdir
        self.proc = None
        self.iso = None
        self.load_error = None
        self.names = {}
        self.values = {}
        # handles of sandboxed objects: received by the judge; returned by a class call while known
        # (a shared instance)
        self.seen = set()
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
        program = job["executor"]
        code = base64.b64decode(program["bytecode"]) if "bytecode" in program else None
        self.proc = start_isolated([job["python"], "-I", "-S", "-c", program["loader"] if code else program["source"]], {})  # noqa: F821
        cfg = {
            "program": job["program"], "uid": job.get("uid"), "gid": job.get("gid"),
            "chroot": self.chroot, "workdir": self.workdir, "limits": job["limits"],
            # in a chroot the stdlib stays importable, so only cheap common modules are preloaded
            "preload": job.get("preload_min" if self.chroot else "preload", []),
            "seccomp": job.get("seccomp", "auto"),
            "judge_pid": os.getpid(),
        }
        try:
            if code is not None:  # the executor's own code first (compiled by the caller), then its configuration
                _write_all(self.proc.stdin.fileno(), code)
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
                self.names[name] = RemoteObject(self, hid, name, kind=self.kinds.get(name, ("function",))[0])
                self.seen.add(hid)
        for name, enc in list(values.items())[:10000]:
            if _is_name(name) and name not in self.names:
                try:
                    value = decode_value(enc, resolve)  # noqa: F821
                except CodecError:  # noqa: F821
                    continue
                if isinstance(value, RemoteObject):  # an object: called, it builds unless a function
                    value = type(value)(self, value._hid, name, kind=self.kinds.get(name, ("function",))[0])
                self.values[name] = value

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

    def encode(self, value, callbacks, handed=None):
        """Judge value -> tagged data for the executor: handles go back as their number (collected
        in ``handed``: the objects this request hands to the program), callables of the test become
        callbacks."""

        def fallback(obj):
            if isinstance(obj, Record):  # noqa: F821
                obj = obj._handle
            if isinstance(obj, ModelClass):
                obj = obj._remote
            if isinstance(obj, (EnumMember, _MixinMember)):
                return {"em": [obj._cls, obj._name, None, None]}
            if isinstance(obj, RemoteObject):
                if obj._executor is not self:
                    raise TypeError("object of an earlier sandbox run")
                if handed is not None:  # the object, and what the test handed over to get it
                    handed.add(obj._hid)
                    handed.update(obj._grant)
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


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _is_name(name):
    return isinstance(name, str) and 0 < len(name) <= 200 and name.isidentifier() and not name.startswith("__")


class RemoteObject:
    """What the tests see in place of a candidate object (a function, a class, an instance): calls,
    attribute reads and writes, ``len``, iteration (item by item, on request), indexing and item
    assignment, ``str`` / ``repr``, ``float`` / ``int``, ``with`` and ``isinstance`` are forwarded to
    the executor; the replies are data. ``x in obj`` looks for ``x`` among the object's items with the
    judge's own comparison, never the candidate's ``__contains__``. Equality is identity of the
    sandboxed object (never the candidate's ``__eq__``), truth testing and arithmetic are refused
    (never the candidate's ``__bool__`` / ``__sub__``), and ``with obj:`` never suppresses an
    exception of the test."""

    __slots__ = ("_executor", "_hid", "_label", "_built", "_kind", "_grant")
    _sandbox_handle = True

    def __init__(self, executor, hid, label, built=False, kind=None, grant=frozenset()):
        object.__setattr__(self, "_executor", executor)
        object.__setattr__(self, "_hid", hid)
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_built", built)  # made by the test's call of a class of the program
        object.__setattr__(self, "_kind", kind)  # the judge's reading of the program's name, when a name
        # the objects the request that gave this handle handed to the program (its target and arguments)
        object.__setattr__(self, "_grant", grant)

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
        return _RemoteIterator(self._op("op", op="iter"))

    def __getitem__(self, key):
        return self._op("op", op="getitem", arg=key)

    def __setitem__(self, key, value):
        self._op("op", op="setitem", arg=(key, value))

    def __delitem__(self, key):
        self._op("op", op="delitem", arg=key)

    def __contains__(self, item):
        # never the candidate's __contains__ (it could answer True to anything): membership among
        # the object's items, received as data and compared here, as ``in`` on a list does
        return any(x is item or x == item for x in self.__iter__())

    def __bool__(self):
        raise TypeError("the truth value of a sandboxed object is not taken")

    def _typed(self, op, want):
        value = self._op("op", op=op)
        if type(value) is not want:
            raise TypeError("%s() of a sandboxed object must give a %s" % (op, want.__name__))
        return value

    def __str__(self):
        return self._typed("str", str)

    def __repr__(self):
        try:
            return self._typed("repr", str)
        except (CandidateCrashed, InfraError):
            raise
        except Exception:
            return "<sandboxed %s>" % self._label

    def __float__(self):
        return self._typed("float", float)

    def __int__(self):
        return self._typed("int", int)

    def __index__(self):
        return self._typed("index", int)

    def __complex__(self):
        return self._typed("complex", complex)

    def __enter__(self):
        return self._op("op", op="enter")

    def __exit__(self, *exc):
        self._op("op", op="exit")
        return False  # an exception of the test is never swallowed by the program

    def __instancecheck__(self, obj):
        if isinstance(obj, Record):  # noqa: F821
            obj = obj._handle
        if not isinstance(obj, RemoteObject):
            return False  # a value of a trusted type is no instance of a class of the program
        answer = obj._op("op", op="isinstance", arg=self)
        if type(answer) is not bool:
            raise TypeError("isinstance() of a sandboxed object must give a bool")
        return answer

    def __eq__(self, other):
        if isinstance(other, Record):  # noqa: F821
            other = other._handle
        if isinstance(other, ModelClass):
            other = other._remote
        if not isinstance(other, RemoteObject):
            return NotImplemented
        return _same_object(self, other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash((id(self._executor), self._hid))


# the test's operators are the judge's: arithmetic on a sandboxed object is never forwarded to the
# program (its ``__sub__`` would see the test's expected value and answer the difference, as in
# ``abs(f(x) - want) < 1e-6``); the judge has no arithmetic for an opaque handle, so it is a TypeError
ARITHMETIC = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and",
              "xor", "or", "divmod")
UNARY = ("neg", "pos", "abs", "invert", "round", "trunc", "floor", "ceil")


def _refused(name):
    def method(self, *other):
        raise TypeError("the test's %s is the judge's, and a sandboxed %s is no number or value it knows "
                        "(call a method of the object, or convert it: float(obj), int(obj))" % (name, self._label))

    method.__name__ = "__%s__" % name
    return method


for _name in ARITHMETIC:
    for _form in ("%s", "r%s", "i%s"):
        setattr(RemoteObject, "__%s__" % (_form % _name), _refused(_name))
for _name in UNARY:
    setattr(RemoteObject, "__%s__" % _name, _refused(_name))


class RemoteIteratorObject(RemoteObject):
    """A sandboxed iterator (a generator, ``map``, ``itertools.count()``...): ``next`` takes one item."""

    __slots__ = ()

    def __next__(self):
        items, more = _chunk(self._op("op", op="take", arg=1))
        if not items:
            raise StopIteration
        return items[0]


def _chunk(reply):
    if not (type(reply) is list and len(reply) == 2 and type(reply[0]) is list
            and (reply[1] is None or isinstance(reply[1], RemoteObject))):
        raise TypeError("iteration over a sandboxed object failed")
    return reply


class _RemoteIterator:
    """The judge's iterator over a sandboxed object: items arrive in growing chunks, on demand, so
    an endless generator can be consumed in part (``next``, ``islice``, ``zip``)."""

    def __init__(self, first):
        items, self.more = _chunk(first)
        self.items = collections.deque(items)
        self.size = 16

    def __iter__(self):
        return self

    def __next__(self):
        while not self.items:
            if self.more is None:
                raise StopIteration
            self.size = min(4 * self.size, 4096)
            items, self.more = _chunk(self.more._op("op", op="take", arg=self.size))
            self.items.extend(items)
        return self.items.popleft()


def _same_object(a, b):
    """Equality of two handles: the same sandboxed object. An object the test built with a class of
    the program equals itself, and a handle the program returned for it only from a request that
    handed it over (as the target, ``t.inc() == t``, or an argument, ``last(n) == n``): never one from
    another call (a registry of the instances the test built, read after the test used one), and
    never anything but itself when the class gave an object that existed already (a shared or cached
    instance: the program could return it unasked)."""
    if a is b:
        return True
    if a._executor is not b._executor or a._hid != b._hid:
        return False
    ex = a._executor
    for side, other in ((a, b), (b, a)):
        if side._built and (side._hid in ex.shared or side._hid not in other._grant):
            return False
    return True


# ----------------------------------------------------------------------------- the program, read from its AST
# What the judge knows about a name of the program comes from the program's source, read here,
# never from the executor (the candidate's process, which can rewrite anything in itself).
# ``program_names`` classifies every module-level name:
#   "model"     bound once, by a class statement (or ``namedtuple(...)``) whose value semantics the
#               judge reproduces itself (:class:`ClassModel`): a call by the test builds the value
#               here, from the test's own arguments; the program never sees the call;
#   "class"     bound by another class statement (own constructor, ``__post_init__``, an enum, a
#               plain class): a call by the test *builds an object*: the test gets the sandboxed
#               object as a handle, equal only to itself (never the program's answer before the test
#               hands it over, see :func:`_same_object`);
#   "stdlib"    bound once, by ``from <allow-listed stdlib module> import name``: the real object;
#   "module"    ``import x`` / ``import x as y``: never the program's for the test;
#   "function"  anything else (a ``def``, a lambda, an assignment, a name the source does not bind,
#               e.g. ``globals()[...] = ...``): what a call returns is the program's answer. A class
#               hidden behind such a name gains a program nothing that ``def Point(*a): ...`` would
#               not: both are the program answering for the test's expected value, as in plain
#               Python (out of scope, docs/rewards.md).

DATACLASS_DECORATORS = {"dataclass", "dataclasses.dataclass"}
NAMEDTUPLE_FACTORIES = {"namedtuple", "collections.namedtuple"}
NAMEDTUPLE_BASES = {"NamedTuple", "typing.NamedTuple"}
BUILTIN_BASES = {"int": int, "float": float, "complex": complex, "str": str, "bytes": bytes, "tuple": tuple,
                 "list": list, "dict": dict, "set": set, "frozenset": frozenset}
# dunders a modelled class may not define: they change how it is built, compared or hashed
VALUE_DUNDERS = {"__init__", "__new__", "__post_init__", "__setattr__", "__delattr__", "__getattribute__",
                 "__getattr__", "__eq__", "__ne__", "__hash__", "__lt__", "__le__", "__gt__", "__ge__",
                 "__init_subclass__", "__class_getitem__", "__set_name__", "__reduce__", "__getnewargs__",
                 "__iter__", "__len__", "__getitem__", "__contains__", "__bool__", "__index__", "__int__",
                 "__float__", "__complex__", "__str__", "__repr__", "__format__"}
DATACLASS_OPTIONS = {"init": True, "repr": None, "eq": True, "order": None, "unsafe_hash": None, "frozen": None,
                     "match_args": None, "kw_only": None, "slots": None, "weakref_slot": None}
DEFAULT_FACTORIES = {"list": list, "dict": dict, "set": set, "tuple": tuple, "str": str, "int": int,
                     "float": float, "frozenset": frozenset}
_MISSING = object()


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base + "." + node.attr if base else None
    return None


class ClassModel:
    """A class of the program whose calls the judge evaluates itself: a dataclass with its generated
    ``__init__`` (no ``__post_init__``, no own ``__new__`` / ``__eq__`` / ``__setattr__``, no base
    class, literal defaults or builtin ``default_factory``), a ``namedtuple`` / ``NamedTuple`` with
    literal fields and defaults, or a subclass of a builtin value type without its own constructor
    or comparison. ``build(args, kwargs)`` gives the value as the class would make it: a record, a
    namedtuple, or the builtin value."""

    def __init__(self, name, kind):
        self.name, self.kind = name, kind
        self.params = []  # (name, default thunk or _MISSING, keyword-only) in __init__ order
        self.fields = ()  # every field, in order (dataclass / namedtuple)
        self.extra = {}  # dataclass fields not in __init__: name -> default thunk
        self.compare_index = ()
        self.order = False
        self.own_text = False  # the class defines __str__ / __repr__ (asked of the program's instance)
        self.base = None
        self.tuple_class = None  # namedtuple: the judge's class of the values it builds
        self.specs = ()  # dataclass: (name, default thunk, init, compare) of every field, inherited ones first
        self.ancestors = ()  # dataclass: the modelled dataclasses it derives from, outermost first
        self.members = []  # enum: (name, value) in definition order, aliases included
        self.mixin = None  # enum: int for an IntEnum, str for a StrEnum
        self.interned = {}  # enum: canonical member name -> the judge's EnumMember

    def build(self, args, kwargs):
        if self.kind == "builtin":
            return self.base(*args, **kwargs)
        values = self._bind(args, kwargs)
        if self.kind == "namedtuple":
            return self.tuple_of([values[f] for f in self.fields])
        given = [self.fields.index(n) for n in self._given_names(args, kwargs) if n in self.fields]
        for name, thunk in self.extra.items():
            values[name] = thunk()
        return Record(self.name, self.fields, [values[f] for f in self.fields], None, given)  # noqa: F821

    def tuple_of(self, values):
        """A namedtuple value of this class: tuple equality, and its methods asked of the program."""
        if self.tuple_class is None:
            plain = _namedtuple_class(self.name, self.fields)  # noqa: F821
            self.tuple_class = type(self.name, (plain,), {"__slots__": (), "__getattr__": _program_method})
        return self.tuple_class(*values)

    def member_for(self, args, kwargs):
        """Enum: the member whose value equals the one argument (the first one defined with it)."""
        if len(args) != 1 or kwargs:
            raise TypeError("%s() takes one value" % self.name)
        if isinstance(args[0], (EnumMember, _MixinMember)) and args[0]._model is self:
            return args[0]
        for name, value in self.members:
            if value == args[0] and hash(value) == hash(args[0]):
                return self.member(name)
        raise ValueError("%r is not a valid %s" % (args[0], self.name))

    def canonical(self, name):
        """Enum: the member a name stands for (an alias ``CRIMSON = 1`` after ``RED = 1`` is ``RED``)."""
        values = dict(self.members)
        if name not in values:
            return None
        for first, value in self.members:
            if value == values[name] and hash(value) == hash(values[name]):
                return first
        return None

    def member(self, name):
        """Enum: the judge's own member of that name (one object per member: ``is`` works)."""
        first = self.canonical(name)
        if first is None:
            raise AttributeError(name)
        if first not in self.interned:
            value = dict(self.members)[first]
            self.interned[first] = (EnumMember(self, first, value) if self.mixin is None
                                    else _MIXIN_MEMBERS[self.mixin](self, first, value))
        return self.interned[first]

    def canonical_members(self):
        return [self.member(n) for n, _ in self.members if self.canonical(n) == n]

    def _given_names(self, args, kwargs):
        positional = [p[0] for p in self.params if not p[2]]
        return positional[: len(args)] + list(kwargs)

    def _bind(self, args, kwargs):
        positional = [p for p in self.params if not p[2]]
        if len(args) > len(positional):
            raise TypeError("%s() takes %d positional arguments but %d were given" % (self.name, len(positional), len(args)))
        values = {}
        for (name, _, _), value in zip(positional, args):
            values[name] = value
        known = {p[0] for p in self.params}
        for key, value in kwargs.items():
            if key not in known:
                raise TypeError("%s() got an unexpected keyword argument %r" % (self.name, key))
            if key in values:
                raise TypeError("%s() got multiple values for argument %r" % (self.name, key))
            values[key] = value
        for name, thunk, _ in self.params:
            if name not in values:
                if thunk is _MISSING:
                    raise TypeError("%s() missing required argument: %r" % (self.name, name))
                values[name] = thunk()
        return values


def _program_method(value, name):
    """A method of a namedtuple class of the program, for a value the judge built: asked of the
    program's instance rebuilt from it (which hands the value to the program)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_JUDGE.materialize(value), name)


CONSTANT_TYPES = (int, float, complex, str, bytes, bool, type(None))
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
           ast.Pow: lambda a, b: a ** b}


class ProgramEnv:
    """What the judge knows of the program's module-level names when it evaluates a default value:
    modules bound once by ``import m`` of an allow-listed module, names bound once by ``from m import
    x``, every name the program binds (a builtin it rebinds is not the builtin), earlier class models."""

    def __init__(self, modules=None, stdlib=None, bound=(), models=None):
        self.modules, self.stdlib = dict(modules or {}), dict(stdlib or {})
        self.bound, self.models = set(bound), dict(models or {})


def _judge_value(node, env):
    """A default written with literals, the constants of allow-listed modules (``math.inf``, ``pi``
    from ``from math import pi``), ``float('inf')``, unary and binary arithmetic on numbers and small
    repetitions (``[0] * 3``): evaluated here, by the judge, never by the program. Raises ValueError
    for anything else."""
    env = env or ProgramEnv()
    if isinstance(node, ast.Constant):
        if type(node.value) not in CONSTANT_TYPES:
            raise ValueError("constant")
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_judge_value(e, env) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking")
        return {_judge_value(k, env): _judge_value(v, env) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _judge_value(node.operand, env)
        if type(v) not in (int, float, complex):
            raise ValueError("unary operand")
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _judge_value(node.left, env), _judge_value(node.right, env)
        numbers = (int, float, complex)
        if type(a) in numbers and type(b) in numbers:
            bits = [abs(x).bit_length() if type(x) is int else 64 for x in (a, b)]
            if isinstance(node.op, ast.Pow) and type(b) is int and bits[0] * abs(b) > 4096 \
                    or isinstance(node.op, ast.Mult) and sum(bits) > 4096:
                raise ValueError("a number too large for the judge to evaluate")
        elif isinstance(node.op, ast.Mult) and type(a) in (list, tuple, str) and type(b) is int and 0 <= len(a) * b <= 10000:
            pass
        elif isinstance(node.op, ast.Add) and type(a) is type(b) and type(a) in (list, tuple, str) and len(a) + len(b) <= 10000:
            pass
        else:
            raise ValueError("binary operands")
        return _BINARY[type(node.op)](a, b)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in env.modules:
        value = getattr(__import__(env.modules[node.value.id]), node.attr, _MISSING)
        if type(value) not in CONSTANT_TYPES:
            raise ValueError("module attribute")
        return value
    if isinstance(node, ast.Name) and node.id in env.stdlib:
        value = _stdlib_object(*env.stdlib[node.id])
        if type(value) not in CONSTANT_TYPES:
            raise ValueError("imported name")
        return value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("float", "int", "complex") \
            and node.func.id not in env.bound and len(node.args) == 1 and not node.keywords:
        arg = _judge_value(node.args[0], env)
        if type(arg) not in (int, float, str):
            raise ValueError("conversion argument")
        return {"float": float, "int": int, "complex": complex}[node.func.id](arg)
    raise ValueError("not a value the judge evaluates")


def _literal_thunk(node, env=None):
    """A default value the judge evaluates itself (:func:`_judge_value`): a function giving a fresh
    copy each time."""
    value = _judge_value(node, env)
    return lambda: _judge_value(node, env) if isinstance(value, (list, dict, set)) else value


def _factory_thunk(node, env):
    """``default_factory=``: a builtin type the program does not rebind, or a lambda without
    parameters whose body the judge evaluates itself (``lambda: [0, 0]``)."""
    if isinstance(node, ast.Lambda):
        spec = node.args
        if spec.args or spec.posonlyargs or spec.kwonlyargs or spec.vararg or spec.kwarg:
            raise ValueError("default_factory lambda with parameters")
        _judge_value(node.body, env)
        return lambda: _judge_value(node.body, env)
    name = _dotted(node)
    factory = DEFAULT_FACTORIES.get(name)
    if factory is None or (env is not None and name in env.bound):
        raise ValueError("default_factory")
    return factory


def _field_spec(value, env=None):
    """``x: int = <value>`` in a dataclass -> (default thunk or _MISSING, init, compare); raises
    ValueError where the judge cannot reproduce the field."""
    if value is None:
        return _MISSING, True, True
    if isinstance(value, ast.Call) and _dotted(value.func) in ("field", "dataclasses.field"):
        if value.args:
            raise ValueError("positional field() arguments")
        thunk, init, compare = _MISSING, True, True
        for kw in value.keywords:
            if kw.arg == "default":
                thunk = _literal_thunk(kw.value, env)
            elif kw.arg == "default_factory":
                thunk = _factory_thunk(kw.value, env)
            elif kw.arg in ("init", "compare", "repr", "hash", "kw_only"):
                flag = ast.literal_eval(kw.value)
                if kw.arg == "init":
                    init = flag is True
                elif kw.arg == "compare":
                    compare = flag is True
                elif kw.arg == "kw_only" and flag is True:
                    raise ValueError("kw_only field")
            elif kw.arg != "metadata":
                raise ValueError("field option")
        return thunk, init, compare
    return _literal_thunk(value, env), True, True


def _class_body_ok(node, allowed_dunders=()):
    """Only annotations, plain methods, docstrings, ``pass`` and simple class attributes."""
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name in VALUE_DUNDERS and stmt.name not in allowed_dunders:
                return False
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        elif isinstance(stmt, (ast.Pass, ast.AnnAssign)):
            continue
        elif isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) and (not t.id.startswith("__") or t.id == "__slots__")
                                                  for t in stmt.targets):
            continue
        else:
            return False
    return True


def _own_text(node):
    return any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name in ("__str__", "__repr__", "__format__")
               for s in node.body)


def _dataclass_model(node, env=None):
    env = env or ProgramEnv()
    if len(node.decorator_list) != 1 or node.keywords or len(node.bases) > 1:
        return None
    base = None
    if node.bases and _dotted(node.bases[0]) != "object":
        # a modelled dataclass of the program (bound once, defined before): its fields come first
        base = env.models.get(_dotted(node.bases[0]))
        if base is None or base.kind != "dataclass":
            return None
    deco = node.decorator_list[0]
    options = {}
    if isinstance(deco, ast.Call):
        if _dotted(deco.func) not in DATACLASS_DECORATORS or deco.args:
            return None
        for kw in deco.keywords:
            if kw.arg not in DATACLASS_OPTIONS:
                return None
            options[kw.arg] = ast.literal_eval(kw.value)
    elif _dotted(deco) not in DATACLASS_DECORATORS:
        return None
    own_init = options.get("init", True) is False
    if options.get("eq", True) is not True or options.get("kw_only"):
        return None
    text = {"__str__", "__repr__", "__format__"}
    if not _class_body_ok(node, allowed_dunders=text | {"__init__"} if own_init else text):
        return None
    model = ClassModel(node.name, "dataclass")
    model.order = options.get("order") is True
    model.own_text = _own_text(node) or (base is not None and base.own_text)
    model.ancestors = (base.ancestors + (base.name,)) if base is not None else ()
    # (name, default thunk, init, compare) in field order: inherited fields keep their place, a field
    # declared again takes the new spec, new fields follow (as dataclasses orders them)
    specs = [list(spec) for spec in base.specs] if base is not None else []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        ann = ast.unparse(stmt.annotation)
        if "ClassVar" in ann:
            continue
        if "InitVar" in ann or "KW_ONLY" in ann:
            return None
        spec = [stmt.target.id, *_field_spec(stmt.value, env)]
        for i, old in enumerate(specs):
            if old[0] == spec[0]:
                specs[i] = spec
                break
        else:
            specs.append(spec)
    model.specs = tuple(tuple(spec) for spec in specs)
    fields, compare = [], []
    for name, thunk, init, cmp in specs:
        fields.append(name)
        if cmp:
            compare.append(len(fields) - 1)
        if own_init:
            continue
        if init:
            if thunk is _MISSING and any(p[1] is not _MISSING for p in model.params):
                return None  # CPython refuses the class (non-default after default)
            model.params.append((name, thunk, False))
        elif thunk is _MISSING:
            return None  # set later by the program's own code
        else:
            model.extra[name] = thunk
    if not compare:
        return None  # every instance equal to every other: not a value the judge keeps
    if own_init:
        params = _assigning_init(node, env)
        if params is None or sorted(p[0] for p in params) != sorted(fields):
            return None
        model.params, model.extra = params, {}
    model.fields, model.compare_index = tuple(fields), tuple(compare)
    return model


def _assigning_init(node, env=None):
    """The parameters of an ``__init__`` whose body only stores each parameter, unchanged, in the
    field of the same name (``self.x = x``), else None."""
    inits = [s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"]
    if len(inits) != 1:
        return None
    fn, spec = inits[0], inits[0].args
    if fn.decorator_list or spec.vararg or spec.kwarg or spec.posonlyargs or spec.kwonlyargs or not spec.args:
        return None
    me, names = spec.args[0].arg, [a.arg for a in spec.args[1:]]
    defaults = [None] * (len(names) - len(spec.defaults)) + list(spec.defaults)
    stored = set()
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
                and isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == me
                and isinstance(stmt.value, ast.Name) and stmt.value.id == stmt.targets[0].attr
                and stmt.value.id in names and stmt.value.id not in stored):
            return None
        stored.add(stmt.value.id)
    if stored != set(names):
        return None
    return [(n, _MISSING if d is None else _literal_thunk(d, env), False) for n, d in zip(names, defaults)]


def _namedtuple_class_model(node):
    if node.decorator_list or node.keywords or len(node.bases) != 1 or not _class_body_ok(node):
        return None
    base = node.bases[0]
    if isinstance(base, ast.Call) and _dotted(base.func) in NAMEDTUPLE_FACTORIES:
        # class P(namedtuple('P', 'x y')): methods on a namedtuple
        if any(isinstance(s, ast.AnnAssign) for s in node.body):
            return None
        inner = _namedtuple_call_model(node.name, base)
        return inner
    if _dotted(base) not in NAMEDTUPLE_BASES:
        return None
    model = ClassModel(node.name, "namedtuple")
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            thunk = _MISSING if stmt.value is None else _literal_thunk(stmt.value)
            model.params.append((stmt.target.id, thunk, False))
    model.fields = tuple(p[0] for p in model.params)
    return model if model.fields else None


def _namedtuple_call_model(name, call):
    if call.args[:1] and not (isinstance(call.args[0], ast.Constant) and call.args[0].value == name):
        return None
    if len(call.args) != 2:
        return None
    spec = ast.literal_eval(call.args[1])
    fields = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec)
    defaults = []
    for kw in call.keywords:
        if kw.arg != "defaults":
            return None
        defaults = list(ast.literal_eval(kw.value))
    if not fields or not all(isinstance(f, str) and f.isidentifier() and not f.startswith("_") for f in fields):
        return None
    model = ClassModel(name, "namedtuple")
    first_default = len(fields) - len(defaults)
    for i, f in enumerate(fields):
        thunk = _MISSING if i < first_default else (lambda v=defaults[i - first_default]: v)
        model.params.append((f, thunk, False))
    model.fields = tuple(fields)
    return model


def _builtin_subclass_model(node):
    if node.decorator_list or node.keywords or len(node.bases) != 1 or _dotted(node.bases[0]) not in BUILTIN_BASES:
        return None
    if not _class_body_ok(node) or any(isinstance(s, ast.AnnAssign) for s in node.body):
        return None
    model = ClassModel(node.name, "builtin")
    model.base = BUILTIN_BASES[_dotted(node.bases[0])]
    return model


ENUM_BASES = {"Enum": None, "enum.Enum": None, "IntEnum": int, "enum.IntEnum": int, "StrEnum": str, "enum.StrEnum": str}
ENUM_DECORATORS = {"unique", "enum.unique"}
ENUM_TEXT = {"__str__", "__repr__", "__format__"}


ENUM_AUTO = {"auto", "enum.auto"}


def _enum_auto_value(values):
    """What ``auto()`` gives after ``values`` in a plain ``Enum``: 1 first, then the last value + 1
    when the values are ints in increasing order (where CPython's versions agree), else not modelled."""
    if not values:
        return 1
    if not all(type(v) is int for v in values) or values[-1] != max(values):
        raise ValueError("auto() after values the judge does not order")
    return values[-1] + 1


def _is_enum_auto(call, env):
    """``auto()`` / ``enum.auto()`` without arguments, the name being the standard library's."""
    name = _dotted(call.func)
    if call.args or call.keywords or name not in ENUM_AUTO:
        return False
    if env is None:
        return True
    if name == "auto":
        return getattr(env, "imports", {}).get("auto") == ("enum", "auto")
    return getattr(env, "all_modules", {}).get("enum") == "enum"


def _enum_model(node, env=None):
    """``class Color(Enum)`` whose members are literal values or ``auto()`` and that has no lookup
    hooks of its own (``_missing_``, ``__new__``, ``__init__``, ``_generate_next_value_``): its members
    are the judge's own, read from the source (:class:`EnumMember`); ``Color(1)`` is found by value
    here, as ``Enum`` looks it up, and nothing about the members is read back from the program."""
    if node.keywords or len(node.bases) != 1 or _dotted(node.bases[0]) not in ENUM_BASES:
        return None
    if any(_dotted(d) not in ENUM_DECORATORS for d in node.decorator_list):
        return None
    model = ClassModel(node.name, "enum")
    model.own_text = _own_text(node)
    model.mixin = ENUM_BASES[_dotted(node.bases[0])]
    for stmt in node.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) or isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and (not stmt.name.startswith("_") or stmt.name in ENUM_TEXT):
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and not stmt.targets[0].id.startswith("_"):
            if isinstance(stmt.value, ast.Call) and _is_enum_auto(stmt.value, env):
                # StrEnum: the member's name in lower case; Enum / IntEnum: 1, then the last value + 1
                value = stmt.targets[0].id.lower() if model.mixin is str else _enum_auto_value([v for _, v in model.members])
            else:
                value = ast.literal_eval(stmt.value)
            if model.mixin is not None and type(value) is not model.mixin:
                return None  # CPython converts (IntEnum: int('1')); not modelled
            hash(value)
            if any(n == stmt.targets[0].id for n, _ in model.members):
                return None  # CPython refuses a member defined twice
            model.members.append((stmt.targets[0].id, value))
            continue
        return None
    return model if model.members else None


def _class_model(node, env=None):
    try:
        return (_dataclass_model(node, env) or _namedtuple_class_model(node) or _builtin_subclass_model(node)
                or _enum_model(node, env))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, ArithmeticError):
        return None  # (ArithmeticError: a default CPython refuses too, ``1 / 0``, ``1e308 ** 2``)


def program_names(program):
    """Module-level names of the program -> (kind, detail): see the comment above."""
    tree = ast.parse(program)
    found = {}

    def add(name, kind, detail=None):
        found.setdefault(name, []).append((kind, detail))

    def value_kind(name, value):
        if isinstance(value, ast.Lambda):
            return "function", None
        if isinstance(value, ast.Call) and _dotted(value.func) in NAMEDTUPLE_FACTORIES:
            try:
                model = _namedtuple_call_model(name, value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                model = None
            return ("model", model) if model is not None else ("other", None)
        return "other", None

    def bind(target, value):
        if isinstance(target, ast.Name):
            add(target.id, *value_kind(target.id, value))
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                bind(t, v)
        else:  # ``a, *b = ...``; ``C.attr = ...`` / ``d[k] = ...`` bind no name (their base is read)
            for n in ast.walk(target):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    add(n.id, "other")

    def stores(node):
        """Names stored by a statement outside nested functions / classes / lambdas."""
        todo = [node]
        while todo:
            n = todo.pop()
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                add(n.id, "other")
            if isinstance(n, ast.NamedExpr):  # classified with every walrus below
                todo.append(n.value)
                continue
            for child in ast.iter_child_nodes(n):
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    todo.append(child)

    def visit(body):
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                add(stmt.name, "function")
            elif isinstance(stmt, ast.ClassDef):
                add(stmt.name, "classdef", stmt)  # modelled below, once every binding is known
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    bind(target, stmt.value)
                stores(stmt.value)
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
                bind(stmt.target, stmt.value)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    add(alias.asname or alias.name.split(".")[0], "module", alias.name if alias.asname else alias.name.split(".")[0])
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if stmt.level == 0 and (stmt.module or "").split(".")[0] in SAFE_IMPORTS and alias.name != "*":
                        add(alias.asname or alias.name, "stdlib", (stmt.module, alias.name))
                    else:
                        add(alias.asname or alias.name, "other", ("from", stmt.module, alias.name) if stmt.level == 0 else None)
            elif isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, field, []) or [])
                for handler in getattr(stmt, "handlers", []) or []:
                    visit(handler.body)
                for part in ("target", "items", "test", "iter"):
                    sub = getattr(stmt, part, None)
                    for n in (sub if isinstance(sub, list) else [sub]):
                        if n is not None:
                            stores(n)
            else:
                stores(stmt)

    visit(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                add(name, "other")
        elif isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            add(node.target.id, *value_kind(node.target.id, node.value))
    # class statements, in source order, with what the judge knows of the other names (defaults such as
    # ``math.inf``, a base class modelled before)
    once = {name: b[0] for name, b in found.items() if len(b) == 1}
    env = ProgramEnv(modules={n: d for n, (k, d) in once.items() if k == "module" and d.split(".")[0] in SAFE_IMPORTS},
                     stdlib={n: d for n, (k, d) in once.items() if k == "stdlib"}, bound=found)
    env.imports = {n: (d if k == "stdlib" else d[1:]) for n, (k, d) in once.items()
                   if k == "stdlib" or (k == "other" and isinstance(d, tuple) and d[:1] == ("from",))}
    env.all_modules = {n: d for n, (k, d) in once.items() if k == "module"}
    for name, bindings in found.items():
        for i, (kind, node) in enumerate(bindings):
            if kind == "classdef":
                bindings[i] = ("class", node)
    for name, bindings in sorted(((n, b) for n, b in found.items() if b[0][0] == "class" and isinstance(b[0][1], ast.ClassDef)),
                                 key=lambda nb: (nb[1][0][1].lineno, nb[1][0][1].col_offset)):
        for i, (kind, node) in enumerate(bindings):
            if isinstance(node, ast.ClassDef):
                model = _class_model(node, env) if len(bindings) == 1 else None
                bindings[i] = ("model", model) if model is not None else ("class", None)
                if model is not None:
                    env.models[name] = model
    out = {}
    for name, bindings in found.items():
        kinds = {k for k, _ in bindings}
        if len(bindings) == 1 and kinds <= {"model", "stdlib"}:
            out[name] = bindings[0]
        elif kinds == {"module"}:
            out[name] = ("module", None)
        elif kinds & {"model", "class"}:
            out[name] = ("class", None)  # a class statement among several bindings
        else:
            out[name] = ("function", None)
    return out


def _stdlib_object(module, name):
    """``from module import name`` done here, with the real standard library."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception:
        return _MISSING


class EnumMember:
    """A member of an enum the judge models, the judge's own (one object per member): its class, name
    and value come from the program's source, so equality, hashing, ``is``, ``.name`` and ``.value``
    are the judge's; a member the program returns arrives as its class and name and is this same object.
    Methods of the enum, and ``str`` / ``repr`` when the enum defines its own, are asked of the
    program's member of that name (the program answering, as a method call does)."""

    __slots__ = ("_model", "_cls", "_name", "_value", "_handle")

    def __init__(self, model, name, value):
        for slot, v in (("_model", model), ("_cls", model.name), ("_name", name), ("_value", value), ("_handle", None)):
            object.__setattr__(self, slot, v)

    def __getattr__(self, name):
        if name in ("name", "_name_"):
            return self._name
        if name in ("value", "_value_"):
            return self._value
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._own(), name)

    def __setattr__(self, name, value):
        raise AttributeError("cannot reassign members of an enum")

    def _own(self):
        """The program's member of this name (a handle), asked once per executor."""
        handle = self._handle
        if handle is None or handle._executor is not _JUDGE.executor or not handle._executor.alive():
            handle = _JUDGE.materialize(self)
            object.__setattr__(self, "_handle", handle)
        return handle

    def _adopt(self, handle):
        if isinstance(handle, RemoteObject):
            object.__setattr__(self, "_handle", handle)

    def __reduce__(self):
        raise TypeError("enum members of the program are not copied")

    def __str__(self):
        return str(self._own()) if self._model.own_text else "%s.%s" % (self._cls, self._name)

    def __repr__(self):
        return repr(self._own()) if self._model.own_text else "<%s.%s: %r>" % (self._cls, self._name, self._value)

    def __format__(self, spec):
        return format(str(self), spec)


class _MixinMember:
    """Shared behaviour of the judge's members of an ``IntEnum`` / ``StrEnum``: the value itself (an
    ``int`` / ``str``, compared and hashed as one) with the member's name."""

    _judge_enum_member = True

    def _init(self, model, name):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_cls", model.name)
        object.__setattr__(self, "_name", name)

    @property
    def name(self):
        return self._name

    _name_ = name

    def __setattr__(self, name, value):
        raise AttributeError("cannot reassign members of an enum")

    def __reduce__(self):
        raise TypeError("enum members of the program are not copied")

    def __repr__(self):
        return "<%s.%s: %r>" % (self._cls, self._name, self.value)


class IntEnumMember(_MixinMember, int):
    def __new__(cls, model, name, value):
        self = int.__new__(cls, value)
        self._init(model, name)
        return self

    @property
    def value(self):
        return int(self)

    _value_ = value

    def __str__(self):
        return int.__repr__(self)


class StrEnumMember(_MixinMember, str):
    def __new__(cls, model, name, value):
        self = str.__new__(cls, value)
        self._init(model, name)
        return self

    @property
    def value(self):
        return str.__str__(self)

    _value_ = value

    def __str__(self):
        return str.__str__(self)


_MIXIN_MEMBERS = {int: IntEnumMember, str: StrEnumMember}


class ModelClass:
    """What the test sees for a class of the program that the judge models: calling it builds the
    value here, from the test's own arguments (the program never sees the call); anything else
    (class attributes, static methods, passing the class itself) goes to the program's class."""

    __slots__ = ("_remote", "_model")
    _sandbox_handle = True

    def __init__(self, remote, model):
        object.__setattr__(self, "_remote", remote)
        object.__setattr__(self, "_model", model)

    def __call__(self, *args, **kwargs):
        if self._model.kind == "enum":
            return self._model.member_for(args, kwargs)
        return self._model.build(args, kwargs)

    # an enum's members are the judge's, from the source: never read back from the program's class
    def __getattr__(self, name):
        if self._model.kind == "enum" and self._model.canonical(name) is not None:
            return self._model.member(name)
        return getattr(self._remote, name)

    def __getitem__(self, key):
        if self._model.kind == "enum":
            if type(key) is str and self._model.canonical(key) is not None:
                return self._model.member(key)
            raise KeyError(key)
        return self._remote[key]

    def __iter__(self):
        if self._model.kind == "enum":
            return iter(self._model.canonical_members())
        return iter(self._remote)

    def __len__(self):
        if self._model.kind == "enum":
            return len(self._model.canonical_members())
        return len(self._remote)

    def __contains__(self, item):
        if self._model.kind == "enum":
            members = self._model.canonical_members()
            return any(item is m for m in members) or (not isinstance(item, (EnumMember, _MixinMember))
                                                     and any(m.value == item for m in members))
        return item in self._remote

    def __instancecheck__(self, obj):
        model = self._model
        if isinstance(obj, (EnumMember, _MixinMember)):
            return model.kind == "enum" and obj._model is model
        if isinstance(obj, Record):  # noqa: F821
            # a record of this class or of a modelled dataclass that derives from it
            own = Record.MODELS.get(obj._name)  # noqa: F821
            if obj._name == model.name and obj._fields == model.fields:
                return True
            if own is not None and own.fields == obj._fields and model.name in own.ancestors:
                return True
        if model.kind == "namedtuple" and isinstance(obj, tuple) and type(obj).__name__ == model.name \
                and getattr(type(obj), "_fields", None) == model.fields:
            return True
        return isinstance(obj, self._remote)

    def __eq__(self, other):
        if isinstance(other, ModelClass):
            other = other._remote
        return self._remote == other

    def __hash__(self):
        return hash(self._remote)

    def __repr__(self):
        return "<class %s of the program>" % self._model.name


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
        self.kinds = {}
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
        callbacks = {}
        # the request hands over its target and the handles among its arguments, and with each handle
        # what the test handed over to get it (``t.inc`` is a handle got by handing over ``t``)
        handed = {obj._hid} | set(obj._grant)
        msg = {"k": kind, "target": obj._hid}
        # a call of a class of the program (a class statement the judge does not model) builds an
        # object (the judge's reading of the program's source, never the executor's word)
        builds = kind == "call" and obj._kind == "class"
        if kind == "call":
            args, kwargs = fields["args"], fields["kwargs"]
            msg["args"] = ex.encode(tuple(args), callbacks, handed)
            msg["kwargs"] = ex.encode(dict(kwargs), callbacks, handed)
            if builds:
                msg["as_handle"] = True
        else:
            msg["op"] = fields["op"]
            if "arg" in fields:
                msg["arg"] = ex.encode(fields["arg"], callbacks, handed)
        resolve = self._resolve_from(ex, callbacks, frozenset(handed))
        reply = ex.request(msg, self.deadline, callbacks, resolve)
        if reply["k"] == "exc":
            raise _candidate_exception(reply)
        raw = reply.get("v")
        known = isinstance(raw, dict) and isinstance(raw.get("h"), list) and len(raw["h"]) > 0 \
            and type(raw["h"][0]) is int and raw["h"][0] in ex.seen
        try:
            value = decode_value(raw, resolve)  # noqa: F821
            if kind == "call":
                _write_back(fields["args"], fields["kwargs"], reply.get("mut"), resolve)
        except CodecError as exc:  # noqa: F821
            ex.kill()
            raise CandidateCrashed("bad reply: %s" % exc)
        if builds:
            if not isinstance(value, RemoteObject):
                ex.kill()
                raise CandidateCrashed("bad reply: a built object must come back as a handle")
            if known:
                ex.shared.add(value._hid)  # an object that existed already: never the test's own
            value = type(value)(ex, value._hid, obj._label, built=True)
        return value

    def enum_member(self, ex, v, resolve):
        """``{"em": [class, member, handle]}`` from the executor: the judge's member of an enum it
        models (the program's word is only which member it answers), else the object's handle."""
        if not (isinstance(v, list) and len(v) == 4 and type(v[0]) is str and type(v[1]) is str):
            raise CodecError("malformed enum member")  # noqa: F821
        ref = None
        if v[2] is not None:
            if not (isinstance(v[2], dict) and list(v[2]) == ["h"]):
                raise CodecError("malformed enum member")  # noqa: F821
            ref = resolve("h", v[2]["h"])
        kind, model = self.kinds.get(v[0], (None, None))
        if kind == "model" and model.kind == "enum" and model.canonical(v[1]) is not None:
            member = model.member(v[1])
            if isinstance(member, EnumMember) and isinstance(ref, RemoteObject) \
                    and (member._handle is None or member._handle._executor is not ref._executor):
                member._adopt(ref)
            return member
        if v[3] is not None:  # an IntEnum / StrEnum member of a class the judge does not model: its value
            value = decode_value(v[3])  # noqa: F821
            if type(value) not in (int, str):
                raise CodecError("malformed enum member")  # noqa: F821
            return value
        if ref is None:
            raise CodecError("enum member without a handle")  # noqa: F821
        return ref

    def materialize(self, record):
        """The program's own instance for a value the judge built (to call its methods): the test
        hands the value to the program."""
        ex = self.ensure_executor()
        callbacks = {}
        msg = {"k": "op", "target": 0, "op": "own", "arg": ex.encode(record, callbacks)}
        reply = ex.request(msg, self.deadline, callbacks, self._resolve_from(ex, callbacks))
        if reply["k"] == "exc":
            raise _candidate_exception(reply)
        value = decode_value(reply.get("v"), self._resolve_from(ex, callbacks))  # noqa: F821
        if not isinstance(value, RemoteObject):
            raise TypeError("the program could not rebuild a %s" % (record._cls if isinstance(record, EnumMember) else record._name))
        return value

    def _resolve_from(self, ex, callbacks, grant=frozenset()):
        def resolve(tag, v):
            if tag == "h" and isinstance(v, list) and len(v) in (2, 3) and type(v[0]) is int:
                ex.seen.add(v[0])
                cls = RemoteIteratorObject if len(v) == 3 else RemoteObject
                return cls(ex, v[0], str(v[1])[:100], grant=grant)
            if tag == "em":  # an enum member of the program: the judge's own member when it models the class
                return self.enum_member(ex, v, resolve)
            if tag == "cb" and type(v) is int and v in callbacks:
                return callbacks[v]  # one of the test's own callables, handed back
            if tag == "nt":  # a namedtuple of a class the judge models gets that class's methods
                kind, model = self.kinds.get(type(v).__name__, (None, None))
                if kind == "model" and model.kind == "namedtuple" and model.fields == type(v)._fields:
                    return model.tuple_of(v)
                return v
            if tag == "dc":
                return v  # a record: data, as received
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
        ex = Executor(self.job, self.chroot, self.workdir, self.kinds)
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
            self.kinds = program_names(job["program"])
            Record.MODELS = {n: d for n, (k, d) in self.kinds.items() if k == "model" and d.kind == "dataclass"}  # noqa: F821
            Record.MATERIALIZE = self.materialize  # noqa: F821
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
            # test code given as one string runs in order in one namespace: what a statement between
            # two asserts assigns (``result = rle('aaab')``) is seen by the asserts after it
            sequential = bool(job.get("sequential"))
            carry = {}
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
                    # several builtin-named definitions of the program composed by one test and no
                    # entry point naming one: the test must pass with each of them as the entry point
                    for choice in self.builtin_choices(base, ex, used):
                        ns = self.namespace(base, ex, used, modules, choice)
                        if not sequential:
                            exec(code, ns)
                            continue
                        ns.update(carry)
                        before = dict(ns)
                        try:
                            exec(code, ns)
                        finally:
                            carry.update((k, v) for k, v in ns.items() if k not in before or before[k] is not v)

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

    def builtin_choices(self, base, ex, used):
        """Which builtin-named definition of the program a test may call (None: the rule of
        :meth:`namespace` alone): each one in turn when the test uses several and calls no other name of
        the program and the row names no entry point (``list(sorted(xs))`` with both defined)."""
        entry = self.job.get("entry_point") or ""
        names = set(ex.names) | set(ex.values)
        shadowing = sorted(n for n in names if n in used and n not in base and hasattr(builtins, n))
        primary = [n for n in names if n in used and n not in base and not hasattr(builtins, n)]
        if entry or primary or len(shadowing) < 2:
            return [None]
        return shadowing

    def namespace(self, base, ex, used, modules=(), choice=None):
        """The test's globals: trusted setup first (never overridden), then what the candidate
        defines. Names the test calls are the real builtins, except the task's entry point: the row's
        ``entry_point`` when it names one, else a builtin-named definition the test calls when it calls
        no other name of the program (``assert pow(2, 3) == 8`` tests the candidate's ``pow``; with
        several, ``choice``: each in turn, see :meth:`builtin_choices`); when the test calls another
        name of the program (``assert len(f(1)) == 3``), builtin-named definitions stay the
        candidate's own helpers.
        A name the test reads as a module (``modules``: ``math`` in ``math.isclose(...)``) is never
        the candidate's: it is the module when the setup or one of the program's allow-listed
        ``import`` statements (run here, see :func:`candidate_safe_imports`) provides it, else unbound."""
        ns = dict(base)
        candidate = dict(ex.values)
        candidate.update(ex.names)
        for name in modules:
            candidate.pop(name, None)
        for name, (kind, detail) in self.kinds.items():
            if kind == "module":
                candidate.pop(name, None)
            elif kind == "model" and isinstance(candidate.get(name), RemoteObject):
                candidate[name] = ModelClass(candidate[name], detail)
            elif kind == "stdlib" and name in candidate:
                real = _stdlib_object(*detail)
                if real is not _MISSING:
                    candidate[name] = real
        primary = [n for n in candidate if n in used and n not in base and not hasattr(builtins, n)]
        entry = self.job.get("entry_point") or ""
        for name, value in candidate.items():
            if name in base:
                continue
            if hasattr(builtins, name):
                if entry:
                    if name != entry:
                        continue
                elif primary or name not in used or (choice is not None and name != choice):
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
    """An exception raised in the sandbox, re-created here as the nearest builtin exception class
    (its own if builtin, else the first builtin base it names: ``class BadInput(ValueError)`` is
    caught by ``except ValueError``), anything else as CandidateError. The program could raise any
    builtin exception itself, so the names it reports grant nothing."""
    etype = str(reply.get("type", ""))
    emsg = str(reply.get("msg", ""))[:300]
    bases = reply.get("bases")
    names = [etype] + ([str(b) for b in bases[:20]] if isinstance(bases, list) else [])
    for name in names:
        cls = getattr(builtins, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins" \
                and not issubclass(cls, (StopIteration, StopAsyncIteration)):
            try:
                return cls(emsg)
            except Exception:
                continue
    return CandidateError("%s: %s" % (etype, emsg))


def _write_back(args, kwargs, mutations, resolve):
    """Apply the executor's report of in-place changes to the test's own arguments, in place at
    every level (a list inside a list or a tuple, a dict's list value), so that the test's other
    references to the inner objects see the change too."""
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
        _merge(target, decode_value(enc, resolve))  # noqa: F821


_MERGEABLE = (list, dict, set, bytearray)


def _merge(target, new, depth=0):
    """Make the mutable containers in ``target`` hold ``new``; immutable parts must be unchanged."""
    if type(new) is not type(target) or depth > 100:
        raise CodecError("mutation changed the type")  # noqa: F821
    t = type(target)
    if t is tuple:
        if len(new) != len(target):
            raise CodecError("mutation of a tuple")  # noqa: F821
        for old, now in zip(target, new):
            if type(old) in _MERGEABLE or type(old) is tuple:
                _merge(old, now, depth + 1)
            elif not (old is now or old == now):
                raise CodecError("mutation of a tuple")  # noqa: F821
    elif t is list:
        for i in range(min(len(target), len(new))):
            if type(target[i]) in (list, dict) and type(new[i]) is type(target[i]):
                _merge(target[i], new[i], depth + 1)
            else:
                target[i] = new[i]
        del target[len(new):]
        target.extend(new[len(target):])
    elif t is dict:
        for k in [k for k in target if k not in new]:
            del target[k]
        for k, v in new.items():
            if k in target and type(target[k]) in (list, dict) and type(v) is type(target[k]):
                _merge(target[k], v, depth + 1)
            else:
                target[k] = v
    elif t in (set, bytearray):
        if t is set:
            target.clear()
            target.update(new)
        else:
            target[:] = new
    else:
        raise CodecError("mutation of an immutable value")  # noqa: F821


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
