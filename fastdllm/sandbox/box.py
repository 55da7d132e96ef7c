"""One sandboxed process (`Box`): its host folder, its launcher, what it printed, how it ended;
and the plan of confinements this machine permits, probed once.

A box starts `launcher.py` in a fresh interpreter, which confines and execs the program (see its
docstring for the order). The host side here writes the program's files into a private folder,
reads the program's stdout and stderr (bounded), and the launcher's status line, stops the box at
its CPU budget (counted over all its processes where a control group holds the box) or at the
wall-clock backstop, afterwards kills every process of the box (its control group's members, and
every process of its uid: a uid belongs to one live box only), and removes the folder.
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import cgroup
from .tree import ProcessTree

LAUNCHER = str(Path(__file__).with_name("launcher.py"))
PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # fastdllm/: its data must stay unseen

# User ids for the runs: UID_BASE + (pid of this process) * 256 + a slot that no live box of this
# process holds (`UidPool`). Live pids are unique, so concurrent runs of different processes
# (torchrun ranks) never share one either.
UID_BASE = 1_000_000_000
_PID_MAX = 1 << 22
UIDS_PER_PROCESS = 256

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
    memory_mb: int = 2048  # the box's memory, all its processes together
    max_processes: int = 32  # processes + threads of the box (its control group)
    # Without a control group the memory is split: at most this many processes + threads (RLIMIT_NPROC
    # of the box's uid), each with memory_mb / processes_without_group of address space (RLIMIT_AS).
    processes_without_group: int = 4
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
    box_limits: bool = False  # a control group per box: memory, processes and CPU of all its processes

    def protections(self) -> tuple[str, ...]:
        names = [
            "isolated_interpreter",
            "own_session",
            "scrubbed_env",
            "rlimits",
            "cpu_timeout",
            "wall_backstop",
            "output_bounded",
            "no_new_privs",
        ]
        flags = [
            (self.drop_user, "unprivileged_user"),
            (self.drop_user, "kill_by_uid"),
            (self.new_net, "no_network"),
            (self.new_root, "read_only_root"),
            (self.new_root, "size_limited_dirs"),
            (self.new_root, "private_ipc_uts"),
            (self.pid_ns, "pid_namespace"),
            (self.own_proc, "own_proc"),
            (self.seccomp, "socket_filter"),
            (self.seccomp, "no_keyring_or_namespaces"),
            (self.box_limits, "box_limits"),
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
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "returncode": self.returncode,
            "duration": round(self.duration, 4),
            "truncated": self.truncated,
            "cpu_time": None if self.cpu_time is None else round(self.cpu_time, 4),
        }


VERDICTS = ("passed", "failed", "timeout", "crashed")


def memory_reason(config: SandboxConfig) -> str:
    return f"memory limit of {config.memory_mb} MB exceeded (by the box's processes together)"


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
    for p in (
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        os.path.dirname(os.path.abspath(sys.executable)),
    ):
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
class UidPool:
    """The uids of this process's runs. A uid is handed out only while no live box holds it, so
    killing by uid never reaches another box; a caller that needs several (the judge's two
    boxes) takes them at once, so that many concurrent callers cannot each hold one and wait."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pid, self._free = None, []

    def _slots(self) -> list[int]:
        if self._pid != os.getpid():  # a forked child starts with its own range
            self._pid = os.getpid()
            start = UID_BASE + (self._pid % _PID_MAX) * UIDS_PER_PROCESS
            self._free = list(range(start, start + UIDS_PER_PROCESS))
        return self._free

    def acquire(self, n: int = 1) -> list[int]:
        with self._cond:
            while len(self._slots()) < n:
                self._cond.wait()
            free = self._slots()
            taken, free[:] = free[:n], free[n:]
            return taken

    def release(self, uid: int) -> None:
        with self._cond:
            if uid in own_uids():
                self._slots().append(uid)  # the least recently used goes out first
                self._cond.notify_all()


UIDS = UidPool()


