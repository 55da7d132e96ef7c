"""What reporting token log-probabilities costs: the same batches decoded without them and with
`logprobs=N` (N top tokens), alternating, side by side in one process.

    python benchmarks/logprobs.py [--model llada-arith] [--top 5] [--rounds 3] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    import fastdllm
    from fastdllm import GenerationConfig, generate
    from fastdllm.evaluation.tasks import arith

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llada-arith")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = fastdllm.load(args.model)
    prompts = [tok.encode_chat([{"role": "user", "content": q.question}]) for q in arith.test_split()[: args.batch]]
    base = GenerationConfig.for_model(model, GenerationConfig(gen_length=256))
    generate(model, prompts, base)  # warm-up
    for r in range(args.rounds):
        for name, config in (("without", base), (f"logprobs={args.top}", base.replace(logprobs=args.top))):
            t0 = time.perf_counter()
            out = generate(model, prompts, config)
            seconds = time.perf_counter() - t0
            print(f"round {r} {name:<12} {sum(out.num_tokens) / seconds:8.1f} tokens/s  NFE {out.nfe}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
