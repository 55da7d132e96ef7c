"""Does a request get the same answer under load as alone? `fastdllm serve` in a subprocess.

    python benchmarks/same_answer_under_load.py [--dtypes bfloat16 float32] [--out FILE]

For each dtype, with `--deterministic` off and on: 24 chat requests (arith questions behind 0 to 4
solved examples, so prompts of mixed lengths; up to 256 tokens; thresholds 0.9, 0.7 and 0.5;
every third one streamed; every fourth with n=2; greedy) are sent one at a time (alone), then all
at once, then staggered (each after a random delay of up to `--spread` seconds, so that some join
a running batch). Printed: how many of the
24 requests' answers (every choice) under each load equal their answers alone.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from load_server import start_server


def requests_of(n: int) -> list[dict]:
    from fastdllm.evaluation.tasks import arith

    pool = arith.fewshot_pool()
    out = []
    for i, p in enumerate(arith.test_split()[:n]):
        shots = pool[: i % 5]
        content = arith.format_prompt(p.question, shots)
        out.append(
            {
                "model": "llada-arith",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 256,
                "temperature": 0,
                "threshold": (0.9, 0.7, 0.5)[i % 3],
                "stream": i % 3 == 0,
                "n": 2 if i % 4 == 0 else 1,
            }
        )
    return out


def ask(url: str, body: dict, delay: float = 0.0) -> list[str]:
    time.sleep(delay)
    if not body["stream"]:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    texts = [""] * body["n"]
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
    return texts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--spread", type=float, default=1.5, help="staggered arrivals: delays up to this many seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bodies = requests_of(args.requests)
    rows = []
    for dtype in args.dtypes:
        for deterministic in (False, True):
            serve = argparse.Namespace(
                max_tokens=256,
                block_length=32,
                model=args.model,
                device=None,
                threads=args.threads,
                serve_args=f"--dtype {dtype}" + (" --deterministic" if deterministic else ""),
            )
            proc, url = start_server(serve, 16)
            try:
                alone = [ask(url, b) for b in bodies]
                with ThreadPoolExecutor(len(bodies)) as pool:
                    together = list(pool.map(lambda b: ask(url, b), bodies))
                rng = random.Random(0)
                delays = [rng.uniform(0, args.spread) for _ in bodies]
                with ThreadPoolExecutor(len(bodies)) as pool:
                    staggered = list(pool.map(lambda bd: ask(url, *bd), zip(bodies, delays)))
                joined = httpx.get(url + "/health").json().get("joined")
            finally:
                proc.terminate()
                proc.wait(30)
            row = {
                "dtype": dtype,
                "deterministic": deterministic,
                "requests": len(bodies),
                "together_as_alone": sum(a == b for a, b in zip(alone, together)),
                "staggered_as_alone": sum(a == b for a, b in zip(alone, staggered)),
                "joined": joined,
            }
            rows.append(row)
            print(
                f"{dtype:9s} deterministic={'on ' if deterministic else 'off'}: all at once "
                f"{row['together_as_alone']}/{len(bodies)} as alone, staggered {row['staggered_as_alone']}/"
                f"{len(bodies)} ({joined} requests joined a running batch)",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
