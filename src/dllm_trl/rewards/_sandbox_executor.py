"""Executor: the process that runs UNTRUSTED candidate code (code reward).

Standalone program (stdlib only). The judge starts it as ``python -I -S -c <codec + this file>``
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
   code runs, hence authentic), then executes the candidate program and serves call requests.

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
    rfd = os.dup(0)
    wfd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdout = sys.stderr = open(os.devnull, "w")
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


def _serve(rfd, wfd, program):
    g = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        code = compile(program, "<candidate>", "exec")
        exec(code, g)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt included
        send_msg(wfd, {"k": "load_error", "e": "%s: %s" % (type(exc).__name__, str(exc)[:300])})  # noqa: F821
        os._exit(0)
    send_msg(wfd, {"k": "loaded"})  # noqa: F821
    while True:
        req = recv_msg(rfd, deadline=None)  # noqa: F821
        rid = req.get("id")
        try:
            fn = g[req["name"]]
            args = decode_value(req["args"])  # noqa: F821
            kwargs = decode_value(req["kwargs"])  # noqa: F821
            result = fn(*args, **kwargs)
            payload = {"k": "ret", "id": rid, "v": encode_value(result)}  # noqa: F821
        except BaseException as exc:
            etype = type(exc)
            payload = {"k": "exc", "id": rid, "type": getattr(etype, "__name__", "?")[:100], "msg": str(exc)[:300]}
        send_msg(wfd, payload)  # noqa: F821


def main():
    rfd, wfd, program = _boot()
    try:
        _serve(rfd, wfd, program)
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
