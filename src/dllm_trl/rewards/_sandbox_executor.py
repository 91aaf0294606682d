"""Executor: the process that runs UNTRUSTED candidate code (code reward).

Standalone program (stdlib only). The judge starts it as ``python -I -S -c <_processes + codec + this file>``
with an empty environment; it starts with the judge's privileges (root when the trainer is root),
and before any candidate code runs it:

1. moves its channel off fds 0/1 (fresh descriptors) and points 0/1/2 at /dev/null, so prints
   cannot reach the protocol stream or the judge's output;
2. reads its configuration + the candidate program (first message);
3. pre-imports a list of stdlib modules (so they work even when the stdlib is unreadable later);
4. sets resource limits (CPU, address space, file size, open files, processes/threads, core
   dumps, locked memory, message queues);
5. chroot()s into the judge-prepared private root (tmpfs + read-only bind mounts of the stdlib)
   when the judge could create a mount namespace, else chdir()s into the scratch folder;
6. when root: drops ALL privileges to a fresh unused uid/gid (setgroups([]) + setresgid +
   setresuid, verified), which also makes RLIMIT_NPROC effective (the kernel ignores it for root);
   then PR_SET_PDEATHSIG=SIGKILL (after the credential change, which clears it);
7. PR_SET_NO_NEW_PRIVS, then a seccomp filter (x86_64 / aarch64) that makes kill/tkill/tgkill/
   sigqueue/pidfd_send_signal, ptrace, process_vm_readv/writev, socket() (any family), mount,
   umount, pivot_root, chroot, unshare, setns, bpf, perf_event_open, keyctl, userfaultfd and
   io_uring fail with EPERM;
8. clears the environment; reports what was enforced ("boot" message, sent before any candidate
   code runs, hence authentic), then executes the candidate program, reports its globals
   ("loaded": callables and other objects as handle numbers, data as values) and serves requests:
   calls and operations (attribute, ``len``, iteration in chunks, indexing, item assignment,
   ``str`` / ``repr``, ``float`` / ``int``, ``with``, ``isinstance``) on handles, answering each with
   data, new handles, and the new state of mutated arguments; a callable the judge passed becomes a
   stub that asks the judge to run it (nested requests are served meanwhile). Iterators stay here
   (a module-level ``itertools.count()`` is not consumed at load). A call the judge counts as
   building an object is answered with the object's handle. Records / namedtuples the judge built
   from its model of a class of the program are rebuilt here as instances of that class.

After step 8 nothing this process sends is trusted: the judge treats every reply as data.
"""

import builtins
import os
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

_SECCOMP_TABLES = {
    # arch audit id, blocked syscall numbers, socket nr, x32 bit
    "x86_64": (
        0xC000003E,
        [62, 200, 234, 129, 297, 424, 101, 310, 311, 272, 308, 165, 166, 155, 161, 321, 298, 250, 248, 249,
         425, 426, 427, 323],
        41,
        True,
    ),
    "aarch64": (
        0xC00000B7,
        [129, 130, 131, 138, 240, 424, 117, 270, 271, 97, 268, 40, 39, 41, 51, 280, 241, 219, 217, 218,
         425, 426, 427, 282],
        198,
        False,
    ),
}


def _install_seccomp(libc, ctypes):
    import struct

    machine = os.uname().machine.lower()
    if machine in ("amd64",):
        machine = "x86_64"
    if machine in ("arm64",):
        machine = "aarch64"
    if machine not in _SECCOMP_TABLES:
        return "unsupported-arch"
    arch, blocked, socket_nr, x32 = _SECCOMP_TABLES[machine]
    LD_W_ABS, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
    ALLOW, ERRNO_EPERM, KILL = 0x7FFF0000, 0x00050000 | 1, 0x80000000
    prog = [
        (LD_W_ABS, 0, 0, 4),  # arch
        (JEQ, 1, 0, arch),
        (RET, 0, 0, KILL),
        (LD_W_ABS, 0, 0, 0),  # syscall nr
    ]
    if x32:
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, ERRNO_EPERM)]
    for nr in blocked:
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, ERRNO_EPERM)]
    prog += [
        (JEQ, 0, 1, socket_nr),  # socket(): no new sockets of any family (socketpair stays allowed)
        (RET, 0, 0, ERRNO_EPERM),
        (RET, 0, 0, ALLOW),
    ]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return "failed errno=%d" % ctypes.get_errno()
    return "on"


