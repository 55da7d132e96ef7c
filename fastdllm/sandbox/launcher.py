"""Start one sandboxed program: `python -I -S launcher.py SPEC` (SPEC: a marshalled dict, in hex).

Run by `fastdllm.sandbox` in a fresh, single-threaded interpreter (never forked from the caller,
which may hold threads and locks). It imports only the standard library. The spec says which
confinements to set up; in order:

1. `unshare` the namespaces: network (no interface up: nothing to connect to, and abstract Unix
   sockets are per namespace), IPC, UTS, mount, PID; or, when we are not root, a user namespace
   with the network namespace;
2. fork: the child is PID 1 of the new PID namespace, our init. When it exits the kernel kills
   every process left in the namespace, so nothing the program started outlives the run;
3. init builds a new root (see `_build_root`) and pivots into it: a read-only tmpfs holding
   read-only, nosuid binds of the system folders and the interpreter, a few device nodes, its
   own /proc where the kernel allows, and two size-limited tmpfs, /sandbox (the program's folder,
   HOME) and /tmp. Nothing else of the host is there: no /run or /var/run (host sockets), no
   world-writable host folder, no project data, no other process's /proc;
4. init forks the program: resource limits, the run's own unprivileged uid and gid, no
   supplementary groups, `PR_SET_NO_NEW_PRIVS` (setuid binaries gain nothing), a seccomp filter
   (only Unix and IP sockets, no io_uring, no kernel keyrings, no new namespaces), every other
   descriptor closed, then exec;
5. init reaps until the program exits, ends whatever it left running (without a PID namespace,
   init is a child subreaper, so every process the program started is still its descendant),
   then writes the wait status and the CPU time of all the box's processes (a marshalled dict) to
   the status descriptor, which the program never holds, and exits.

Before all of this the launcher joins the box's control groups, where the host made them, so
that every process of the box counts against its memory, process and CPU limits together. Any
failure before the exec is reported on the status descriptor as `{"error": ...}`. Only
built-in modules and ctypes are imported, so that it starts in a few milliseconds.
"""

import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_CHILD_SUBREAPER = 38, 22, 2, 36

# Per architecture: the audit arch, and the numbers of the syscalls the filter looks at.
ARCHES = {
    "x86_64": {
        "audit": 0xC000003E,
        "socket": 41,
        "socketpair": 53,
        "io_uring_setup": 425,
        "pivot_root": 155,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "unshare": 272,
        "setns": 308,
        "clone": 56,
        "clone3": 435,
    },
    "aarch64": {
        "audit": 0xC00000B7,
        "socket": 198,
        "socketpair": 199,
        "io_uring_setup": 425,
        "pivot_root": 41,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "unshare": 97,
        "setns": 268,
        "clone": 220,
        "clone3": 435,
    },
}
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
EPERM, EAFNOSUPPORT, ENOSYS = 1, 97, 38
# clone flags that make a namespace: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ---- the box's processes, where no PID namespace holds them ---------------------------------------
def proc_stat(pid):
    """(parent pid, state, CPU ticks of the process and of its reaped children, resident pages)
    from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2 :].split()  # the name, in parentheses, may hold anything
    return int(fields[1]), fields[0], sum(int(x) for x in fields[11:15]), int(fields[21])


def descendants(root):
    """{pid: proc_stat} of every descendant of `root`, from one pass over /proc. The launcher is
    a child subreaper, so a process whose parent ended is still found under it."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append((int(name), st))
    found, todo = {}, [root]
    while todo:
        for pid, st in children.get(todo.pop(), ()):
            found[pid] = st
            todo.append(pid)
    return found


def kill_descendants(root, reap):
    """SIGKILL the descendants of `root` until none is left (a process with a pending SIGKILL
    cannot complete a fork); `reap`: we are their subreaper and wait for them."""
    for _ in range(1000):
        live = [pid for pid, st in descendants(root).items() if st[1] != b"Z"]
        for pid in live:
            try:
                os.kill(pid, 9)
            except (ProcessLookupError, PermissionError):  # gone, or not ours to signal
                pass
        while reap:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not live:
            return


