"""One sandboxed process (`Box`): its host folder, its launcher, what it printed, how it ended;
and the plan of confinements this machine permits, probed once.

A box starts `launcher.py` in a fresh interpreter, which confines and execs the program (see its
docstring for the order). The host side here writes the program's files into a private folder,
reads the program's stdout and stderr (bounded), and the launcher's status line, kills the whole
process group at the wall-clock backstop, kills every process of the run's uid afterwards
(whatever is left; unconditionally), and removes the folder.
"""

from __future__ import annotations

import logging
import marshal
import math
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

LAUNCHER = str(Path(__file__).with_name("launcher.py"))
PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # fastdllm/: its data must stay unseen

# User ids for the runs: UID_BASE + (pid of this process) * 256 + (run counter mod 256). Live
# pids are unique, so concurrent runs of different processes (torchrun ranks) never share one.
UID_BASE = 1_000_000_000
_PID_MAX = 1 << 22

log = logging.getLogger("fastdllm.sandbox")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed process.

    `timeout` is CPU seconds (rounded up to whole seconds by the kernel's RLIMIT_CPU) and is what
    decides "timeout", so a program gets the same verdict on a busy machine as on an idle one.
    `wall_timeout` is only a backstop for programs that wait without computing (sleep, a blocked
    read); by default 3 * timeout + 5 s."""

    timeout: float = 10.0
    wall_timeout: float | None = None
    memory_mb: int = 2048  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC (processes + threads of the run's user)
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 128  # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 1024  # kept per stream
    tmpfs_mb: int = 64  # size of the program's folder and of its /tmp (each a tmpfs)

    @property
    def cpu_seconds(self) -> int:
        return max(1, math.ceil(self.timeout))

    @property
    def wall_seconds(self) -> float:
        return self.wall_timeout if self.wall_timeout is not None else 3 * self.timeout + 5


@dataclass(frozen=True)
class Plan:
    """How programs are confined here: the strongest level that ran the probe."""

    drop_user: bool = False
    new_net: bool = False
    new_root: bool = False
    pid_ns: bool = False
    seccomp: bool = False
    user_namespace: bool = False  # not root: a user namespace, to be allowed a network namespace
    own_proc: bool = False

    def protections(self) -> tuple[str, ...]:
        names = ["isolated_interpreter", "own_session", "scrubbed_env", "rlimits", "cpu_timeout", "wall_backstop",
                 "output_bounded", "no_new_privs"]
        flags = [
            (self.drop_user, "unprivileged_user"), (self.drop_user, "kill_by_uid"), (self.new_net, "no_network"),
            (self.new_root, "read_only_root"), (self.new_root, "size_limited_dirs"),
            (self.new_root, "private_ipc_uts"), (self.pid_ns, "pid_namespace"), (self.own_proc, "own_proc"),
            (self.seccomp, "socket_filter"),
        ]
        return tuple(names + [name for on, name in flags if on])


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
    cpu_time: float | None = None  # CPU seconds of the program (judged: of the tests' process)

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason, "returncode": self.returncode,
                "duration": round(self.duration, 4), "truncated": self.truncated,
                "cpu_time": None if self.cpu_time is None else round(self.cpu_time, 4)}


VERDICTS = ("passed", "failed", "timeout", "crashed")


def last_line(text: str) -> str:
    """The last non-empty line of a program's output (a verdict's reason), bounded."""
    for line in reversed(text.strip().splitlines()):
        if line.strip():
            return line.strip()[:300]
    return ""


# ---- the folders a program needs ---------------------------------------------------------------
def interpreter_dirs() -> list[str]:
    """Folders the interpreter needs: its prefixes (stdlib, site-packages) and its binary's folder."""
    dirs = set()
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(os.path.abspath(sys.executable))):
        if p:
            dirs.add(os.path.realpath(p))
    out = []
    for d in sorted(dirs, key=len):  # outermost folders only
        if not any(d == o or d.startswith(o.rstrip("/") + "/") for o in out):
            out.append(d)
    return out


def root_binds() -> list[str]:
    """Host paths bound read-only into a new root: the system's programs, libraries and
    configuration, and the interpreter. Symlinks among them are recreated as symlinks."""
    system = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
    return [p for p in system if os.path.lexists(p)] + interpreter_dirs()


# ---- processes ---------------------------------------------------------------------------------
_counter = 0
_counter_lock = threading.Lock()


def _next_uid() -> int:
    global _counter
    with _counter_lock:
        _counter += 1
        n = _counter
    return UID_BASE + (os.getpid() % _PID_MAX) * 256 + n % 256