def _boot():
    # 1. private channel fds, /dev/null on 0/1/2
    rfd, wfd = quiet_stdio(0, 1)  # noqa: F821 (_processes.py prepended)
    try:
        sys.stdin = open(os.devnull, "r")
    except Exception:
        pass

    # 2. configuration + program
    cfg = recv_msg(rfd, deadline=None, max_bytes=64 << 20)  # noqa: F821 (codec prepended)
    program = cfg["program"]
    iso = {}

    def fail(reason):
        try:
            send_msg(wfd, {"k": "boot_error", "e": reason})  # noqa: F821
        finally:
            os._exit(3)

    # 3. preload stdlib modules
    for name in cfg.get("preload", []):
        try:
            __import__(name)
        except Exception:
            pass
    import ctypes
    import resource
    import signal

    libc = ctypes.CDLL(None, use_errno=True)

    # 4. resource limits
    lim = cfg["limits"]
    want = {
        "RLIMIT_CPU": lim["cpu_s"],
        "RLIMIT_AS": lim["as_bytes"],
        "RLIMIT_FSIZE": lim["fsize_bytes"],
        "RLIMIT_NOFILE": lim["nofile"],
        "RLIMIT_NPROC": lim["nproc"],
        "RLIMIT_CORE": 0,
        "RLIMIT_MEMLOCK": 0,
        "RLIMIT_MSGQUEUE": 0,
    }
    for name, value in want.items():
        res = getattr(resource, name, None)
        if res is None:
            continue
        try:
            if name == "RLIMIT_CPU":
                resource.setrlimit(res, (value, value + 1))
            else:
                resource.setrlimit(res, (value, value))
        except (ValueError, OSError) as exc:
            if name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE"):
                fail("setrlimit %s: %s" % (name, exc))
    iso["rlimits"] = {k: v for k, v in want.items()}

    # 5. filesystem view
    try:
        if cfg.get("chroot"):
            os.chroot(cfg["chroot"])
            os.chdir("/tmp")
            iso["fs"] = "chroot"
        else:
            os.chdir(cfg["workdir"])
            iso["fs"] = "chdir"
    except OSError as exc:
        fail("filesystem setup: %s" % exc)

    # 6. drop privileges
    if os.geteuid() == 0:
        uid, gid = cfg.get("uid"), cfg.get("gid")
        if uid is None or gid is None or uid == 0 or gid == 0:
            fail("running as root without a sandbox uid")
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            fail("privilege drop: %s" % exc)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
            fail("privilege drop not effective")
        try:
            os.setuid(0)
            fail("could regain root")
        except PermissionError:
            pass
        iso["uid"] = uid
    else:
        iso["uid"] = os.getuid()
    iso["root"] = os.geteuid() == 0
    # parent-death signal (set after the credential change, which would clear it)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != cfg["judge_pid"]:
        os._exit(3)

    # 7. no new privileges + seccomp
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("PR_SET_NO_NEW_PRIVS failed")
    iso["no_new_privs"] = True
    mode = cfg.get("seccomp", "auto")
    if mode != "off":
        try:
            state = _install_seccomp(libc, ctypes)
        except Exception as exc:
            state = "failed %s" % type(exc).__name__
        if state != "on" and mode == "require":
            fail("seccomp: %s" % state)
        iso["seccomp"] = state
    else:
        iso["seccomp"] = "off"

    # 8. clean environment, argv; report; then run the candidate
    os.environ.clear()
    sys.argv = ["<candidate>"]
    send_msg(wfd, {"k": "boot", "iso": iso})  # noqa: F821
    del cfg, lim, want, libc
    return rfd, wfd, program


