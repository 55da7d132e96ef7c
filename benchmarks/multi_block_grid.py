"""Multi-block decoding on an embedded model: accuracy, tokens per forward and work per token for
parallel_blocks 1, 2 and 3 over a grid of the lookahead's thresholds, each on the same problems.

    python benchmarks/multi_block_grid.py llada-arith --limit 200 >> grid.jsonl
    python benchmarks/multi_block_grid.py sdar-arith --limit 200 --confidence-temperature 1.9

One JSON line per setting. tokens_per_forward is answer tokens over forwards (what multi-block
decoding raises); positions_per_token is the forwards' query positions per answer token (what a
CPU pays for; wider windows cost more of it).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.evaluation.harness import evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--confidence-temperature", type=float, default=1.0, help="the calibrated view (bench --calibrate)")
    args = p.parse_args()
    model, tokenizer = fastdllm.load(args.model, dtype=torch.float32)
    extra = {} if args.confidence_temperature == 1 else {"confidence_temperature": args.confidence_temperature}
    base = GenerationConfig.for_model(model, GenerationConfig(**extra))

    def run(**settings) -> None:
        r = evaluate(
            model, tokenizer, "arith", limit=args.limit, config=base.replace(**settings), batch_size=args.batch_size
        )
        tokens = sum(s["num_tokens"] for s in r["samples"])
        forwards = sum(s["nfe"] for s in r["samples"])
        row = dict(model=args.model, extra=extra, **settings, accuracy=r["accuracy"])
        row.update(
            tokens_per_forward=round(tokens / forwards, 3),
            tokens_per_step=round(r["tokens_per_step"], 3),
            positions_per_token=round(r["positions_per_token"], 3),
        )
        print(json.dumps(row), flush=True)

    run(parallel_blocks=1)
    for blocks, add, threshold in itertools.product((2, 3), (0.0, 0.5), (0.95, 0.99, 0.999)):
        run(parallel_blocks=blocks, block_add_threshold=add, lookahead_threshold=threshold)


if __name__ == "__main__":
    main()
