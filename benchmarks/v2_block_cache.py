"""Fast-dLLM v2's block cache (`cache="sub-block"`) against DualCache, side by side in one process.

    python benchmarks/v2_block_cache.py [--gen-length 256] [--threads 1] [--repeats 3] [--out FILE]

No Fast-dLLM v2 checkpoint is trained here, so the model is a random one in v2's layout at the
embedded models' size (dim 192, 6 layers, blocks of 32, sub-blocks of 8, shifted prediction),
decoding greedily at threshold 0.9: being random it reveals one token per step, so both policies
take the same number of forwards and differ only in how many positions each forward computes.
Printed per policy: the best wall time of the repeats, forwards, decode positions per generated
token (beyond one prefill of the prompt), and the speed-up of the block cache.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fastdllm import GenerationConfig, generate
from fastdllm.embedded.recipe import build_tokenizer, new_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    model = new_model("fast_dllm_qwen", "llada", tok, seed=0, block_size=32).eval()
    prompt = tok.encode("Question: Tom has 5 apples. He buys 3 more. How many apples does he have?\nAnswer:")
    configs = {
        cache: GenerationConfig.for_model(
            model, GenerationConfig(gen_length=args.gen_length, threshold=0.9, stop_at_eos=False), cache=cache
        )
        for cache in ("dual", "sub-block")
    }
    generate(model, [prompt], config=configs["dual"])  # warm-up
    result = {}
    outputs = {}
    for _ in range(args.repeats):  # interleaved, so that the machine's load falls on both alike
        for cache, config in configs.items():
            t0 = time.perf_counter()
            out = generate(model, [prompt], config=config)
            seconds = time.perf_counter() - t0
            outputs[cache] = out
            best = result.get(cache, {}).get("seconds", float("inf"))
            result[cache] = {
                "seconds": min(best, seconds),
                "forwards": out.nfe,
                "decode_positions_per_token": out.decode_positions_per_token,
            }
    result["speedup"] = result["dual"]["seconds"] / result["sub-block"]["seconds"]
    result["same_tokens"] = torch.equal(outputs["dual"].sequences, outputs["sub-block"].sequences)
    result["settings"] = vars(args)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
