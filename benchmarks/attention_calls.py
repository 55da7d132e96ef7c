"""Whole decodes with the packed forward's rows attending a call per row against one call per layer
(`models.packed`, `Transformer.attention_calls`), alternated in one run: seconds per decode of one
batch of arith problems (each with `--shots` exemplars), each model's default config, and whether
both give the same tokens.

    python benchmarks/attention_calls.py [--models llada-arith sdar-arith] [--rows 16] [--shots 2]
        [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import fastdllm
from fastdllm.evaluation.tasks import arith


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llada-arith", "sdar-arith"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--shots", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models:
        model, tok = fastdllm.load(name, dtype="float32")
        shots = arith.fewshot_pool()[: args.shots]
        ids = [arith.prompt_ids(tok, p.question, shots) for p in arith.test_split()[: args.rows]]
        config = fastdllm.GenerationConfig.for_model(model, checkpoint_defaults=False).replace(seed=0)
        seconds, tokens = {"per_row": [], "one": []}, {}
        for repeat in range(args.repeats + 1):  # the first round warms up, untimed
            for calls in seconds:
                model.attention_calls = calls
                started = time.perf_counter()
                out = fastdllm.generate(model, ids, config=config)
                if repeat:
                    seconds[calls].append(round(time.perf_counter() - started, 3))
                tokens[calls] = out.sequences
        record = {"model": name, "rows": args.rows, "threads": args.threads, "forwards": out.nfe}
        same = torch.equal(tokens["one"], tokens["per_row"])
        print(json.dumps({**record, "seconds": seconds, "same_tokens": same}), flush=True)


if __name__ == "__main__":
    main()