# ---- the new root ----------------------------------------------------------------------------------
def _bind(root, path, writable=False, device=False):
    """Bind host `path` at the same place under `root`: read-only and nosuid unless `writable` /
    `device`. A host symlink (merged /usr: /bin -> usr/bin) is recreated as the same symlink."""
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    elif os.path.exists(path):
        if not os.path.exists(target):
            open(target, "w").close()
    else:
        return
    _mount(path, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID
    if not device:
        flags |= MS_NODEV
    if not writable and not device:
        flags |= MS_RDONLY
    _mount(None, target, None, flags)


def _pivot(root):
    arch = ARCHES.get(os.uname().machine)
    os.makedirs(root + "/.oldroot", mode=0o700, exist_ok=True)
    os.chdir(root)
    if arch is not None:
        libc.syscall.restype = ctypes.c_long
        _check(libc.syscall(ctypes.c_long(arch["pivot_root"]), b".", b".oldroot"), "pivot_root")
        os.chdir("/")
        _check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount old root")
        os.rmdir("/.oldroot")
    else:  # no pivot_root number known: move the tmpfs over / and chroot into it
        _mount(root, "/", None, MS_BIND | MS_REC)
        os.chroot(".")
        os.chdir("/")


def _build_root(spec):
    root = spec["root_dir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    size = f"size={spec['tmpfs_mb']}m"
    # /tmp first: a bound folder inside it (an interpreter in a virtual environment under /tmp)
    # stays visible on top of it.
    os.makedirs(root + "/tmp", exist_ok=True)
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{size}")
    for path in spec["binds"]:
        _bind(root, path)
    for name in ("null", "zero", "full", "random", "urandom"):
        _bind(root, "/dev/" + name, device=True)
    for path in spec["hide"]:  # e.g. the package's own data, where it lies inside a bound folder
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    uid = spec["uid"]
    os.makedirs(root + "/sandbox", exist_ok=True)
    _mount("tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=700,{size}")
    for name in os.listdir(spec["files_dir"]):
        with (
            open(os.path.join(spec["files_dir"], name), "rb") as src,
            open(os.path.join(root, "sandbox", name), "wb") as dst,
        ):
            dst.write(src.read())
        if uid is not None:
            os.chown(os.path.join(root, "sandbox", name), uid, uid)
    if uid is not None:
        os.chown(root + "/sandbox", uid, uid)
    own_proc = False
    if spec["pid"]:
        os.makedirs(root + "/proc", exist_ok=True)
        try:  # only this namespace's processes; refused where the host masks parts of /proc
            _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            own_proc = True
        except OSError:
            os.rmdir(root + "/proc")
    _pivot(root)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    return own_proc


# ---- the program ------------------------------------------------------------------------------------
def _seccomp_filter():
    """A BPF program: kill on a foreign syscall ABI; socket/socketpair only for AF_UNIX, AF_INET,
    AF_INET6 (no AF_VSOCK, AF_NETLINK, AF_PACKET, ...); io_uring_setup refused (its requests can
    open sockets past the filter); the kernel keyrings refused (add_key, request_key, keyctl: a
    key outlives the box and would be a channel to a later one); no new namespaces (unshare,
    setns, clone with a CLONE_NEW* flag: judged code never needs them, and a user namespace is
    attack surface); clone3, whose flags the filter cannot read, answers ENOSYS so that the C
    library falls back to clone; everything else allowed."""
    nr = ARCHES[os.uname().machine]
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    errno = lambda e: 0x00050000 | e  # noqa: E731
    # (label, code, true-label, false-label, k); labels become (forward) jump offsets below
    prog = [
        (None, ld, None, None, 4),  # A = arch
        (None, jeq, "nr", None, nr["audit"]),
        (None, ret, None, None, kill),
        ("nr", ld, None, None, 0),  # A = syscall number
        (None, 0x35, "kill", None, 0x40000000),  # x32 ABI
        (None, jeq, "family", None, nr["socket"]),
        (None, jeq, "family", None, nr["socketpair"]),
        (None, jeq, "nosys", None, nr["io_uring_setup"]),
        (None, jeq, "nosys", None, nr["clone3"]),
        (None, jeq, "eperm", None, nr["add_key"]),
        (None, jeq, "eperm", None, nr["request_key"]),
        (None, jeq, "eperm", None, nr["keyctl"]),
        (None, jeq, "eperm", None, nr["unshare"]),
        (None, jeq, "eperm", None, nr["setns"]),
        (None, jeq, "clone", None, nr["clone"]),
        (None, ret, None, None, allow),
        ("family", ld, None, None, 16),  # A = args[0] (family, low word)
        (None, jeq, "allow", None, AF_UNIX),
        (None, jeq, "allow", None, AF_INET),
        (None, jeq, "allow", None, AF_INET6),
        (None, ret, None, None, errno(EAFNOSUPPORT)),
        ("clone", ld, None, None, 16),  # A = args[0] (flags, low word)
        (None, jset, "eperm", "allow", CLONE_NEW_ANY),
        ("eperm", ret, None, None, errno(EPERM)),
        ("nosys", ret, None, None, errno(ENOSYS)),
        ("kill", ret, None, None, kill),
        ("allow", ret, None, None, allow),
    ]
    where = {label: i for i, (label, *_rest) in enumerate(prog) if label}
    jump = lambda i, label: 0 if label is None else where[label] - i - 1  # noqa: E731
    # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k;}, native byte order
    raw = b"".join(
        code.to_bytes(2, sys.byteorder) + bytes([jump(i, jt), jump(i, jf)]) + k.to_bytes(4, sys.byteorder)
        for i, (_, code, jt, jf, k) in enumerate(prog)
    )
    buf = ctypes.create_string_buffer(raw)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    return SockFprog(len(prog), ctypes.addressof(buf)), buf


def _exec_program(spec, status_fd):
    # The status pipe stays open (closed by exec) so that a failure before exec is reported.
    keep = set(spec["keep_fds"]) | {0, 1, 2, status_fd}
    os.set_inheritable(status_fd, False)
    for fd in spec["keep_fds"]:
        os.set_inheritable(fd, True)
    high = max(keep) + 1
    for fd in range(3, high):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    os.closerange(high, 65536)
    os.chdir(spec["cwd"])
    for res, soft, hard in spec["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    uid = spec["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if spec["seccomp"]:
        prog, _buf = _seccomp_filter()
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "seccomp")
    os.execve(spec["python"], [spec["python"], *spec["flags"], *spec["argv"]], spec["env"])


def _report(fd, obj):
    try:
        os.write(fd, marshal.dumps(obj))
    except OSError:
        pass


def _init(spec, status_fd):
    """Set up the root, start the program, reap until it exits, end what it left running, report
    its status and the CPU time of every process of the box that ended."""
    own_namespace = spec["pid"] and not spec["user_ns"]  # we are its PID 1: the kernel ends the rest
    if not own_namespace:  # orphans are re-parented to us, not to the host's init
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "child_subreaper")
    own_proc = _build_root(spec) if spec["new_root"] else False
    child = os.fork()
    if child == 0:
        try:
            _exec_program(spec, status_fd)
        except BaseException as e:  # noqa: BLE001 - anything before exec means "could not start"
            _report(status_fd, {"error": f"{type(e).__name__}: {e}"})
        os._exit(70)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            pid, status = child, 0
        if pid == child:
            break
    if not own_namespace and os.path.isdir("/proc/self"):  # else its own uid lets the host end them
        kill_descendants(os.getpid(), reap=True)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    _report(status_fd, {"status": status, "cpu": cpu, "own_proc": own_proc})
    os._exit(0)


def main():
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    status_fd = spec["status_fd"]
    try:
        for path in spec["cgroup_procs"]:  # first: every process of the box is a member from its start
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        flags = 0
        if spec["user_ns"]:
            flags |= CLONE_NEWUSER | CLONE_NEWNET
        else:
            if spec["net"]:
                flags |= CLONE_NEWNET
            if spec["new_root"]:
                flags |= CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
            if spec["pid"]:
                flags |= CLONE_NEWPID
        outer_uid, outer_gid = os.getuid(), os.getgid()
        if flags:
            _check(libc.unshare(flags), "unshare")
        if spec["user_ns"]:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{outer_uid} {outer_uid} 1")
            _write("/proc/self/gid_map", f"{outer_gid} {outer_gid} 1")
        if spec["pid"] and not spec["user_ns"]:
            pid = os.fork()
            if pid:  # outside the namespace: wait for its init, which reports for both
                _, status = os.waitpid(pid, 0)
                os._exit(0 if status == 0 else 71)
        _init(spec, status_fd)
    except BaseException as e:  # noqa: BLE001
        _report(status_fd, {"error": f"{type(e).__name__}: {e}"})
        os._exit(70)


if __name__ == "__main__":
    main()