_MUTABLE = (list, dict, set, bytearray)
class _Session:
    """The executor side of the protocol: candidate objects are kept in a handle table (only their
    handle number travels), judge callables arrive as callback stubs, iterators stay here and are
    consumed on request. Values the judge built from its own model of a class of the program arrive
    as records / namedtuples and are rebuilt as instances of that class (``program``)."""

    def __init__(self, rfd, wfd, program):
        self.rfd, self.wfd = rfd, wfd
        self.program = program
        self.objects = {}
        self.handles = {}
        self.next_cb = 0

    # values -----------------------------------------------------------------------------------
    def handle(self, obj):
        cb = getattr(obj, "_judge_callback", None) if type(obj) is _Callback else None
        if cb is not None:
            return {"cb": cb}
        key = id(obj)
        hid = self.handles.get(key)
        if hid is None:
            hid = len(self.objects) + 1
            self.handles[key] = hid
            self.objects[hid] = obj
        ref = [hid, str(getattr(type(obj), "__name__", "?"))[:100]]
        if _is_iterator(obj):  # noqa: F821 (codec prepended)
            ref.append(1)
        return {"h": ref}

    def resolve(self, tag, v):
        if tag == "h" and type(v) is int and v in self.objects:
            return self.objects[v]
        if tag == "cb" and type(v) is int:
            return _Callback(self, v)
        if tag == "dc":
            return self.rebuild_record(v)
        if tag == "em":  # a member of an enum of the program, named by the judge
            cls = self.program.get(v[0])
            if isinstance(cls, type) and isinstance(getattr(cls, "_member_map_", None), dict):
                return cls[v[1]]
            raise CodecError("unknown enum")  # noqa: F821
        if tag == "nt":
            cls = self.program.get(type(v).__name__)
            if isinstance(cls, type) and issubclass(cls, tuple) and getattr(cls, "_fields", None) == type(v)._fields:
                return tuple.__new__(cls, tuple(v))
            return v
        raise CodecError("unknown reference")  # noqa: F821

    def rebuild_record(self, record):
        """A dataclass value the judge built: an instance of the program's class of that name, its
        fields set as given (the constructor is not run: the judge's value is the meaning of the call)."""
        cls = self.program.get(record._name)
        spec = getattr(cls, "__dataclass_fields__", None) if isinstance(cls, type) else None
        if not isinstance(spec, dict) or list(record._fields) != _dataclass_fields_of(spec):
            return record
        obj = object.__new__(cls)
        for name, value in zip(record._fields, record._values):
            object.__setattr__(obj, name, value)
        return obj

    def encode(self, value):
        return encode_value(value, self.handle, lazy=True)  # noqa: F821

    def decode(self, value):
        return decode_value(value, self.resolve)  # noqa: F821

    # requests ---------------------------------------------------------------------------------
    def serve(self, req):
        rid = req.get("id")
        try:
            op = req.get("k")
            if op == "op" and req.get("op") == "own":  # a value the judge built, as the program's instance
                obj = self.decode(req["arg"])
                send_msg(self.wfd, {"k": "ret", "id": rid, "v": self.handle(obj), "mut": []})  # noqa: F821
                return
            target = self.resolve("h", req.get("target"))
            if op == "call":
                args, kwargs = self.decode(req["args"]), self.decode(req["kwargs"])
                result = target(*args, **kwargs)
                # a call the judge counts as building a value: the object itself, as a handle
                v = self.handle(result) if req.get("as_handle") is True else self.encode(result)
                payload = {"k": "ret", "id": rid, "v": v, "mut": self.mutations(req, args, kwargs)}
            else:
                arg = self.decode(req["arg"]) if "arg" in req else None
                result = self.operation(target, req.get("op"), arg)
                payload = {"k": "ret", "id": rid, "v": self.encode(result), "mut": []}
        except BaseException as exc:
            etype = type(exc)
            bases = [c.__name__ for c in getattr(etype, "__mro__", ())[1:] if getattr(c, "__module__", "") == "builtins"][:20]
            payload = {"k": "exc", "id": rid, "type": getattr(etype, "__name__", "?")[:100], "msg": str(exc)[:300],
                       "bases": [str(b)[:100] for b in bases]}
        send_msg(self.wfd, payload)  # noqa: F821

    def operation(self, target, kind, arg):
        if kind == "getattr":
            return getattr(target, str(arg))
        if kind == "setattr":
            name, value = arg
            setattr(target, str(name), value)
            return None
        if kind == "len":
            return len(target)
        if kind == "iter":  # the first items, and the iterator when there are more
            return self.take(iter(target), 16)
        if kind == "take":
            return self.take(target, max(1, min(int(arg), 4096)))
        if kind == "getitem":
            return target[arg]
        if kind == "setitem":
            key, value = arg
            target[key] = value
            return None
        if kind == "delitem":
            del target[arg]
            return None
        if kind == "str":
            return str(target)
        if kind == "repr":
            return repr(target)
        if kind in ("float", "int", "complex"):
            return {"float": float, "int": int, "complex": complex}[kind](target)
        if kind == "index":
            return type(target).__index__(target)
        if kind == "enter":
            return type(target).__enter__(target)
        if kind == "exit":
            type(target).__exit__(target, None, None, None)
            return None
        if kind == "isinstance":
            return isinstance(target, arg)
        raise ValueError("unknown operation")

    def take(self, iterator, n):
        items = []
        for item in iterator:
            items.append(item)
            if len(items) >= n:
                return [items, iterator]
        return [items, None]

    def mutations(self, req, args, kwargs):
        """New state of the mutable arguments that the call changed (in-place mutation)."""
        out = []
        sent_args = req["args"].get("t", []) if isinstance(req["args"], dict) else []
        for i, (value, sent) in enumerate(zip(args, sent_args)):
            if type(value) in _MUTABLE or type(value) is tuple:
                now = self.encode(value)
                if now != sent:
                    out.append([i, now])
        sent_kwargs = {}
        if isinstance(req["kwargs"], dict):
            for kv in req["kwargs"].get("d", []):
                if isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str):
                    sent_kwargs[kv[0]] = kv[1]
        for key, value in kwargs.items():
            if (type(value) in _MUTABLE or type(value) is tuple) and key in sent_kwargs:
                now = self.encode(value)
                if now != sent_kwargs[key]:
                    out.append([key, now])
        return out

    def callback(self, fid, args, kwargs):
        """Call a judge callable: send the request, serve nested calls until its reply arrives."""
        self.next_cb += 1
        cid = self.next_cb
        send_msg(self.wfd, {"k": "cb", "id": cid, "fn": fid, "args": self.encode(tuple(args)),  # noqa: F821
                            "kwargs": self.encode(dict(kwargs))})
        while True:
            msg = recv_msg(self.rfd, deadline=None)  # noqa: F821
            kind = msg.get("k")
            if kind in ("call", "op"):
                self.serve(msg)
            elif kind == "cbret" and msg.get("id") == cid:
                return self.decode(msg.get("v"))
            elif kind == "cbexc" and msg.get("id") == cid:
                etype = getattr(builtins, str(msg.get("type")), None)
                if not (isinstance(etype, type) and issubclass(etype, Exception)):
                    etype = RuntimeError
                raise etype(str(msg.get("msg", ""))[:300])
            else:
                os._exit(4)