def own_uids() -> range:
    """The uids this process's runs use (see UID_BASE)."""
    start = UID_BASE + (os.getpid() % _PID_MAX) * 256
    return range(start, start + 256)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a forked helper takes the uid and calls kill(-1), which
    reaches every process the caller may signal, i.e. those of its own uid. A process with a
    pending SIGKILL cannot complete a fork, so a fork bomb cannot outrun it; twice for safety."""
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


class Box:
    """One program in the sandbox. `files` are written into its folder (cwd and HOME); `argv`
    follows the interpreter (`python -I -B`, and `-S` when `site` is false: no site-packages,
    for our own trusted programs, which need only the standard library and start ~4x faster);
    `pass_fds` stay open in the program."""

    def __init__(self, files: dict[str, str], argv: list[str], config: SandboxConfig, plan: Plan,
                 pass_fds: tuple[int, ...] = (), site: bool = True):
        self.config, self.plan = config, plan
        self.host = os.path.realpath(tempfile.mkdtemp(prefix="fastdllm-sandbox-"))
        self.uid = _next_uid() if plan.drop_user else None
        self.proc: subprocess.Popen | None = None
        self.out, self.err, self.status_line = bytearray(), bytearray(), bytearray()
        self.truncated = False
        files_dir = os.path.join(self.host, "files")
        os.mkdir(files_dir, 0o700)
        for name, text in files.items():
            with open(os.path.join(files_dir, name), "w", encoding="utf-8") as f:
                f.write(text)
        if plan.new_root:
            os.mkdir(os.path.join(self.host, "root"), 0o700)
            cwd = "/sandbox"
        else:  # the program runs in the host folder itself
            cwd = files_dir
            os.chmod(self.host, 0o711)
            if self.uid is not None:
                for p in [files_dir] + [os.path.join(files_dir, n) for n in files]:
                    os.chown(p, self.uid, self.uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": "/tmp" if plan.new_root else cwd,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        self.status_r, status_w = os.pipe()
        spec = {
            "status_fd": status_w, "keep_fds": list(pass_fds), "argv": argv,
            "flags": ["-I", "-B"] + ([] if site else ["-S"]), "env": env, "cwd": cwd,
            "python": sys.executable, "uid": self.uid, "user_ns": plan.user_namespace, "net": plan.new_net,
            "new_root": plan.new_root, "pid": plan.pid_ns, "seccomp": plan.seccomp,
            "root_dir": os.path.join(self.host, "root"), "files_dir": files_dir, "binds": root_binds(),
            "hide": [PACKAGE_DIR], "tmpfs_mb": config.tmpfs_mb, "rlimits": self._rlimits(),
        }
        self.started = time.perf_counter()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", LAUNCHER, marshal.dumps(spec).hex()], cwd=self.host,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w, *pass_fds),
                start_new_session=True, close_fds=True,
            )
        finally:
            os.close(status_w)

    def _rlimits(self) -> list[tuple[int, int, int]]:
        c, mb = self.config, 1024 * 1024
        limits = [
            (resource.RLIMIT_CPU, c.cpu_seconds, c.cpu_seconds + 1),  # SIGXCPU, then SIGKILL
            (resource.RLIMIT_AS, c.memory_mb * mb, c.memory_mb * mb),
            (resource.RLIMIT_FSIZE, c.max_file_mb * mb, c.max_file_mb * mb),
            (resource.RLIMIT_NOFILE, c.max_open_files, c.max_open_files),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        if self.plan.drop_user:
            limits.append((resource.RLIMIT_NPROC, c.max_processes, c.max_processes))
        return limits

    def readers(self) -> dict[int, tuple[bytearray, int]]:
        """The descriptors to read: fd -> (buffer, cap)."""
        cap = self.config.max_output_bytes
        return {self.proc.stdout.fileno(): (self.out, cap), self.proc.stderr.fileno(): (self.err, cap),
                self.status_r: (self.status_line, 4096)}

    def status(self) -> dict:
        """What the launcher reported (it alone holds the status pipe: trusted)."""
        try:
            st = marshal.loads(bytes(self.status_line))
        except (ValueError, EOFError, TypeError):
            return {}
        return st if isinstance(st, dict) else {}

    def finish(self) -> None:
        """Kill whatever is left (the launcher's group, then the run's uid) and clean up."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for stream in (self.proc.stdout, self.proc.stderr):
                stream.close()
        if self.uid is not None:
            kill_uid(self.uid)
        try:
            os.close(self.status_r)
        except OSError:
            pass
        shutil.rmtree(self.host, ignore_errors=True)

    def ending(self) -> tuple[str | None, str, int | None, float | None]:
        """(signal-or-error kind, detail, exit code, cpu seconds) of the program, from the status
        line: kind is None for a normal exit, "cpu" for the CPU limit, "signal" for another
        signal, "start" when it could not start."""
        st = self.status()
        if "error" in st:
            return "start", str(st["error"]), None, None
        if "status" not in st:
            return "start", "the launcher reported no status", None, None
        rc = os.waitstatus_to_exitcode(int(st["status"]))
        cpu = float(st.get("cpu", 0.0))
        if rc < 0:
            sig = -rc
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self.config.cpu_seconds):
                return "cpu", "", rc, cpu
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return "signal", name, rc, cpu
        return None, "", rc, cpu


