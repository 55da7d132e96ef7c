"""What one long prompt joining a running batch does to the rows already decoding: the case
chunked prefill (`prefill_chunk`) is for.

Starts `fastdllm serve` (a block-causal twin by default) once per `--serve-args` variant, in turns,
`--rounds` times. Each time `--short` streamed chat requests (0-shot arith, `max_tokens` 256, stop at
EOS off, so that they decode throughout) start together; once they stream, `--long` requests with
long prompts that share no exemplars (each a different order of the few-shot pool) arrive
`--gap-ms` apart. Reported per variant: the short requests' longest wait between two content
chunks (p50 / p90 over the requests: the stall a long prefill causes), their end-to-end latency
(p50), and the long requests' end-to-end latency (p50; the embedded twins answer prompts this long
with the end token alone, so their latency, not their text, is what they give).

    python benchmarks/long_prompt_stall.py --serve-args "--prefill-chunk none" "--prefill-chunk 256"
"""

from __future__ import annotations

import argparse
import json
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


def short_messages(n: int) -> list[list[dict]]:
    from fastdllm.evaluation.tasks import arith

    return [[{"role": "user", "content": arith.format_prompt(p.question, [])}] for p in arith.test_split()[:n]]


def long_messages(n: int, shots: int) -> list[list[dict]]:
    from fastdllm.evaluation.tasks import arith

    pool, out = arith.fewshot_pool(), []
    for i, p in enumerate(arith.test_split()[100 : 100 + n]):
        exemplars = random.Random(i).sample(pool, shots)  # another order each: no shared prefix
        out.append([{"role": "user", "content": arith.format_prompt(p.question, exemplars)}])
    return out


def stream(url: str, model: str, msgs, max_tokens: int, out: dict) -> None:
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "stream": True, "stop_at_eos": False}
    t0 = time.perf_counter()
    times = []
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for chunk in chunks_of(r):
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    out.update(first=times[0] - t0 if times else None, latency=time.perf_counter() - t0, gap=max(gaps, default=0.0))


def run(url: str, model: str, shorts, longs, gap: float) -> dict:
    short_out, long_out = [{} for _ in shorts], [{} for _ in longs]
    threads = [threading.Thread(target=stream, args=(url, model, m, 256, o)) for m, o in zip(shorts, short_out)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the short requests are decoding
    for m, o in zip(longs, long_out):
        t = threading.Thread(target=stream, args=(url, model, m, 32, o))
        t.start()
        threads.append(t)
        time.sleep(gap)
    for t in threads:
        t.join()
    gaps = sorted(o["gap"] for o in short_out)
    return {
        "short_gap_p50": statistics.median(gaps),
        "short_gap_p90": statistics.quantiles(gaps, n=10, method="inclusive")[8],
        "short_latency_p50": statistics.median(o["latency"] for o in short_out),
        "long_latency_p50": statistics.median(o["latency"] for o in long_out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sdar-arith")
    ap.add_argument("--serve-args", nargs="+", default=["--prefill-chunk none", "--prefill-chunk 256"])
    ap.add_argument("--short", type=int, default=12)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--shots", type=int, default=16)
    ap.add_argument("--gap-ms", type=float, default=300.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    shorts, longs = short_messages(args.short), long_messages(args.long, args.shots)
    rows = []
    for rnd in range(args.rounds):
        for extra in args.serve_args:
            port = free_port()
            cmd = [sys.executable, "-m", "fastdllm", "serve", "--model", args.model, "--port", str(port)]
            cmd += ["--max-batch-size", str(args.short + args.long)] + extra.split()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until_up(proc, url, "/ready")
                m = run(url, args.model, shorts, longs, args.gap_ms / 1000)
            finally:
                proc.terminate()
                proc.wait(30)
            row = {"model": args.model, "serve_args": extra, "round": rnd, **{k: round(v, 3) for k, v in m.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
