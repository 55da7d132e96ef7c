"""Run untrusted Python programs (model-written code plus its tests) and return a verdict.

Every program runs in a fresh interpreter process (`sys.executable -I`: isolated mode, no
PYTHON* variables, no user site-packages), never in this process. The protections, from the
ones that always hold to the ones the system must permit:

always
- its own session and process group (`setsid`), killed as a whole (SIGKILL) at the wall-clock
  timeout;
- a fresh temporary working directory (also its HOME and TMPDIR), deleted afterwards;
- a scrubbed environment: only PATH, HOME, TMPDIR, LANG; nothing of ours (no secrets, tokens);
- resource limits set in the child before exec: RLIMIT_CPU (timeout + 1 s), RLIMIT_AS (memory),
  RLIMIT_FSIZE (largest file it may write), RLIMIT_NOFILE, RLIMIT_CORE = 0, and RLIMIT_NPROC
  (processes and threads; only meaningful together with a user of its own, see below);
- stdin from /dev/null; stdout and stderr read by us and kept up to `max_output_bytes` each (the
  rest is read and dropped, so a flood of output can neither block it nor fill our memory);
- "passed" needs both exit status 0 and a completion marker that the epilogue we append writes
  to a private pipe: a program that calls `sys.exit(0)` or `os._exit(0)` before its tests does
  not pass.

when we run as root ("unprivileged_user", "no_network", "private_mounts")
- it drops to a user id of its own (setgroups([]), setgid, setuid in the child), distinct for
  every run, so RLIMIT_NPROC bounds a fork bomb, it can signal no process but its own, it can
  write only in its directory and where any user may (the world-writable folders, covered as
  below), and after the run any process left with that uid is killed (`kill(-1)` from a helper
  that takes the uid), so no daemon it forked survives;
- a fresh network namespace (`unshare(CLONE_NEWNET)`): only a loopback interface that is down,
  so every connection fails, to the internet as to 127.0.0.1;
- a private mount namespace: /tmp, /var/tmp and /dev/shm are covered by small empty tmpfs (the
  run's own directory is bound back in), as is any directory the unprivileged user could not
  enter on the way to the interpreter (for example /root, which holds a pyenv Python): the
  interpreter's folders are bind-mounted back read-only, the rest of it (home, secrets) vanishes.

when we are not root ("no_network" where the kernel permits unprivileged user namespaces): a new
user + network namespace. Files writable by our user stay writable: run as root (a container)
for the full set.

`protections()` probes once which of these work here (each level is tried on a tiny program,
the strongest that runs is kept) and every result records the set that was in force.

Verdicts: "passed" (exit 0 and marker), "failed" (a Python exception, an assertion, a non-zero
exit; the reason is the last line of stderr), "timeout" (wall clock or CPU limit), "crashed"
(killed by a signal such as SIGSEGV from a stack overflow, or could not start).
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

VERDICTS = ("passed", "failed", "timeout", "crashed")

# Linux constants (sched.h, mount.h).
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18

# User ids for the runs: UID_BASE + (pid of this process) * 256 + (run counter mod 256). Live
# pids are unique, so concurrent runs of different processes (torchrun ranks) never share one.
UID_BASE = 1_000_000_000
_PID_MAX = 1 << 22


@dataclass(frozen=True)
class SandboxConfig:
    timeout: float = 10.0  # wall-clock seconds
    memory_mb: int = 2048  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC (processes + threads of the run's user)
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 128  # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 1024  # kept per stream
    tmpfs_mb: int = 16  # size of the tmpfs that cover /tmp, /var/tmp, /dev/shm


@dataclass
class SandboxResult:
    verdict: str  # one of VERDICTS
    reason: str  # why: "" when passed
    returncode: int | None
    stdout: str
    stderr: str
    duration: float  # wall seconds, start to reap
    protections: tuple[str, ...] = field(default_factory=tuple)
    truncated: bool = False  # some output was dropped

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason, "returncode": self.returncode,
                "duration": round(self.duration, 4), "truncated": self.truncated}


# ---- what the system permits -------------------------------------------------------------------
_libc = None


def _get_libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.unshare.argtypes = [ctypes.c_int]
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return _libc


@dataclass(frozen=True)
class _Plan:
    """How the child is confined: computed once (probe), used by every run."""

    drop_user: bool = False
    new_net: bool = False
    private_mounts: bool = False
    user_namespace: bool = False  # non-root: CLONE_NEWUSER to be allowed CLONE_NEWNET

    def protections(self) -> tuple[str, ...]:
        names = ["isolated_interpreter", "own_session", "scrubbed_env", "rlimits", "temp_dir", "wall_timeout",
                 "output_bounded", "completion_marker"]
        if self.drop_user:
            names.append("unprivileged_user")
        if self.new_net:
            names.append("no_network")
        if self.private_mounts:
            names.append("private_mounts")
        return tuple(names)


def _interpreter_dirs() -> list[str]:
    """Folders the interpreter needs: its prefixes (stdlib, site-packages) and its binary's folder."""
    dirs = set()
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(os.path.abspath(sys.executable))):
        if p:
            dirs.add(os.path.realpath(p))
    # Keep outermost folders only.
    out = []
    for d in sorted(dirs, key=len):
        if not any(d == o or d.startswith(o.rstrip("/") + "/") for o in out):
            out.append(d)
    return out