def drive(boxes: list[Box], wall: float, extra: dict[int, tuple[bytearray, int]] | None = None,
          primary: list[Box] | None = None) -> bool:
    """Read every box's output (and `extra` descriptors) until the `primary` boxes (default: all)
    and `extra` are done, or until `wall` seconds have passed. Returns True on the backstop.

    A box is done when its launcher has exited and its pipes are closed; a descendant that keeps
    them open gets a short grace (it is killed in `Box.finish`)."""
    primary = boxes if primary is None else primary
    readers: dict[int, tuple[bytearray, int]] = {}
    for b in boxes:
        readers.update(b.readers())
    readers.update(extra or {})
    waited = {fd for b in primary for fd in b.readers()} | set(extra or {})
    sel = selectors.DefaultSelector()
    for fd in readers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = boxes[0].started + wall
    exited_at = None
    truncated = set()
    try:
        while waited & set(sel.get_map()):
            now = time.perf_counter()
            if now >= deadline:
                return True
            if exited_at is None and all(b.proc.poll() is not None for b in primary):
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
                buf, cap = readers[key.fd]
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > room:
                    truncated.add(key.fd)
        for b in primary:  # the launcher exits right after its status line
            try:
                b.proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                return True
        return False
    finally:
        sel.close()
        for b in boxes:
            b.truncated = any(fd in truncated for fd in (b.proc.stdout.fileno(), b.proc.stderr.fileno()))


# ---- what the system permits -------------------------------------------------------------------
UNCONFINED_ENV = "FASTDLLM_SANDBOX_UNCONFINED"  # "1": run programs with rlimits only, where nothing more works


class SandboxUnavailable(RuntimeError):
    """No confinement could be set up here; untrusted code is not run."""


def candidate_plans() -> list[Plan]:
    """The confinement levels to try, strongest first. A plan that runs programs as the caller's
    own user with no namespace at all (rlimits only) is tried only when `FASTDLLM_SANDBOX_UNCONFINED=1`
    says so: as root it would run untrusted code as root."""
    if os.geteuid() == 0:
        full = Plan(drop_user=True, new_net=True, new_root=True, pid_ns=True,
                    seccomp=platform.machine() in ("x86_64", "aarch64"))
        plans = [full, replace(full, seccomp=False), replace(full, pid_ns=False, seccomp=False),
                 Plan(drop_user=True, new_net=True), Plan(drop_user=True)]
    else:
        plans = [Plan(user_namespace=True, new_net=True)]
    if os.environ.get(UNCONFINED_ENV) == "1":
        plans.append(Plan())
    return plans


def probe(plan: Plan) -> tuple[Plan | None, str]:
    """Run a tiny program under `plan`: (the plan, with what it found, e.g. its own /proc; or None
    if it did not run, and why)."""
    try:
        box = Box({"probe.py": "import os, socket\nprint(os.getuid())\n"}, ["probe.py"],
                  SandboxConfig(timeout=20.0), plan, site=False)
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"
    try:
        drive([box], 30.0)
        kind, _, rc, _ = box.ending()
        ok = kind is None and rc == 0 and bytes(box.out).strip().isdigit()
        if ok:
            return replace(plan, own_proc=bool(box.status().get("own_proc"))), ""
        why = box.status().get("error") or last_line(bytes(box.err).decode(errors="replace")) or f"exit {rc}"
        return None, why
    finally:
        box.finish()


_plan: Plan | None = None
_plan_lock = threading.Lock()


def current_plan() -> Plan:
    """The strongest plan that runs here (probed once). Weaker plans are logged with why the
    stronger ones failed; when none runs, SandboxUnavailable."""
    global _plan
    with _plan_lock:
        if _plan is None:
            failures = []
            for plan in candidate_plans():
                found, why = probe(plan)
                if found is not None:
                    if failures:
                        log.warning("sandbox: weaker confinement (%s); stronger plans failed: %s",
                                    ", ".join(found.protections()), "; ".join(failures))
                    _plan = found
                    break
                failures.append(f"{plan}: {why}")
            else:
                raise SandboxUnavailable(
                    "no confinement works on this machine, so untrusted code is not run (" + "; ".join(failures)
                    + f"). To run it with resource limits only, set {UNCONFINED_ENV}=1.")
        return _plan

