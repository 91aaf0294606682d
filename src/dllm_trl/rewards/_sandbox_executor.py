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
   calls and operations (attribute, ``len``, iteration, indexing, ``str``) on handles,
   answering each with data, new handles, and the new state of mutated arguments; a callable the
   judge passed becomes a stub that asks the judge to run it (nested requests are served
   meanwhile). The reply to a call of a *class* also names the object it made (a handle) and, for
   a dataclass instance, the constructor's field parameters, so that the judge can check the value
   against the test's own arguments; such an object, until the test hands it to the program, is
   sent back as that handle wherever it appears in a reply (a class that returns one shared
   instance cannot answer with the object the test just built).

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
# taken before the candidate runs (it may patch builtins in this process)
_TYPE, _ISSUBCLASS, _ID, _GETATTR = type, issubclass, id, getattr
_REAL_SUBCLASS = type.__subclasscheck__  # the MRO itself, never a metaclass's __subclasscheck__
# results of a class call that are not tracked as built objects: values without identity worth
# tracking, and often shared (small ints, interned strings, the empty tuple)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset, range)


class _Session:
    """The executor side of the protocol: candidate objects are kept in a handle table (only their
    handle number travels), judge callables arrive as callback stubs."""

    def __init__(self, rfd, wfd):
        self.rfd, self.wfd = rfd, wfd
        self.objects = {}
        self.handles = {}
        self.next_cb = 0
        self.built = {}  # id -> handle of objects made by the test's class calls, not yet handed over

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
        return {"h": [hid, str(getattr(type(obj), "__name__", "?"))[:100]]}

    def resolve(self, tag, v):
        if tag == "h" and type(v) is int and v in self.objects:
            obj = self.objects[v]
            self.built.pop(_ID(obj), None)  # the test hands it to the program: no longer held back
            return obj
        if tag == "cb" and type(v) is int:
            return _Callback(self, v)
        raise CodecError("unknown reference")  # noqa: F821

    def encode(self, value):
        return encode_value(value, self.handle, intercept=self.held_back if self.built else None)  # noqa: F821

    def held_back(self, obj):
        hid = self.built.get(_ID(obj))
        if hid is not None and self.objects.get(hid) is obj:
            return {"h": [hid, str(_GETATTR(_TYPE(obj), "__name__", "?"))[:100]]}
        return None

    def construction(self, target, result, known):
        """What the judge needs about a call of the class ``target`` that gave ``result``: the
        object's handle, whether it is an instance of ``target`` and, for a dataclass instance, the
        fields its constructor takes, in order (None where it takes an InitVar, not a field).
        Registers the object as built by the test."""
        ref = self.handle(result)
        if "h" not in ref:
            return {"obj": None}  # one of the judge's own callables, handed back
        hid = ref["h"][0]
        info = {"obj": hid, "own": False}
        try:
            info["own"] = bool(_REAL_SUBCLASS(target, _TYPE(result)))  # an instance of the class called
        except Exception:
            pass
        try:
            module, qualname = _GETATTR(target, "__module__", ""), _GETATTR(target, "__qualname__", "")
            info["name"] = "%s.%s" % (str(module)[:100], str(qualname)[:100])
        except Exception:
            pass
        try:
            spec = _GETATTR(_TYPE(result), "__dataclass_fields__", None)
            if isinstance(spec, dict):
                params, kw_only = [], []
                for name, f in spec.items():
                    kind = _GETATTR(_GETATTR(f, "_field_type", None), "name", "")
                    if kind not in ("_FIELD", "_FIELD_INITVAR") or not _GETATTR(f, "init", False):
                        continue
                    entry = str(name) if kind == "_FIELD" else None
                    (kw_only if _GETATTR(f, "kw_only", False) is True else params).append(entry)
                info["init"] = params + kw_only
        except Exception:
            info.pop("init", None)
        if not known and _TYPE(result) not in _PLAIN:
            self.built[_ID(result)] = hid
        return info

    def decode(self, value):
        return decode_value(value, self.resolve)  # noqa: F821

    # requests ---------------------------------------------------------------------------------
    def serve(self, req):
        rid = req.get("id")
        try:
            target = self.resolve("h", req.get("target"))
            op = req.get("k")
            if op == "call":
                args, kwargs = self.decode(req["args"]), self.decode(req["kwargs"])
                result = target(*args, **kwargs)
                known = _ID(result) in self.handles
                payload = {"k": "ret", "id": rid, "v": self.encode(result), "mut": self.mutations(req, args, kwargs)}
                if _ISSUBCLASS(_TYPE(target), _TYPE):
                    payload["cls"] = self.construction(target, result, known)
            else:
                arg = self.decode(req["arg"]) if "arg" in req else None
                kind = req.get("op")
                if kind == "getattr":
                    result = getattr(target, str(arg))
                elif kind == "setattr":
                    name, value = arg
                    setattr(target, str(name), value)
                    result = None
                elif kind == "len":
                    result = len(target)
                elif kind == "iter":
                    result = list(iter(target))
                elif kind == "getitem":
                    result = target[arg]
                elif kind == "str":
                    result = str(target)
                else:
                    raise ValueError("unknown operation")
                payload = {"k": "ret", "id": rid, "v": self.encode(result), "mut": []}
        except BaseException as exc:
            etype = type(exc)
            payload = {"k": "exc", "id": rid, "type": getattr(etype, "__name__", "?")[:100], "msg": str(exc)[:300]}
        send_msg(self.wfd, payload)  # noqa: F821

    def mutations(self, req, args, kwargs):
        """New state of the mutable arguments that the call changed (in-place mutation)."""
        out = []
        sent_args = req["args"].get("t", []) if isinstance(req["args"], dict) else []
        for i, (value, sent) in enumerate(zip(args, sent_args)):
            if type(value) in _MUTABLE:
                now = self.encode(value)
                if now != sent:
                    out.append([i, now])
        sent_kwargs = {}
        if isinstance(req["kwargs"], dict):
            for kv in req["kwargs"].get("d", []):
                if isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str):
                    sent_kwargs[kv[0]] = kv[1]
        for key, value in kwargs.items():
            if type(value) in _MUTABLE and key in sent_kwargs:
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
    session = _Session(rfd, wfd)
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