def _closed_ancestor(path: str) -> str | None:
    """The outermost folder on the way to `path` that others cannot enter (mode without o+x)."""
    parts = os.path.realpath(path).split("/")[1:]
    cur = ""
    for part in parts:
        cur += "/" + part
        try:
            st = os.stat(cur)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return cur
    return None


def _covers(workdir: str) -> list[tuple[str, list[str], str]]:
    """(folder to cover with an empty tmpfs, paths under it to put back, tmpfs mode) for a run:
    closed folders on the way to the interpreter (mode 755, the interpreter put back read-only)
    and the world-writable scratch folders (mode 1777, the run's folder put back)."""
    under = lambda path, top: path.startswith(top.rstrip("/") + "/")  # noqa: E731
    interpreter = _interpreter_dirs()
    shared = [os.path.realpath(d) for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    tops = set(shared)
    for d in interpreter:
        closed = _closed_ancestor(d)
        if closed is not None and closed != "/":
            tops.add(closed)
    # Drop covers nested in another one (the outer one hides them anyway).
    tops = [t for t in tops if not any(under(t, o) for o in tops if o != t)]
    real_work = os.path.realpath(workdir)
    covers = []
    for top in tops:
        keep = [d for d in interpreter + [real_work] if under(d, top)]
        covers.append((top, keep, "1777" if top in shared else "755"))
    return sorted(covers)


class _ChildSetup:
    """The work done in the forked child before exec (preexec_fn). Everything it needs is
    computed beforehand; it only makes system calls, and any failure raises (the parent sees
    the run as "could not start")."""

    def __init__(self, plan: _Plan, config: SandboxConfig, uid: int | None, workdir: str):
        self.plan, self.config, self.uid = plan, config, uid
        self.workdir = workdir
        self.covers = _covers(workdir) if plan.private_mounts else []
        self.libc = _get_libc() if (plan.new_net or plan.private_mounts or plan.user_namespace) else None
        self.outer_uid, self.outer_gid = os.getuid(), os.getgid()
        self.rlimits = self._rlimits()

    def _rlimits(self) -> list[tuple[int, int]]:
        c = self.config
        cpu = int(c.timeout) + 1
        mb = 1024 * 1024
        limits = [
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_AS, c.memory_mb * mb),
            (resource.RLIMIT_FSIZE, c.max_file_mb * mb),
            (resource.RLIMIT_NOFILE, c.max_open_files),
            (resource.RLIMIT_CORE, 0),
        ]
        if self.plan.drop_user:
            limits.append((resource.RLIMIT_NPROC, c.max_processes))
        return limits

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")

    def _mount(self, source, target, fstype, flags, data) -> None:
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        self._check(self.libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")

    def __call__(self) -> None:
        os.setsid()
        plan = self.plan
        if plan.user_namespace:
            self._check(self.libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(user, net)")
            for name, text in (("setgroups", "deny"), ("uid_map", f"{self.outer_uid} {self.outer_uid} 1"),
                               ("gid_map", f"{self.outer_gid} {self.outer_gid} 1")):
                fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
                try:
                    os.write(fd, text.encode())
                finally:
                    os.close(fd)
        else:
            flags = (CLONE_NEWNET if plan.new_net else 0) | (CLONE_NEWNS | CLONE_NEWIPC if plan.private_mounts else 0)
            if flags:
                self._check(self.libc.unshare(flags), "unshare")
        if plan.private_mounts:
            self._mount("none", "/", None, MS_REC | MS_PRIVATE, None)
            size = f"size={self.config.tmpfs_mb}m"
            # Hold every path to put back by an O_PATH descriptor, cover the folders with empty
            # tmpfs, then bind the paths back from their descriptors (/proc/self/fd/N).
            held = [(top, keep, mode, [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep])
                    for top, keep, mode in self.covers]
            for top, keep, mode, fds in held:
                self._mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},{size}")
                for path, fd in zip(keep, fds):
                    os.makedirs(path, mode=0o755, exist_ok=True)
                    self._mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
                    os.close(fd)
                    if path != self.workdir:
                        self._mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
            os.chdir(self.workdir)  # the old cwd handle points below the cover
        for res, value in self.rlimits:
            resource.setrlimit(res, (value, value))
        if plan.drop_user:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)


