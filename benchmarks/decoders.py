"""The published decoders side by side on held-out arith problems: LLaDA's baseline (one token per
step), Fast-dLLM, our default, dParallel's entropy rule (as published, no cache; and with our
default cache policy), d3LLM's multi-block entropy decoding and DMax's decoding, each fitted to the
model's family, with accuracy, tokens per forward (AUP's parallelism), NFE, tokens/s and each one's
AUP from the baseline (y_max: the best accuracy here). Also the confidence rule at dParallel's own
settings (no cache, threshold 0.9 on probabilities), so that the entropy rule is compared with
confidence on equal terms. One process, batches of 16, one thread.

    python benchmarks/decoders.py --model llada-arith --limit 500
"""

from __future__ import annotations

import argparse
import json

import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.evaluation.aup import aup
from fastdllm.evaluation.harness import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llada-arith")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = fastdllm.load(args.model)
    g = dict(gen_length=args.gen_length)
    configs = {
        "baseline": GenerationConfig.baseline(**g),
        "fast-dllm": GenerationConfig.fast_dllm(**g),
        "default": GenerationConfig(**g),
        "dparallel": GenerationConfig.dparallel(**g),
        "dparallel + dual cache": GenerationConfig.dparallel(**g, cache="dual", refresh="vicinity", suffix_window=32),
        "confidence 0.9, no cache": GenerationConfig.dparallel(**g, unmasking="threshold", threshold=0.9),
        "d3llm": GenerationConfig.d3llm(**g),
        "dmax": GenerationConfig.dmax(**g),
    }
    rows = {}
    for name, config in configs.items():
        config = config.fit_to_model(model)
        r = evaluate(model, tok, "arith", limit=args.limit, num_fewshot=0, config=config, batch_size=16, progress=False)
        rows[name] = {
            "accuracy": 100 * r["accuracy"],
            "tokens_per_forward": r["tokens_per_step"],
            "nfe_per_sample": r["nfe_per_sample"],
            "tokens_per_second": r["tokens_per_second"],
            "positions_per_token": r["positions_per_token"],
        }
        print(name, json.dumps(rows[name]), flush=True)
    y_max = max(r["accuracy"] for r in rows.values())
    base = rows["baseline"]
    for name, r in rows.items():
        points = ([base["tokens_per_forward"]], [base["accuracy"]])
        if name != "baseline":
            points = ([base["tokens_per_forward"], r["tokens_per_forward"]], [base["accuracy"], r["accuracy"]])
        r["aup"] = round(aup(*points, y_max), 2)
    out = {"model": args.model, "limit": args.limit, "gen_length": args.gen_length, "y_max": y_max, "rows": rows}
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
