"""Where a decoding step's time goes, per embedded model, at batch 1 and 16: the model's forward,
the proposal, the selection rule, and everything else (the step's own bookkeeping), with torch's
profiler; and the host syncs per step (`engine.host_syncs`: the points where a GPU would make
the host wait).

    python benchmarks/step_profile.py [--models llada-arith sdar-arith ...] [--gen-length 128]

Each model decodes arith test problems with its default policies on a fixed schedule of 4 tokens
a step (the embedded models' thresholds would finish a block in one or two steps); shares are of
the profiled wall time of `generate`, measured in one process.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fastdllm
from fastdllm.engine.host_syncs import HostSyncs
from fastdllm.evaluation.tasks import arith

LABELS = ("fastdllm.forward", "fastdllm.propose", "fastdllm.select")


def run(model, tok, batch: int, gen_length: int) -> dict:
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:batch]]
    # A fixed schedule (4 tokens a step, no early stop): every model takes the same steps, as many
    # as a real model would, where the embedded ones' thresholds finish a block in one or two.
    base = fastdllm.GenerationConfig(gen_length=gen_length, threshold=None, steps=gen_length // 4, stop_at_eos=False)
    config = fastdllm.GenerationConfig.for_model(model, base, checkpoint_defaults=False)
    fastdllm.generate(model, ids, config=config)  # warm-up
    kinds = []
    with HostSyncs() as syncs:
        fastdllm.generate(model, ids, config=config, on_step=lambda e: kinds.append(e.kind))
    steps, blocks = kinds.count("step"), kinds.count("block")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fastdllm.generate(model, ids, config=config)
        wall = time.perf_counter() - t0
    spent = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key in LABELS}
    shares = {k.split(".")[1]: spent.get(k, 0.0) / wall for k in LABELS}
    shares["other"] = max(0.0, 1 - sum(shares.values()))
    return {
        "steps": steps,
        "blocks": blocks,
        "ms_per_step": 1000 * wall / max(1, steps),
        "syncs_per_step": syncs.count / max(1, steps),
        **shares,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llada-arith", "dream-arith", "sdar-arith", "llada2-arith"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--gen-length", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    print("| model | batch | steps | blocks | ms/step | forward | propose | select | other | host syncs/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model, tok = fastdllm.load(name, dtype="float32")
        for b in args.batches:
            r = run(model, tok, b, args.gen_length)
            print(
                f"| {name} | {b} | {r['steps']} | {r['blocks']} | {r['ms_per_step']:.2f} | {100 * r['forward']:.0f}% | "
                f"{100 * r['propose']:.0f}% | {100 * r['select']:.0f}% | {100 * r['other']:.0f}% | "
                f"{r['syncs_per_step']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
