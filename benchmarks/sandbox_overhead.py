"""Sandbox cost: per-program overhead over a bare interpreter, and HumanEval scoring throughput.

    python benchmarks/sandbox_overhead.py [--runs 30] [--workers 2] [--skip-humaneval]

Overhead = median wall time of `sandbox.run_program("pass")` minus the median of a bare
`subprocess.run([sys.executable, "-I", "-c", "pass"])`, both run one at a time; "judged" is one
`sandbox.judge` of a one-line solution against a one-line test (two sandboxed processes, what
each HumanEval/MBPP answer costs). HumanEval: all 164 canonical solutions scored through the
pipeline (post-processing + judge) with `--workers` checks at a time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--skip-humaneval", action="store_true")
    args = p.parse_args(argv)

    from fastdllm import sandbox

    print("protections:", ", ".join(sandbox.protections()))
    bare = median_time(lambda: subprocess.run([sys.executable, "-I", "-c", "pass"], check=True), args.runs)
    boxed = median_time(lambda: sandbox.run_program("pass"), args.runs)
    check = sandbox.CodeCheck("def f(x):\n    return x + 1\n", "assert f(1) == 2\n", remote=("f",))
    judged = median_time(lambda: sandbox.judge(check), args.runs)
    print(f"bare interpreter  {bare * 1000:7.1f} ms (median of {args.runs})")
    print(f"sandboxed         {boxed * 1000:7.1f} ms")
    print(f"overhead          {(boxed - bare) * 1000:7.1f} ms per program")
    print(f"judged            {judged * 1000:7.1f} ms per check (solution and tests in two processes)")
    if not args.skip_humaneval:
        from fastdllm.evaluation.tasks import get_task

        task = get_task("humaneval")
        docs = task.load()
        t0 = time.perf_counter()
        with task.scorer(workers=args.workers) as scorer:
            scores = scorer.score(docs, [d.data["canonical_solution"] for d in docs])
        dt = time.perf_counter() - t0
        print(
            f"humaneval canonical: {sum(s.correct for s in scores)}/{len(docs)} passed in {dt:.2f}s "
            f"({args.workers} workers, {len(docs) / dt:.1f} programs/s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
