"""Forward time of a model at sequence lengths 256 and 1024: full forward vs prefix-mode window
vs dual-mode window of 32 positions, and the peak memory of each.

    python benchmarks/forward_speed.py [--model PATH] [--device cpu|cuda] [--repeats 20]

Times are medians of `--repeats` runs after warm-up, measured side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

import fastdllm


def median_time(fn, repeats: int, sync) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    model, _ = fastdllm.load(args.model, dtype=args.dtype, device=args.device)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    with torch.inference_mode():
        for length in (256, 1024):
            x = torch.randint(0, 500, (args.batch, length), device=args.device)
            s = length // 2
            e = s + 32
            cache = model.new_cache(args.batch, length)
            model.logits_for(x, s, e, cache=cache)  # fill
            modes = {
                "full (fills cache)": lambda: model.logits_for(x, s, e, cache=cache),
                "full (no cache)": lambda: model.logits_for(x, s, e),
                "prefix window [s, L)": lambda: model.logits_for(x, s, e, window=(s, length), cache=cache),
                "dual window [s, s+32)": lambda: model.logits_for(x, s, e, window=(s, e), cache=cache),
            }
            for name, fn in modes.items():
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t = median_time(fn, args.repeats, sync)
                peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
                rows.append({"seq_len": length, "mode": name, "ms": round(t * 1e3, 3), "peak_gpu_mib": peak})
    full = {r["seq_len"]: r["ms"] for r in rows if r["mode"] == "full (no cache)"}
    print(
        f"model: {model.name_or_path}  params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M  "
        f"device: {args.device}  dtype: {args.dtype}  batch: {args.batch}"
    )
    print(f"{'seq':>5}  {'mode':<22} {'ms':>9} {'vs full':>8}")
    for r in rows:
        print(f"{r['seq_len']:>5}  {r['mode']:<22} {r['ms']:>9.3f} {full[r['seq_len']] / r['ms']:>7.1f}x")
    cache_mib = model.new_cache(args.batch, 1024).nbytes() / 2**20
    print(
        f"KV cache at 1024: {cache_mib:.1f} MiB; process peak RSS: "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
