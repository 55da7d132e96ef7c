"""Run untrusted Python in a sandbox, and judge model-written code with tests it cannot touch.

Two entry points:

- `judge(check)`: the verdict on a solution against its tests (what `fastdllm eval` uses for
  HumanEval and MBPP). The tests and the solution never share an interpreter: the tests run in
  one sandboxed process with stand-ins for the solution's functions; each call goes to a second
  sandboxed process that runs the solution; arguments and results cross as data only
  (`sandbox.wire`), never as objects; the tests' process decides and reports over a pipe that only
  it holds. A solution can crash, hang, lie, print or exit as it likes: all that reaches the tests
  is a plain value, so a forged marker, a trace hook that skips asserts, an object that equals
  everything or a patched `abs` cannot pass.
- `run_program(source)`: run one program and report how it ended ("passed" = exit status 0 after
  running to its end, checked by a marker the epilogue writes). The program can forge that
  marker, so use it to run code, not to judge it.

How each process is confined (`launcher.py` has the details; `protections()` says which hold
here, and every result records them):

always: a fresh `python -I` (no PYTHON* variables, no user site), its own session, a scrubbed
environment, resource limits (CPU time, address space, file size, open files, no core dumps),
stdin from /dev/null, stdout/stderr kept up to a bound, `PR_SET_NO_NEW_PRIVS`. The CPU limit
decides "timeout"; a generous wall clock is only a backstop for programs that wait.

as root (full set where the kernel permits): its own uid per run, held by no other live box
(processes bounded by RLIMIT_NPROC, killed by uid afterwards, unconditionally), new network,
IPC, UTS, mount and PID namespaces, a minimal read-only root (system folders, the interpreter; no
/run, no host sockets, no world-writable host folder, not this package or its data), its folder
and /tmp on size-limited tmpfs that vanish with it, its own /proc, a seccomp filter allowing only
Unix and IP sockets and refusing the kernel keyrings and new namespaces. Not root: a user +
network namespace where permitted, which leaves files of our user writable: run as root (a
container) for the full set.

where control groups are writable (`box_limits`): memory, processes and CPU time are limited for
the box's processes together (`sandbox.cgroup`), so an answer that forks cannot multiply its
budget, and "every process of the box" is exactly the group's members.

The strongest of these that runs here is probed once; a weaker one is logged with why the stronger
failed. Where none runs, `SandboxUnavailable` says why and no untrusted code runs: resource limits
alone (no namespace, no other user) only with `FASTDLLM_SANDBOX_UNCONFINED=1`.

Verdicts: "passed", "failed" (an exception, a failed assert, a non-zero exit; the reason is the
last line), "timeout" (the CPU limit, or the wall-clock backstop), "crashed" (killed by a signal,
or could not start).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from .box import (
    UID_BASE,
    VERDICTS,
    Box,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    current_plan,
    drive,
    last_line,
    map_in_order,
    memory_reason,
)
from .judge import CodeCheck, free_names, judge, judge_many

__all__ = [
    "CodeCheck",
    "SandboxConfig",
    "SandboxResult",
    "UID_BASE",
    "VERDICTS",
    "free_names",
    "judge",
    "judge_many",
    "protections",
    "run_many",
    "run_program",
    "SandboxUnavailable",
]


def protections() -> tuple[str, ...]:
    """The protections in force on this machine (probed on first use)."""
    return current_plan().protections()


def _run(source: str, config: SandboxConfig) -> SandboxResult:
    plan = current_plan()
    token = secrets.token_hex(16)
    marker_r, marker_w = os.pipe()
    epilogue = f"\n\nimport os as _sandbox_os\n_sandbox_os.write({marker_w}, {token.encode()!r})\n"
    marker = bytearray()
    box = None
    try:
        box = Box({"program.py": source + epilogue}, ["program.py"], config, plan, pass_fds=(marker_w,))
        os.close(marker_w)
        marker_w = -1
        wall_hit = drive([box], config.wall_seconds, extra={marker_r: (marker, 256)})
    except OSError as e:
        return SandboxResult("crashed", f"could not start: {e}", None, "", "", 0.0, plan.protections())
    finally:
        if box is not None:
            box.finish()
        for fd in (marker_r, marker_w):
            if fd >= 0:
                os.close(fd)
    duration = time.perf_counter() - box.started
    stdout, stderr = (bytes(b).decode("utf-8", errors="replace") for b in (box.out, box.err))
    kind, detail, rc, cpu = box.ending()
    if wall_hit:
        verdict, reason = "timeout", f"wall-clock backstop of {config.wall_seconds:g}s exceeded"
    elif kind == "start":
        verdict, reason = "crashed", f"could not start: {detail}"
    elif kind == "cpu":
        verdict, reason = "timeout", f"CPU time limit of {config.timeout:g}s exceeded"
    elif kind == "memory":
        verdict, reason = "crashed", memory_reason(config)
    elif kind == "signal":
        verdict, reason = "crashed", f"killed by {detail}" + (f" ({last_line(stderr)})" if last_line(stderr) else "")
    elif rc != 0:
        verdict, reason = "failed", last_line(stderr) or f"exit status {rc}"
    elif token.encode() not in bytes(marker):
        verdict, reason = "failed", "exited with status 0 before the end of the program (tests did not all run)"
    else:
        verdict, reason = "passed", ""
    return SandboxResult(verdict, reason, rc, stdout, stderr, duration, plan.protections(), box.truncated, cpu)


def run_program(source: str, config: SandboxConfig | None = None, **overrides) -> SandboxResult:
    """Run a Python program in the sandbox. `overrides` are SandboxConfig fields (timeout=...)."""
    return _run(source, replace(config or SandboxConfig(), **overrides))


def run_many(
    sources: Sequence[str],
    config: SandboxConfig | None = None,
    workers: int = 2,
    on_result: Callable[[int, SandboxResult], None] | None = None,
) -> list[SandboxResult]:
    """Run programs `workers` at a time; results in input order. `on_result(index, result)` is
    called as each finishes (from a worker thread)."""
    config = config or SandboxConfig()
    return map_in_order(lambda s: _run(s, config), sources, workers, on_result)
