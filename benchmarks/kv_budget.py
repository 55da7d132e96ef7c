"""`serve --kv-cache-memory` under a burst: many long requests at once against a small budget.

Starts `fastdllm serve` with the budget, sends `--requests` chat requests at once (8-shot prompts,
`--max-tokens` each, stop at EOS off so that every answer is as long as asked), and reports how many
were answered and how many failed, the most K/V bytes in use that /health reported while they ran,
and the server's peak resident memory (VmHWM) against its resident memory once loaded.

    python benchmarks/kv_budget.py --out docs/results/kv_budget.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.load_server import free_port, wait_until_up  # noqa: E402
from benchmarks.serving_workload import messages  # noqa: E402


def rss(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llada-arith", help="an embedded model (default %(default)s)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--kv-mib", type=int, default=48)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument(
        "--serve-args", default="", help='more `fastdllm serve` flags, e.g. "--max-num-batched-tokens 4096"'
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "fastdllm", "serve", "--port", str(port), "--max-queue", str(args.requests)]
    cmd += ["--model", args.model, "--kv-cache-memory", str(args.kv_mib), "--max-batch-size", str(args.max_batch_size)]
    cmd += args.serve_args.split()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url, "/ready")
        loaded = rss(proc.pid, "VmRSS")
        peak_kv, done = 0, threading.Event()

        def watch():
            nonlocal peak_kv
            while not done.is_set():
                peak_kv = max(peak_kv, httpx.get(url + "/health", timeout=5).json().get("kv_bytes_in_use", 0))
                time.sleep(0.2)

        def ask(msgs):
            body = {"model": args.model, "messages": msgs, "max_tokens": args.max_tokens, "stop_at_eos": False}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600)
            return r.status_code, (r.json().get("usage") or {}).get("completion_tokens", 0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            answers = list(pool.map(ask, messages(args.requests, 8)))
        seconds = time.perf_counter() - t0
        done.set()
        health = httpx.get(url + "/health", timeout=5).json()
        result = {
            "model": args.model,
            "serve_args": args.serve_args,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "kv_cache_memory_bytes": args.kv_mib << 20,
            "answered": sum(code == 200 for code, _ in answers),
            "failed": sum(code != 200 for code, _ in answers),
            "completion_tokens": sum(n for _, n in answers),
            "seconds": round(seconds, 1),
            "peak_kv_bytes_in_use": peak_kv,
            "max_batch_rows": health.get("max_batch_rows"),
            "rss_loaded_bytes": loaded,
            "rss_peak_bytes": rss(proc.pid, "VmHWM"),
        }
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
