"""Load test of `fastdllm serve`: requests/s, tokens/s and time to the first streamed block.

Starts the server as a subprocess once per --max-batch-size setting (batching on: 8, off: 1), then
for each client concurrency sends `--requests` streaming chat requests (arith test questions,
`--max-tokens` tokens, temperature > 0 with one seed per request) from that many threads, and reports:

  req/s        finished requests per second of wall time
  tok/s        completion tokens (usage.completion_tokens) per second of wall time
  TTFB p50/p90 time from sending a request to its first block of text (the first chunk after the
               role chunk), in seconds; it includes queueing
  latency p50  time to the end of the stream
  rows/batch   mean rows per generate call in the server (from /health)

    python benchmarks/load_server.py                           # 32 requests per setting
    python benchmarks/load_server.py --requests 16 --concurrency 1 4 16 --batch-sizes 8 1
    python benchmarks/load_server.py --serve-args "--threshold 0.7 --cache prefix"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(args, batch_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "fastdllm",
        "serve",
        "--port",
        str(port),
        "--max-batch-size",
        str(batch_size),
        "--max-queue",
        "1024",
        "--gen-length",
        str(args.max_tokens),
        "--block-length",
        str(args.block_length),
        "--log-level",
        "warning",
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.device:
        cmd += ["--device", args.device]
    cmd += shlex.split(args.serve_args)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url)
    return proc, url


def wait_until_up(proc: subprocess.Popen, url: str, route: str = "/health", seconds: float = 300) -> None:
    """Until the server answers `route` with 200; its stderr if it exits first."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(url + route, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def questions(n: int) -> list[str]:
    try:
        from fastdllm.evaluation.tasks.arith import test_split

        pool = [p.question for p in test_split()]
    except Exception:  # the task module is optional for this script
        pool = ["Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"]
    return [pool[i % len(pool)] for i in range(n)]


def chunks_of(response):
    """The JSON chunks of a streamed (SSE) response, up to `[DONE]`."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def one_request(url: str, model: str, question: str, seed: int, args) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, tokens, chunks = None, 0, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for chunk in chunks_of(r):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                if "role" in c["delta"]:
                    continue
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    return {
        "ttfb": first if first is not None else time.perf_counter() - t0,
        "latency": time.perf_counter() - t0,
        "tokens": tokens,
        "chunks": chunks,
    }


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_setting(url: str, model: str, concurrency: int, args) -> dict:
    qs = questions(args.requests)
    before = httpx.get(url + "/health").json()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one_request(url, model, qs[i], 1000 + i, args), range(args.requests)))
    wall = time.perf_counter() - t0
    after = httpx.get(url + "/health").json()
    batches = after["batches"] - before["batches"]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "req_per_s": len(results) / wall,
        "tok_per_s": sum(r["tokens"] for r in results) / wall,
        "ttfb_p50": statistics.median(r["ttfb"] for r in results),
        "ttfb_p90": pct([r["ttfb"] for r in results], 0.9),
        "latency_p50": statistics.median(r["latency"] for r in results),
        "rows_per_batch": (after["rows"] - before["rows"]) / batches if batches else 0.0,
        "mean_tokens": statistics.mean(r["tokens"] for r in results),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--device", default=None)
    p.add_argument("--requests", type=int, default=32, help="requests per setting (default %(default)s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 1], help="--max-batch-size values")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server (0: leave as is)")
    p.add_argument("--serve-args", default="", help="more flags for `fastdllm serve`, e.g. '--threshold 0.7'")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)

    rows = []
    for bs in args.batch_sizes:
        proc, url = start_server(args, bs)
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            for i in range(2):  # warm-up
                one_request(url, model, questions(1)[0], i, args)
            for c in args.concurrency:
                row = {"max_batch_size": bs, **run_setting(url, model, c, args)}
                rows.append(row)
                print(
                    f"batch {bs:>2} clients {c:>2}: {row['req_per_s']:.2f} req/s {row['tok_per_s']:.1f} tok/s "
                    f"TTFB p50 {row['ttfb_p50']:.3f}s",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()

    print(
        f"\n{args.requests} streaming chat requests per row, max_tokens {args.max_tokens}, block "
        f"{args.block_length}, temperature {args.temperature}, server threads {args.threads or 'default'}"
        + (f", serve args: {args.serve_args}" if args.serve_args else "")
    )
    print("| max batch | clients | req/s | tok/s | TTFB p50 (s) | TTFB p90 (s) | latency p50 (s) | rows/batch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['max_batch_size']} | {r['concurrency']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | "
            f"{r['ttfb_p50']:.3f} | {r['ttfb_p90']:.3f} | {r['latency_p50']:.3f} | {r['rows_per_batch']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