_plan: _Plan | None = None
_plan_lock = threading.Lock()
_counter = 0
_counter_lock = threading.Lock()


def _next_uid() -> int:
    global _counter
    with _counter_lock:
        _counter += 1
        n = _counter
    return UID_BASE + (os.getpid() % _PID_MAX) * 256 + n % 256


def _candidate_plans() -> list[_Plan]:
    if os.geteuid() == 0:
        return [
            _Plan(drop_user=True, new_net=True, private_mounts=True),
            _Plan(drop_user=True, new_net=True),
            _Plan(drop_user=True),
            _Plan(new_net=True, private_mounts=True),
            _Plan(new_net=True),
            _Plan(),
        ]
    return [_Plan(user_namespace=True, new_net=True), _Plan()]


_PROBE = "import os, socket\nprint(os.getuid())\n"


def _probe(plan: _Plan) -> bool:
    config = SandboxConfig(timeout=20.0)
    try:
        r = _run(_PROBE, config, plan, marker=True)
    except OSError:
        return False
    return r.verdict == "passed"


def current_plan() -> _Plan:
    global _plan
    with _plan_lock:
        if _plan is None:
            for plan in _candidate_plans():
                if _probe(plan):
                    _plan = plan
                    break
            else:
                _plan = _Plan()
        return _plan


def protections() -> tuple[str, ...]:
    """The protections in force on this machine (probed on first use)."""
    return current_plan().protections()


