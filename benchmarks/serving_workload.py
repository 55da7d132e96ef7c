"""A serving workload against `fastdllm serve`: chat requests sharing a few-shot prefix, arriving
as a Poisson process, with mixed `max_tokens`, half of them streamed.

For each model and each checkout (`--checkouts`: the code to serve, as PYTHONPATH; "." is this
one), a server starts with its defaults, the same seeded arrivals are replayed, and what the
clients saw is reported: completion tokens per second of wall time (first request sent to last
answer), time to the first content chunk of the streamed requests (p50 / p90) and end-to-end
latency (p50 / p90). Checkouts alternate, `--rounds` times, so the ratios are side by side.

    python benchmarks/serving_workload.py --checkouts /path/to/main . --out docs/results/serving
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.load_server import chunks_of, free_port, wait_until_up  # noqa: E402


def messages(n: int, shots: int) -> list[list[dict]]:
    from fastdllm.evaluation.tasks import arith

    pool = arith.fewshot_pool()[:shots]
    return [[{"role": "user", "content": arith.format_prompt(p.question, pool)}] for p in arith.test_split()[:n]]


def serve(checkout: str, model: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fastdllm", "serve", "--model", model, "--port", str(port), "--max-queue", "256"]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=checkout)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url, "/ready")
    return proc, url


def one(url: str, model: str, msgs, max_tokens: int, stream: bool, out: dict) -> None:
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "stream": stream}
    t0 = time.perf_counter()
    first, tokens = None, 0
    with httpx.Client(timeout=600) as client:
        if stream:
            body["stream_options"] = {"include_usage": True}
            with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for chunk in chunks_of(r):
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for c in chunk.get("choices", []):
                        if c["delta"].get("content") and first is None:
                            first = time.perf_counter() - t0
        else:
            r = client.post(url + "/v1/chat/completions", json=body).json()
            tokens = r["usage"]["completion_tokens"]
    out.update(latency=time.perf_counter() - t0, first=first, tokens=tokens, start=t0, end=time.perf_counter())


def workload(url: str, model: str, msgs, gap: float, seed: int) -> dict:
    rng = random.Random(seed)
    results, threads = [{} for _ in msgs], []
    for i, m in enumerate(msgs):
        t = threading.Thread(target=one, args=(url, model, m, rng.choice([64, 128, 256]), i % 2 == 0, results[i]))
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(1 / gap))
    for t in threads:
        t.join()
    firsts = [r["first"] for r in results if r["first"] is not None]
    lat = [r["latency"] for r in results]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)

    def p(xs, q):
        return statistics.quantiles(xs, n=10, method="inclusive")[q - 1]

    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / span,
        "first_chunk_p50": statistics.median(firsts),
        "first_chunk_p90": p(firsts, 9),
        "latency_p50": statistics.median(lat),
        "latency_p90": p(lat, 9),
        "requests": len(results),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkouts", nargs="+", default=["."])
    ap.add_argument("--models", nargs="+", default=["llada-arith", "sdar-arith"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--shots", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="mean time between arrivals")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--serve-args",
        nargs="+",
        default=[""],
        help='more `fastdllm serve` flags, e.g. "--prefix-cache approximate"; several: each a variant, '
        "alternated with the checkouts in every round",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default="workload", help="the results file's name in --out (NAME.jsonl)")
    args = ap.parse_args()
    msgs = messages(args.requests, args.shots)
    rows = []
    for model in args.models:
        for rnd in range(args.rounds):
            for checkout, extra in [(c, e) for c in args.checkouts for e in args.serve_args]:
                proc, url = serve(checkout, model, extra.split())
                try:
                    one(url, model, msgs[0], 64, False, {})  # warm-up
                    m = workload(url, model, msgs, args.gap_ms / 1000, seed=rnd)
                finally:
                    proc.terminate()
                    proc.wait(30)
                row = {"model": model, "checkout": checkout, "round": rnd, "serve_args": extra}
                row.update({k: round(v, 3) for k, v in m.items()})
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
