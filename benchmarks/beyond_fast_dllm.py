"""Accuracy and work of the policies beyond Fast-dLLM on the embedded model, side by side.

    python benchmarks/beyond_fast_dllm.py --gen-length 256 --limit 500 [--num-fewshot 0] [--out FILE]

Each configuration is evaluated with `fastdllm.evaluation.harness` (bf16, batch 16, stop-at-EOS on) on the
same held-out arith problems; printed: accuracy, tokens/s, NFE per sample, forward positions and
attended positions per generated token. `--configs` picks some (names below). A compiled row is
compiled first (`evaluate` warms it up before timing).
"""

from __future__ import annotations

import argparse
import json

import torch

# Every row names each policy field, so that the rows do not move with GenerationConfig's defaults.
FAST_DLLM = dict(cache="dual", threshold=0.9, suffix_window=None, refresh="full", refresh_every=None)
CONFIGS = {
    "baseline": dict(FAST_DLLM, cache="none", threshold=None),  # one token per step (steps = gen_length)
    "fast-dllm": FAST_DLLM,
    "suffix32": dict(FAST_DLLM, suffix_window=32),
    "suffix64": dict(FAST_DLLM, suffix_window=64),
    "suffix128": dict(FAST_DLLM, suffix_window=128),
    "vicinity": dict(FAST_DLLM, refresh="vicinity"),
    "vicinity+suffix8": dict(FAST_DLLM, refresh="vicinity", suffix_window=8),
    "vicinity+suffix16": dict(FAST_DLLM, refresh="vicinity", suffix_window=16),
    "vicinity+suffix32": dict(FAST_DLLM, refresh="vicinity", suffix_window=32),
    "vicinity+suffix64": dict(FAST_DLLM, refresh="vicinity", suffix_window=64),
    "vicinity4+suffix32": dict(FAST_DLLM, refresh="vicinity", refresh_every=4, suffix_window=32),
    "adaptive+suffix32": dict(FAST_DLLM, refresh="adaptive", suffix_window=32),
    "fast-dllm+compile": dict(FAST_DLLM, compile=True),
    "vicinity+suffix32+compile": dict(FAST_DLLM, refresh="vicinity", suffix_window=32, compile=True),
    # several blocks at once (after D2F), the setting within a point on llada-arith (docs/results.md)
    "vicinity+suffix32+blocks2": dict(
        FAST_DLLM,
        refresh="vicinity",
        suffix_window=32,
        parallel_blocks=2,
        block_add_threshold=0.0,
        lookahead_threshold=0.99,
    ),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--num-fewshot", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument(
        "--confidence-temperature",
        type=float,
        default=1.0,
        help="the calibrated view for every row (`fastdllm bench --calibrate`): a real model's tokens per step",
    )
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)

    import fastdllm
    from fastdllm.evaluation.harness import evaluate

    torch.set_num_threads(args.threads)
    model, tok = fastdllm.load()
    # Warm-up, untimed: a process's first forwards pay for allocation and kernel selection, which
    # would otherwise fall on the first row.
    evaluate(
        model,
        tok,
        "arith",
        limit=16,
        num_fewshot=args.num_fewshot,
        config=fastdllm.GenerationConfig(gen_length=args.gen_length),
        batch_size=16,
    )
    rows = []
    print("| configuration | accuracy | tokens/s | NFE/sample | tokens/step | positions/token | attended/token |")
    print("|---|---|---|---|---|---|---|")
    for name in args.configs:
        cfg = fastdllm.GenerationConfig(
            gen_length=args.gen_length, confidence_temperature=args.confidence_temperature, **CONFIGS[name]
        )
        r = evaluate(model, tok, "arith", limit=args.limit, num_fewshot=args.num_fewshot, config=cfg, batch_size=16)
        row = {
            "name": name,
            "config": cfg.to_dict(),
            **{
                k: r[k]
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
        rows.append(row)
        print(
            f"| {name} | {100 * row['accuracy']:.1f}% | {row['tokens_per_second']:.1f} | "
            f"{row['nfe_per_sample']:.2f} | {row['tokens_per_step']:.2f} | {row['positions_per_token']:.1f} | "
            f"{row['attended_per_token']:.0f} |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