def own_uids() -> range:
    """The uids this process's runs use (see UID_BASE)."""
    start = UID_BASE + (os.getpid() % _PID_MAX) * UIDS_PER_PROCESS
    return range(start, start + UIDS_PER_PROCESS)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` and wait until none is left (a zombie too: it holds a place
    in the uid's process limit until reaped, which the next box of this uid would find taken). A
    forked helper takes the uid and calls kill(-1), which reaches every process the caller may
    signal but itself, i.e. those of its own uid. A process with a pending SIGKILL cannot
    complete a fork, so a fork bomb cannot outrun it. With none left (a box whose programs ended
    and were reaped), no process can appear under the uid, and no helper is forked."""
    for _ in range(200):
        if not uid_processes(uid):
            return
        pid = os.fork()
        if pid == 0:  # child: only system calls, then _exit
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        if uid_processes(uid):
            time.sleep(0.005)


def uid_processes(uid: int) -> list[int]:
    """The processes of `uid`, zombies included (/proc/PID belongs to its process's uid)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.append(int(name))
            except OSError:
                pass
    return found


class Box:
    """One program in the sandbox. `files` are written into its folder (cwd and HOME); `argv`
    follows the interpreter (`python -I -B`, and `-S` when `site` is false: no site-packages,
    for our own trusted programs, which need only the standard library and start ~4x faster);
    `pass_fds` stay open in the program. `uid`: one taken from `UIDS` for this box (it is
    released in `finish`); by default the box takes its own."""

    def __init__(
        self,
        files: dict[str, str],
        argv: list[str],
        config: SandboxConfig,
        plan: Plan,
        pass_fds: tuple[int, ...] = (),
        site: bool = True,
        uid: int | None = None,
    ):
        self.config, self.plan = config, plan
        self.uid = (uid if uid is not None else UIDS.acquire()[0]) if plan.drop_user else None
        self.proc: subprocess.Popen | None = None
        self.group: cgroup.BoxGroup | None = None
        self.tree: ProcessTree | None = None  # where there is no control group
        self.out, self.err, self.status_line = bytearray(), bytearray(), bytearray()
        self.truncated = False
        self.cpu_exceeded = False  # the host stopped the box at its CPU budget
        self.memory_exceeded = False  # the kernel stopped a process of the box at its memory limit
        self.final_cpu: float | None = None  # CPU seconds of all its processes, as its meter counted them
        self.status_r = -1
        self.started = time.perf_counter()
        self.host = os.path.realpath(tempfile.mkdtemp(prefix="fastdllm-sandbox-"))
        try:
            self._start(files, argv, pass_fds, site)
        except BaseException:
            self.finish()
            raise

    def _start(self, files, argv, pass_fds, site) -> None:
        config, plan = self.config, self.plan
        if plan.box_limits:
            self.group = cgroup.BoxGroup.create(config.memory_mb * 1024 * 1024, config.max_processes + 2)
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
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": cwd,
            "TMPDIR": "/tmp" if plan.new_root else cwd,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }
        self.status_r, status_w = os.pipe()
        spec = {
            "status_fd": status_w,
            "keep_fds": list(pass_fds),
            "argv": argv,
            "flags": ["-I", "-B"] + ([] if site else ["-S"]),
            "env": env,
            "cwd": cwd,
            "python": sys.executable,
            "uid": self.uid,
            "user_ns": plan.user_namespace,
            "net": plan.new_net,
            "new_root": plan.new_root,
            "pid": plan.pid_ns,
            "seccomp": plan.seccomp,
            "root_dir": os.path.join(self.host, "root"),
            "files_dir": files_dir,
            "binds": root_binds(),
            "hide": [PACKAGE_DIR],
            "tmpfs_mb": config.tmpfs_mb,
            "rlimits": self._rlimits(),
            "cgroup_procs": self.group.procs_files if self.group is not None else [],
        }
        self.started = time.perf_counter()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", LAUNCHER, marshal.dumps(spec).hex()],
                cwd=self.host,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, *pass_fds),
                start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(status_w)
        if self.group is None:
            self.tree = ProcessTree(self.proc.pid, config.memory_mb * 1024 * 1024)

    def _rlimits(self) -> list[tuple[int, int, int]]:
        """Each process's own limits. With a control group the box's memory and process count
        hold together and each process may take all of it; without one, the box's uid may hold
        `processes_without_group` processes of a share each, so the product stays within the
        budget (without a uid of its own, processes cannot be counted by the kernel: the host's
        sum of resident memory over the box's processes then holds the total)."""
        c, mb = self.config, 1024 * 1024
        processes = c.max_processes if self.plan.box_limits else c.processes_without_group
        memory = c.memory_mb * mb if self.plan.box_limits else c.memory_mb * mb // processes
        limits = [
            (resource.RLIMIT_CPU, c.cpu_seconds, c.cpu_seconds + 1),  # SIGXCPU, then SIGKILL
            (resource.RLIMIT_AS, memory, memory),
            (resource.RLIMIT_FSIZE, c.max_file_mb * mb, c.max_file_mb * mb),
            (resource.RLIMIT_NOFILE, c.max_open_files, c.max_open_files),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        if self.plan.drop_user:  # the uid is the box's own, so this too counts the box's processes
            limits.append((resource.RLIMIT_NPROC, processes, processes))
        return limits

    def readers(self) -> dict[int, tuple[bytearray, int]]:
        """The descriptors to read: fd -> (buffer, cap)."""
        cap = self.config.max_output_bytes
        return {
            self.proc.stdout.fileno(): (self.out, cap),
            self.proc.stderr.fileno(): (self.err, cap),
            self.status_r: (self.status_line, 4096),
        }

    def status(self) -> dict:
        """What the launcher reported (it alone holds the status pipe: trusted)."""
        try:
            st = marshal.loads(bytes(self.status_line))
        except (ValueError, EOFError, TypeError):
            return {}
        return st if isinstance(st, dict) else {}

    @property
    def meter(self) -> cgroup.BoxGroup | ProcessTree | None:
        """What counts the box's processes together: its control group, else its process tree."""
        return self.group if self.group is not None else self.tree

    def enforce_limits(self) -> None:
        """Stop the box once its processes together have spent its CPU budget, or once its memory
        limit was hit (the kernel killed one of them at the control group's limit, or their
        resident memory summed above it): the box is over its budget, whichever process did it."""
        meter = self.meter
        if meter is None or self.cpu_exceeded or self.memory_exceeded:
            return
        if meter.cpu_seconds() > self.config.cpu_seconds:
            self.cpu_exceeded = True
        elif meter.out_of_memory():
            self.memory_exceeded = True
        else:
            return
        meter.kill()

    def finish(self) -> None:
        """Kill every process of the box (its process tree while the launcher still holds it, the
        launcher's process group, the control group's members, the box's uid) and clean up."""
        if self.tree is not None and self.proc is not None:
            self.tree.kill()
            self.final_cpu = self.tree.cpu_seconds()
            self.memory_exceeded = self.memory_exceeded or self.tree.out_of_memory()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for stream in (self.proc.stdout, self.proc.stderr):
                stream.close()
            self.proc = None
        if self.group is not None:
            self.group.kill()
        if self.uid is not None:
            kill_uid(self.uid)
        if self.group is not None:
            self.memory_exceeded = self.memory_exceeded or self.group.out_of_memory()
            self.final_cpu = self.group.cpu_seconds()
            self.group.remove()
            self.group = None
        if self.uid is not None:
            UIDS.release(self.uid)
            self.uid = None
        if self.status_r >= 0:
            os.close(self.status_r)
            self.status_r = -1
        shutil.rmtree(self.host, ignore_errors=True)

    def ending(self) -> tuple[str | None, str, int | None, float | None]:
        """(signal-or-error kind, detail, exit code, cpu seconds) of the program, from the status
        line and the box's control group (call after `finish`): kind is None for a normal exit,
        "cpu" for the CPU limit, "memory" for the box's memory limit, "signal" for another
        signal, "start" when it could not start. CPU seconds are those of all the box's processes."""
        st = self.status()
        if self.cpu_exceeded:
            return "cpu", "", None, self.final_cpu
        if self.memory_exceeded:
            return "memory", "", None, self.final_cpu
        if "error" in st:
            return "start", str(st["error"]), None, None
        if "status" not in st:
            return "start", "the launcher reported no status", None, None
        rc = os.waitstatus_to_exitcode(int(st["status"]))
        cpu = max(self.final_cpu or 0.0, float(st.get("cpu", 0.0)))
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


def drive(
    boxes: list[Box],
    wall: float,
    extra: dict[int, tuple[bytearray, int]] | None = None,
    primary: list[Box] | None = None,
) -> bool:
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
            for b in boxes:
                b.enforce_limits()
            poll = 0.05 if exited_at else 0.1
            for key, _ in sel.select(timeout=min(deadline - now, poll)):
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
            b.truncated = b.truncated or any(fd in truncated for fd in (b.proc.stdout.fileno(), b.proc.stderr.fileno()))


# ---- what the system permits -------------------------------------------------------------------
UNCONFINED_ENV = "FASTDLLM_SANDBOX_UNCONFINED"  # "1": run programs with rlimits only, where nothing more works


class SandboxUnavailable(RuntimeError):
    """No confinement could be set up here; untrusted code is not run."""


def candidate_plans() -> list[Plan]:
    """The confinement levels to try, strongest first. A plan that runs programs as the caller's
    own user with no namespace at all (rlimits only) is tried only when `FASTDLLM_SANDBOX_UNCONFINED=1`
    says so: as root it would run untrusted code as root. Limits per box (a control group) come
    with every plan where the machine lets us make control groups; elsewhere the box's process
    tree is metered instead (logged)."""
    limits = cgroup.available()
    if not limits:
        log.warning(
            "sandbox: no writable control groups here: a box's CPU and memory are summed over its "
            "process tree while it runs, and its memory is split between at most %d processes",
            SandboxConfig.processes_without_group,
        )
    if os.geteuid() == 0:
        full = Plan(
            drop_user=True,
            new_net=True,
            new_root=True,
            pid_ns=True,
            seccomp=platform.machine() in ("x86_64", "aarch64"),
            box_limits=limits,
        )
        plans = [
            full,
            replace(full, seccomp=False),
            replace(full, pid_ns=False, seccomp=False),
            Plan(drop_user=True, new_net=True, box_limits=limits),
            Plan(drop_user=True, box_limits=limits),
        ]
    else:
        plans = [Plan(user_namespace=True, new_net=True, box_limits=limits)]
    if os.environ.get(UNCONFINED_ENV) == "1":
        plans.append(Plan())
    return plans


def probe(plan: Plan) -> tuple[Plan | None, str]:
    """Run a tiny program under `plan`: (the plan, with what it found, e.g. its own /proc; or None
    if it did not run, and why)."""
    try:
        box = Box(
            {"probe.py": "import os, socket\nprint(os.getuid())\n"},
            ["probe.py"],
            SandboxConfig(timeout=20.0),
            plan,
            site=False,
        )
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
                        log.warning(
                            "sandbox: weaker confinement (%s); stronger plans failed: %s",
                            ", ".join(found.protections()),
                            "; ".join(failures),
                        )
                    _plan = found
                    break
                failures.append(f"{plan}: {why}")
            else:
                raise SandboxUnavailable(
                    "no confinement works on this machine, so untrusted code is not run ("
                    + "; ".join(failures)
                    + f"). To run it with resource limits only, set {UNCONFINED_ENV}=1."
                )
        return _plan


# ---- many programs -----------------------------------------------------------------------------
def map_in_order(fn, items: Sequence, workers: int, on_result=None) -> list:
    """`fn` over `items`, `workers` at a time in threads (the plan probed once, first); results
    in input order, `on_result(index, result)` as each finishes."""
    current_plan()  # probe once, before the threads
    results: list = [None] * len(items)

    def one(i: int) -> None:
        results[i] = fn(items[i])
        if on_result is not None:
            on_result(i, results[i])

    if workers <= 1 or len(items) <= 1:
        for i in range(len(items)):
            one(i)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for f in [pool.submit(one, i) for i in range(len(items))]:
                f.result()
    return results
