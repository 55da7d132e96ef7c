"""What `stream_options.include_canvas` costs: streamed chat requests one at a time through a live
`fastdllm serve` app (in-process, 127.0.0.1), alternating a plain stream and a canvas stream of
the same request, over `--rounds`; tokens/s of each, the canvas events per request and the bytes
each stream sent. One thread.

    python benchmarks/canvas_stream.py --problems 20 --rounds 3 [--threshold none]
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import httpx
import torch
import uvicorn

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.evaluation.tasks import arith
from fastdllm.server import ServerSettings, create_app


def serve(model, tokenizer, defaults):
    app = create_app(model, tokenizer, ServerSettings("llada-arith", defaults))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}"


def stream(url, question, canvas: bool, fields: dict) -> dict:
    body = {
        **fields,
        "model": "llada-arith",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 128,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "include_canvas": canvas},
    }
    t0 = time.perf_counter()
    events = nbytes = tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            nbytes += len(line) + 1
            events += line == "event: canvas"
            if line.startswith("data: {") and '"usage": {' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "canvas_events": events, "bytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llada-arith")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--threshold", default="0.9", help="the requests' threshold; 'none': one token per step (a canvas each)"
    )
    args = ap.parse_args()
    fields = {"threshold": None if args.threshold.lower() == "none" else float(args.threshold)}
    torch.set_num_threads(1)
    model, tok = fastdllm.load(args.model, dtype="float32")
    server, url = serve(model, tok, GenerationConfig.for_model(model, checkpoint_defaults=False))
    questions = [p.question for p in arith.test_split()[: args.problems]]
    for q in questions[:3]:  # warm-up
        stream(url, q, False, fields)
    totals = {False: [], True: []}
    for _ in range(args.rounds):
        for q in questions:
            for canvas in (False, True):
                totals[canvas].append(stream(url, q, canvas, fields))
    server.should_exit = True
    out = {"model": args.model, "problems": args.problems, "rounds": args.rounds, **fields}
    for canvas, runs in totals.items():
        seconds, tokens = sum(r["seconds"] for r in runs), sum(r["tokens"] for r in runs)
        out["canvas" if canvas else "plain"] = {
            "tokens_per_second": round(tokens / seconds, 1),
            "canvas_events_per_request": round(sum(r["canvas_events"] for r in runs) / len(runs), 2),
            "bytes_per_request": round(sum(r["bytes"] for r in runs) / len(runs)),
        }
    out["canvas_over_plain"] = round(out["canvas"]["tokens_per_second"] / out["plain"]["tokens_per_second"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
