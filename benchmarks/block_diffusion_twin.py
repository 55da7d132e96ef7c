"""The block-diffusion twins (`sdar-arith`, and its mixture of experts `llada2-arith`) beside the
LLaDA twin, side by side in one process.

    python benchmarks/block_diffusion_twin.py [--limit 200] [--gen-length 256] [--threads 1] [--out FILE]

Rows, each `fastdllm.evaluation.harness` on the same held-out arith problems (bf16, batch 16, stop-at-EOS
on, 0-shot): sdar-arith one token per step without a cache (its baseline) and with the exact block
cache, its quota rule with threshold 0.9 without a cache and with it (its own decoding); the same
for llada2-arith (LLaDA2.0's rule), and LLaDA2.1's token editing in its quality and speed modes;
llada-arith's default (Fast-dLLM + suffix window 32 + vicinity refresh). Printed per row: accuracy, tokens/s,
NFE per sample, tokens per step, positions and attended positions per generated token (commit
passes included), and tokens/s against the first row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.evaluation.harness import evaluate

NO_CACHE = dict(cache="none", suffix_window=None, refresh="full")
ROWS = [
    ("sdar-arith", "one token per step, no cache", dict(NO_CACHE, threshold=None)),
    ("sdar-arith", "one token per step, exact block cache", dict(threshold=None)),
    ("sdar-arith", "quota rule, threshold 0.9, no cache", dict(NO_CACHE, threshold=0.9)),
    ("sdar-arith", "quota rule, threshold 0.9, exact block cache (its default)", dict(threshold=0.9)),
    ("llada2-arith", "one token per step, no cache", dict(NO_CACHE, threshold=None)),
    ("llada2-arith", "one token per step, exact block cache", dict(threshold=None)),
    ("llada2-arith", "LLaDA2.0 rule, threshold 0.9, no cache", dict(NO_CACHE, threshold=0.9)),
    ("llada2-arith", "LLaDA2.0 rule, threshold 0.9, exact block cache (its default)", dict(threshold=0.9)),
    (
        "llada2-arith",
        "LLaDA2.1 editing, quality mode (threshold 0.7, editing 0.5)",
        dict(threshold=0.7, editing_threshold=0.5),
    ),
    (
        "llada2-arith",
        "LLaDA2.1 editing, speed mode (threshold 0.5, editing 0.0)",
        dict(threshold=0.5, editing_threshold=0.0),
    ),
    ("llada-arith", "the default (Fast-dLLM + suffix window 32 + vicinity refresh)", dict()),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--models", nargs="+", default=None, help="only these models' rows")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for row in ROWS if args.models is None or row[0] in args.models]
    models = {name: fastdllm.load(name, dtype="bfloat16") for name in dict.fromkeys(m for m, _, _ in rows)}
    results = []
    for name, label, settings in rows:
        model, tok = models[name]
        config = GenerationConfig.for_model(model, GenerationConfig(gen_length=args.gen_length), **settings)
        evaluate(model, tok, "arith", limit=2, config=config, batch_size=2, progress=False)  # warm-up
        m = evaluate(model, tok, "arith", limit=args.limit, config=config, batch_size=args.batch_size, progress=False)
        results.append(
            {
                "model": name,
                "decoding": label,
                "config": config.to_dict(),
                **{
                    k: m[k]
                    for k in (
                        "accuracy",
                        "tokens_per_second",
                        "nfe_per_sample",
                        "tokens_per_step",
                        "positions_per_token",
                        "attended_per_token",
                        "num_samples",
                    )
                },
            }
        )
        r = results[-1]
        print(
            f"{name:<12} {label:<66} acc {100 * r['accuracy']:5.1f}  {r['tokens_per_second']:8.1f} tok/s  "
            f"NFE {r['nfe_per_sample']:6.2f}  tok/step {r['tokens_per_step']:5.2f}  "
            f"pos/tok {r['positions_per_token']:6.2f}  x{r['tokens_per_second'] / results[0]['tokens_per_second']:.1f}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
