"""Limits on a box as a whole: one control group per box for memory, processes and CPU time.

Resource limits (`setrlimit`) hold per process: six children of one answer could each take the
whole memory budget, and four spinning children could spend four times the CPU budget. A control
group counts every process of the box together: `memory` (the box's resident memory, swap
included where the kernel accounts it; the kernel's OOM killer stops the box at the limit),
`pids` (processes and threads), and CPU time, which the host reads while the box runs and stops
the box at its budget. Killing "every process of the box" is then exact: the group's members.

Both kernel interfaces are handled: cgroup v2 (one unified tree, with the memory, pids and cpu
controllers delegated to our own group's children) and cgroup v1 (a `memory`, a `pids` and a
`cpuacct` hierarchy). Groups are made under the caller's own group, so any limit above us still
holds. Where neither is writable, `available()` says so and boxes fall back to their process
tree (`tree.py`: CPU and resident memory summed over the launcher's descendants, the memory split
between a few processes of the box's uid); `protections()` then has no "box_limits".
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

_V1_CONTROLLERS = ("memory", "pids", "cpuacct")
_names = itertools.count()
_layout_lock = threading.Lock()
_layout: tuple[str, dict[str, str]] | None | bool = False  # False: not probed yet


def _own_groups() -> dict[str, str]:
    """Controller name (or "" for v2) -> this process's group path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _mounts() -> dict[str, str]:
    """Controller name (or "" for the v2 tree) -> its mount point, from /proc/self/mountinfo."""
    out = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split(" ", 2) if right.count(" ") >= 2 else (right, "", "")
            point = left.split(" ")[4]
            if fstype == "cgroup2":
                out.setdefault("", point)
            elif fstype == "cgroup":
                for opt in options.strip().split(","):
                    if opt in _V1_CONTROLLERS:
                        out.setdefault(opt, point)
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _find_layout() -> tuple[str, dict[str, str]] | None:
    """("v2", {"": parent}) or ("v1", {controller: parent}) where boxes' groups can be made."""
    try:
        mounts, own = _mounts(), _own_groups()
    except OSError:
        return None
    if "" in mounts and "" in own:
        parent = os.path.join(mounts[""], own[""].lstrip("/"))
        try:
            have = _read(os.path.join(parent, "cgroup.controllers")).split()
            if all(c in have for c in ("memory", "pids", "cpu")):
                enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
                if not all(c in enabled for c in ("memory", "pids", "cpu")):
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids +cpu")
                return "v2", {"": parent}
        except OSError:
            pass
    if all(c in mounts and c in own for c in _V1_CONTROLLERS):
        parents = {c: os.path.join(mounts[c], own[c].lstrip("/")) for c in _V1_CONTROLLERS}
        if all(os.access(p, os.W_OK) for p in parents.values()):
            return "v1", parents
    return None


def _get_layout():
    global _layout
    with _layout_lock:
        if _layout is False:
            _layout = _find_layout()
            if _layout is not None:  # one trial group proves that we may make and limit groups
                try:
                    BoxGroup._make(_layout, memory_bytes=64 << 20, max_processes=8).remove()
                except OSError:
                    _layout = None
        return _layout


def available() -> bool:
    """Whether boxes can be limited as a whole on this machine (probed once)."""
    return _get_layout() is not None


class BoxGroup:
    """The control group(s) of one box. The launcher joins them (`procs_files`) before it does
    anything else, so every process of the box is a member from its first instruction."""

    def __init__(self, version: str, dirs: dict[str, str]):
        self.version, self.dirs = version, dirs

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> BoxGroup | None:
        layout = _get_layout()
        return None if layout is None else cls._make(layout, memory_bytes, max_processes)

    @classmethod
    def _make(cls, layout, memory_bytes: int, max_processes: int) -> BoxGroup:
        version, parents = layout
        name = f"fastdllm-box-{os.getpid()}-{next(_names)}"
        dirs = {c: os.path.join(p, name) for c, p in parents.items()}
        group = cls(version, {})
        try:
            for c, d in dirs.items():
                os.mkdir(d, 0o700)
                group.dirs[c] = d
            if version == "v2":
                d = dirs[""]
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                _write(os.path.join(d, "memory.oom.group"), "1")  # the box as a whole, not one process
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_processes))
            else:
                _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"), str(memory_bytes))
                memsw = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    try:  # swap accounting may be off (the file is there, writing fails)
                        _write(memsw, str(memory_bytes))
                    except OSError:
                        pass
                _write(os.path.join(dirs["pids"], "pids.max"), str(max_processes))
        except OSError:
            group.remove()
            raise
        return group

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def cpu_seconds(self) -> float:
        """CPU time of every process the box ever had (live and exited)."""
        try:
            if self.version == "v2":
                for line in _read(os.path.join(self.dirs[""], "cpu.stat")).splitlines():
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        return int(value) / 1e6
                return 0.0
            return int(_read(os.path.join(self.dirs["cpuacct"], "cpuacct.usage"))) / 1e9
        except (OSError, ValueError):
            return 0.0

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the box at its memory limit."""
        try:
            if self.version == "v2":
                text = _read(os.path.join(self.dirs[""], "memory.events"))
            else:
                text = _read(os.path.join(self.dirs["memory"], "memory.oom_control"))
        except (OSError, ValueError):
            return False
        counts = dict(line.split(" ", 1) for line in text.splitlines() if line.count(" ") == 1)
        return any(int(counts.get(k, "0")) > 0 for k in ("oom_kill", "oom_group_kill"))

    def members(self) -> list[int]:
        pids = set()
        for path in self.procs_files:
            try:
                pids.update(int(x) for x in _read(path).split())
            except (OSError, ValueError):
                pass
        return sorted(pids)

    def kill(self) -> None:
        """SIGKILL every member until none is left (a process with a pending SIGKILL cannot
        complete a fork, and `pids.max` bounds how many there are)."""
        kill_file = os.path.join(self.dirs.get("", ""), "cgroup.kill")
        if self.version == "v2" and os.path.exists(kill_file):
            try:
                _write(kill_file, "1")
            except OSError:
                pass
        for _ in range(100):
            pids = self.members()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        """Remove the group(s); a member that is still exiting delays it for a moment."""
        for c, d in list(self.dirs.items()):
            for attempt in range(200):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt % 20 == 19:
                        self.kill()
                    time.sleep(0.005)
            self.dirs.pop(c, None)
