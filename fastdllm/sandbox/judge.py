"""Judge a solution against its tests in two sandboxed processes that share only data.

`CodeCheck` says what to run where: the untrusted `solution` (then the task's trusted `setup`,
which may use the solution's classes) in the solution's process; the trusted `prelude` and
`tests` in the tests' process, where each name in `remote` stands for the solution's global of
that name. `judge` wires three pipes (requests, replies, verdict), runs both boxes, and reads the
verdict that only the tests' process can write.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .box import UIDS, Box, SandboxConfig, SandboxResult, current_plan, drive, last_line, map_in_order, memory_reason

_HERE = Path(__file__).resolve().parent
_WIRE = (_HERE / "wire.py").read_text(encoding="utf-8")
_SOLUTION_SIDE = (_HERE / "solution_side.py").read_text(encoding="utf-8")
_TESTS_SIDE = (_HERE / "tests_side.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class CodeCheck:
    solution: str  # untrusted: the model's code
    tests: str  # trusted: raises (e.g. a failed assert) unless the solution is right
    remote: tuple[str, ...]  # names the tests call that are the solution's
    prelude: str = ""  # trusted: run before the tests, in their process (e.g. the prompt's helpers)
    setup: str = ""  # trusted: run after the solution, in its process (may use its classes)
    label: str = field(default="", compare=False)


def free_names(source: str) -> list[str]:
    """Names that `source` reads and never binds (in any scope), in order of first use."""
    tree = ast.parse(source)
    bound, loaded = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                loaded.append((node.lineno, node.col_offset, node.id))
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return list(dict.fromkeys(n for _, _, n in sorted(loaded) if n not in bound))


def top_level_names(source: str) -> set[str]:
    """Names a module binds at its top level (functions, classes, assignments, imports)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def remote_names(tests: str, defined_by_reference: set[str]) -> tuple[str, ...]:
    """The names of `tests` that must mean the solution's: those it reads without binding,
    except built-ins (a solution must not replace `abs` or `sorted` under the tests) unless the
    task's own reference solution defines that name (MBPP 126 asks for a function `sum`)."""
    return tuple(n for n in free_names(tests) if not hasattr(builtins, n) or n in defined_by_reference)


def judge(check: CodeCheck, config: SandboxConfig | None = None) -> SandboxResult:
    """The verdict on `check.solution` against `check.tests` (see the module docstring)."""
    config = config or SandboxConfig()
    plan = current_plan()
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    verdict = bytearray()
    boxes: list[Box] = []
    # both uids at once: concurrent judges that each held one and waited for another could stall
    uids = UIDS.acquire(2) if plan.drop_user else [None, None]
    t0 = time.perf_counter()
    try:
        solution_box = Box(
            {
                "solution_side.py": _SOLUTION_SIDE,
                "wire.py": _WIRE,
                "solution.py": check.solution,
                "setup.py": check.setup,
            },
            ["solution_side.py", str(req_r), str(resp_w)],
            config,
            plan,
            pass_fds=(req_r, resp_w),
            site=False,
            uid=uids.pop(0),
        )
        boxes.append(solution_box)
        tests_box = Box(
            {
                "tests_side.py": _TESTS_SIDE,
                "wire.py": _WIRE,
                "prelude.py": check.prelude,
                "tests.py": check.tests,
                "remote.json": json.dumps(list(check.remote)),
            },
            ["tests_side.py", str(req_w), str(resp_r), str(verdict_w)],
            config,
            plan,
            pass_fds=(req_w, resp_r, verdict_w),
            site=False,
            uid=uids.pop(0),
        )
        boxes.append(tests_box)
        for fd in (req_r, resp_w, req_w, resp_r, verdict_w):
            os.close(fd)
        req_r = resp_w = req_w = resp_r = verdict_w = -1
        wall_hit = drive(boxes, config.wall_seconds, extra={verdict_r: (verdict, 1 << 16)}, primary=[tests_box])
        if not wall_hit and _solution_gone(verdict):
            # The tests saw the solution's process stop: let it end by itself (its launcher
            # reports how), so that the reason never depends on how soon our cleanup kills it.
            wall_hit = drive([solution_box], config.wall_seconds)
    except OSError as e:
        return SandboxResult(
            "crashed", f"could not start: {e}", None, "", "", time.perf_counter() - t0, plan.protections()
        )
    finally:
        for b in boxes:
            b.finish()
        for uid in uids:  # taken for a box that was never made
            if uid is not None:
                UIDS.release(uid)
        for fd in (req_r, resp_w, req_w, resp_r, verdict_w, verdict_r):
            if fd >= 0:
                os.close(fd)
    duration = time.perf_counter() - t0
    out, err, test_err = (
        bytes(b).decode("utf-8", errors="replace") for b in (solution_box.out, solution_box.err, tests_box.err)
    )
    verdict_, reason = _decide(config, wall_hit, tests_box, solution_box, bytes(verdict), test_err)
    _, _, rc, cpu = tests_box.ending()
    return SandboxResult(
        verdict_, reason, rc, out, err, duration, plan.protections(), solution_box.truncated or tests_box.truncated, cpu
    )


def _outcome(verdict: bytes) -> dict | None:
    try:
        outcome = json.loads(verdict.splitlines()[0])
    except (ValueError, IndexError):
        return None
    return outcome if isinstance(outcome, dict) else None


def _solution_gone(verdict: bytes) -> bool:
    outcome = _outcome(verdict)
    return bool(outcome and outcome.get("solution_gone"))


def _decide(config, wall_hit, tests_box, solution_box, verdict: bytes, test_err: str) -> tuple[str, str]:
    if wall_hit:
        return "timeout", f"wall-clock backstop of {config.wall_seconds:g}s exceeded"
    kind, detail, rc, _ = tests_box.ending()
    if kind == "start":
        return "crashed", f"could not start the tests: {detail}"
    if kind == "cpu":
        return "timeout", f"CPU time limit of {config.timeout:g}s exceeded by the tests"
    if kind == "memory":
        return "crashed", memory_reason(config) + " in the tests"
    outcome = _outcome(verdict)
    if kind == "signal" or outcome is None:
        return (
            "crashed",
            f"the tests' process ended without a verdict ({detail or f'exit status {rc}'}; {last_line(test_err)})",
        )
    if outcome.get("passed") is True and rc == 0:
        return "passed", ""
    reason = str(outcome.get("reason", ""))[:300]
    if outcome.get("solution_gone"):
        s_kind, s_detail, s_rc, _ = solution_box.ending()
        last = last_line(bytes(solution_box.err).decode("utf-8", errors="replace"))
        if s_kind == "cpu":
            return "timeout", f"CPU time limit of {config.timeout:g}s exceeded by the solution"
        if s_kind == "memory":
            return "crashed", memory_reason(config) + " in the solution"
        if s_kind == "signal":
            return "crashed", f"the solution was killed by {s_detail}" + (f" ({last})" if last else "")
        if s_kind is None:
            return "failed", f"the solution's process exited (status {s_rc}) before the tests ended" + (
                f": {last}" if last else ""
            )
        return "crashed", reason
    return "failed", reason or f"tests exited with status {rc}"


def judge_many(
    checks: Sequence[CodeCheck],
    config: SandboxConfig | None = None,
    workers: int = 2,
    on_result: Callable[[int, SandboxResult], None] | None = None,
) -> list[SandboxResult]:
    """`judge` over many checks, `workers` at a time; results in input order."""
    config = config or SandboxConfig()
    return map_in_order(lambda c: judge(c, config), checks, workers, on_result)