def _dataclass_fields_of(spec):
    return [name for name, f in spec.items() if getattr(getattr(f, "_field_type", None), "name", "") == "_FIELD"]


class _Callback:
    """Stands for a callable of the test (e.g. ``key=len``); calling it asks the judge."""

    __slots__ = ("_session", "_judge_callback")

    def __init__(self, session, fid):
        self._session = session
        self._judge_callback = fid

    def __call__(self, *args, **kwargs):
        return self._session.callback(self._judge_callback, args, kwargs)


def _serve(rfd, wfd, program):
    import types

    g = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        code = compile(program, "<candidate>", "exec")
        exec(code, g)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt included
        send_msg(wfd, {"k": "load_error", "e": "%s: %s" % (type(exc).__name__, str(exc)[:300])})  # noqa: F821
        os._exit(0)
    session = _Session(rfd, wfd, g)
    names, values = {}, {}
    for name, value in list(g.items())[:10000]:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            continue
        try:
            if callable(value):
                names[name] = session.handle(value)["h"][0]
            else:
                values[name] = session.encode(value)
        except Exception:
            continue
    send_msg(wfd, {"k": "loaded", "names": names, "values": values})  # noqa: F821
    while True:
        req = recv_msg(rfd, deadline=None)  # noqa: F821
        if req.get("k") not in ("call", "op"):
            os._exit(4)
        session.serve(req)


def main():
    rfd, wfd, program = _boot()
    try:
        _serve(rfd, wfd, program)
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
