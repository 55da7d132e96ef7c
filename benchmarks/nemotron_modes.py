"""Nemotron-Labs-Diffusion's three decoding modes side by side on held-out arith problems: the
autoregressive mode, the diffusion mode (threshold 0.9) and LinearSpec, greedy, at batch 1 and in
batches, one thread. Per mode: tokens (up to a stop), forwards, tokens per forward, LinearSpec's mean
acceptance length, tokens/s, and how many answers equal the autoregressive mode's.

    python benchmarks/nemotron_modes.py --model tests/fixtures/nemotron_labs_diffusion_micro --problems 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.evaluation.tasks import arith

MODES = {
    "ar": GenerationConfig.nemotron_labs_diffusion_ar,
    "diffusion": GenerationConfig.nemotron_labs_diffusion,
    "linear_spec": GenerationConfig.nemotron_labs_diffusion_linear_spec,
}


def run(model, prompts: list, config: GenerationConfig, batch: int) -> dict:
    tokens = forwards = 0
    answers, acceptances = [], []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out = generate(model, prompts[i : i + batch], config)
        tokens += sum(out.num_tokens)
        forwards += sum(out.nfe_per_row)
        answers += [row[:n] for row, n in zip(out.sequences.tolist(), out.num_tokens)]
        acceptances += [a for row in out.acceptances for a in row]
    seconds = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "row_forwards": forwards,
        "tokens_per_forward": round(tokens / forwards, 3),
        "mean_acceptance_length": round(sum(acceptances) / len(acceptances), 3) if acceptances else None,
        "tokens_per_second": round(tokens / seconds, 1),
        "answers": answers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tests/fixtures/nemotron_labs_diffusion_micro")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = fastdllm.load(args.model, dtype="float32")
    prompts = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[: args.problems]]
    results = {}
    with torch.inference_mode():
        for name, preset in MODES.items():
            config = preset(gen_length=args.gen_length)
            generate(model, prompts[:2], config)  # warm-up
            for batch in (1, args.batch):
                results[f"{name}, batch {batch}"] = run(model, prompts, config, batch)
    reference = results["ar, batch 1"]["answers"]
    for r in results.values():
        r["same_as_ar"] = sum(a == b for a, b in zip(r.pop("answers"), reference))
    print(
        json.dumps({"model": args.model, "problems": len(prompts), "gen_length": args.gen_length, **results}, indent=1)
    )


if __name__ == "__main__":
    main()
