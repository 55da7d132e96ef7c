"""Decoding one prompt at a time (batch 1, as `fastdllm eval` does by default): seconds for
`--problems` held-out arith problems with the default config, one thread. Run it in two checkouts
alternately (`PYTHONPATH=<checkout> python benchmarks/one_at_a_time.py`) to compare them.

    python benchmarks/one_at_a_time.py --problems 100
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.evaluation.tasks import arith


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llada-arith")
    ap.add_argument("--problems", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = fastdllm.load(args.model, dtype="float32")
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[: args.problems]]
    config = GenerationConfig.for_model(model, checkpoint_defaults=False)
    with torch.inference_mode():
        for p in ids[:5]:  # warm-up
            generate(model, [p], config)
        t0 = time.perf_counter()
        tokens = sum(generate(model, [p], config).num_tokens[0] for p in ids)
        seconds = time.perf_counter() - t0
    print(json.dumps({"code": fastdllm.__file__, "model": args.model, "seconds": round(seconds, 3), "tokens": tokens}))


if __name__ == "__main__":
    main()