# ---- one run -----------------------------------------------------------------------------------
def _uid_has_processes(uid: int) -> bool:
    """Is any process of `uid` left? (/proc/<pid> belongs to the process's uid.)"""
    try:
        names = os.listdir("/proc")
    except OSError:
        return True
    for name in names:
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    return True
            except OSError:
                continue
    return False


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a forked helper takes the uid and calls kill(-1), which
    reaches every process the caller may signal, i.e. those of its own uid. The kernel walks the
    process list under a lock that fork needs too, and a process with a pending SIGKILL cannot
    complete a fork, so a fork bomb cannot outrun it; the second call is belt and braces."""
    pid = os.fork()
    if pid == 0:  # child: only system calls, then _exit
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(2):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _epilogue(fd: int, token: str) -> str:
    return f"\n\nimport os as _sandbox_os\n_sandbox_os.write({fd}, {token.encode()!r})\n"


def _decode(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def _last_line(text: str) -> str:
    for line in reversed(text.strip().splitlines()):
        if line.strip():
            return line.strip()[:300]
    return ""


def _run(source: str, config: SandboxConfig, plan: _Plan, marker: bool = True) -> SandboxResult:
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="fastdllm-sandbox-"))
    uid = _next_uid() if plan.drop_user else None
    token = secrets.token_hex(16)
    rfd, wfd = os.pipe()
    proc = None
    t0 = time.perf_counter()
    try:
        program = source + (_epilogue(wfd, token) if marker else "")
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(path, uid, uid)
        os.chmod(workdir, 0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        setup = _ChildSetup(plan, config, uid, workdir)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "program.py"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(wfd,), preexec_fn=setup, close_fds=True,
        )
        os.close(wfd)
        wfd = -1
        out, err, got, truncated, timed_out = _collect(proc, rfd, config)
        duration = time.perf_counter() - t0
    except (OSError, subprocess.SubprocessError) as e:
        if proc is None:
            return SandboxResult("crashed", f"could not start: {e}", None, "", "", time.perf_counter() - t0,
                                 plan.protections())
        raise
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        if uid is not None and _uid_has_processes(uid):
            _kill_uid(uid)
        for fd in (rfd, wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)
    rc = proc.returncode
    stdout, stderr = _decode(out), _decode(err)
    verdict, reason = _verdict(rc, timed_out, token.encode() in got, stderr, config)
    return SandboxResult(verdict, reason, rc, stdout, stderr, duration, plan.protections(), truncated)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


def _collect(proc: subprocess.Popen, marker_fd: int, config: SandboxConfig):
    """Read stdout, stderr and the marker pipe until the program ends or the deadline passes,
    keeping at most max_output_bytes of each stream (the rest is read and dropped). Returns
    (out, err, marker bytes, truncated, timed_out); the process is reaped on return.

    The pipes close when every process holding them has ended; a descendant that outlives the
    main process gets a short grace, then is killed with the rest (see _run)."""
    deadline = time.monotonic() + config.timeout
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), marker_fd: bytearray()}
    caps = {out_fd: config.max_output_bytes, err_fd: config.max_output_bytes, marker_fd: 256}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    truncated = timed_out = False
    exited_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = proc.poll() is None
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(timeout=min(deadline - now, 0.05 if exited_at else 0.5)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf, room = bufs[key.fd], caps[key.fd] - len(bufs[key.fd])
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > room and key.fd != marker_fd:
                    truncated = True
        if proc.poll() is None:
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(left, 0))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), bytes(bufs[marker_fd]), truncated, timed_out


def _verdict(rc: int, timed_out: bool, marked: bool, stderr: str, config: SandboxConfig) -> tuple[str, str]:
    if timed_out:
        return "timeout", f"wall-clock limit of {config.timeout:g}s exceeded"
    if rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return "timeout", "CPU time limit exceeded"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        detail = _last_line(stderr)
        return "crashed", f"killed by {name}" + (f" ({detail})" if detail else "")
    if rc != 0:
        return "failed", _last_line(stderr) or f"exit status {rc}"
    if not marked:
        return "failed", "exited with status 0 before the end of the program (tests did not all run)"
    return "passed", ""


# ---- public API --------------------------------------------------------------------------------
def run_program(source: str, config: SandboxConfig | None = None, **overrides) -> SandboxResult:
    """Run a Python program (for example a solution followed by its tests) in the sandbox.

    `overrides` are SandboxConfig fields (timeout=..., memory_mb=...)."""
    config = replace(config or SandboxConfig(), **overrides)
    return _run(source, config, current_plan())


def run_many(sources: Sequence[str], config: SandboxConfig | None = None, workers: int = 2,
             on_result: Callable[[int, SandboxResult], None] | None = None) -> list[SandboxResult]:
    """Run programs `workers` at a time; results in input order. `on_result(index, result)` is
    called as each finishes (from a worker thread)."""
    config = config or SandboxConfig()
    plan = current_plan()
    results: list[SandboxResult | None] = [None] * len(sources)

    def one(i: int) -> None:
        results[i] = _run(sources[i], config, plan)
        if on_result is not None:
            on_result(i, results[i])

    if workers <= 1 or len(sources) <= 1:
        for i in range(len(sources)):
            one(i)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for f in [pool.submit(one, i) for i in range(len(sources))]:
                f.result()
    return results  # type: ignore[return-value]


def _main(argv: Iterable[str] | None = None) -> int:
    """`python -m fastdllm.sandbox [file.py]`: run a file (or stdin) and print the verdict."""
    import json

    args = list(sys.argv[1:] if argv is None else argv)
    source = open(args[0], encoding="utf-8").read() if args else sys.stdin.read()
    r = run_program(source)
    print(json.dumps({**r.to_dict(), "protections": list(r.protections), "stdout": r.stdout[-2000:],
                      "stderr": r.stderr[-2000:]}, indent=2))
    return 0 if r.passed else 1


if __name__ == "__main__":
    raise SystemExit(_main())
