"""Limits on a box as a whole where no control group can be made: its processes are the
launcher's descendants (the launcher is their child subreaper, so none leaves its tree), read from
/proc while the box runs.

CPU time is the sum over the tree of each process's own time and that of its reaped children,
so a process that forked and waited is counted once, and one that ended is counted through the
process that reaped it. Memory is the sum of resident memory: pages shared after a fork count once
per process, so the sum errs on the side of the limit. Both are read when the host polls (every
0.1 s), so a box may overshoot by what it spends between two polls; each process's own rlimits
(`Box._rlimits`) hold meanwhile.
"""

from __future__ import annotations

import os

from .launcher import descendants, kill_descendants, proc_stat

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class ProcessTree:
    """The processes of one box, found from its launcher's pid. Same questions as `BoxGroup`."""

    def __init__(self, root: int, memory_bytes: int):
        self.root, self.memory_bytes = root, memory_bytes
        self._cpu = 0.0
        self._over_memory = False

    def _members(self) -> dict[int, tuple]:
        members = descendants(self.root)
        st = proc_stat(self.root)
        if st is not None:
            members[self.root] = st
        return members

    def cpu_seconds(self) -> float:
        """CPU seconds of the box so far (the largest sum read: a process between its end and its
        parent's wait is briefly in neither)."""
        members = self._members()
        self._cpu = max(self._cpu, sum(st[2] for st in members.values()) / _TICK)
        if sum(st[3] for st in members.values()) * _PAGE > self.memory_bytes:
            self._over_memory = True
        return self._cpu

    def out_of_memory(self) -> bool:
        """Whether the box's resident memory, summed over its processes, was read above its limit."""
        return self._over_memory

    def kill(self) -> None:
        """SIGKILL every descendant of the launcher until none is left (the launcher is killed by
        its process group)."""
        kill_descendants(self.root, reap=False)
