"""Weight-only int8 / int4 against the model's own dtype, side by side in one process.

    python benchmarks/quantization.py [--limit 500] [--gen-length 256] [--batch-size 16]
        [--models llada-arith] [--configs baseline fast-dllm default] [--dtypes bfloat16 float32]
        [--threads 1] [--wide-layers 2] [--out docs/results/quantization.json]

For each of `--dtypes` (the activations' dtype; float32 is what `dtype="auto"` loads on a CPU
without native bfloat16, where the int8 / int4 kernels compute in bfloat16):

1. The embedded models: each decoding configuration runs on the held-out arith problems in the dtype,
   int8 (per channel) and int4 (groups of 64: the embedded width 192 is not a multiple of 128),
   one after the other, so each configuration's three rows are measured together: accuracy,
   tokens/s, NFE per sample, the weights' resident bytes (all, and the linear layers' share that
   quantization acts on) and the largest KV cache.
2. A model of LLaDA-8B's width (d_model 4096, SwiGLU 12288, vocabulary 126464; random weights,
   `--wide-layers` layers, as `wide_model_replay.py` builds it) in the dtype, int8 and int4 (groups of
   128): bytes per layer, the full 32-layer model's weights extrapolated from them (embeddings and
   head as measured), and the time of the layers' part of one decoding forward (a 32-position block against a
   cached sequence of 512; the bf16 output head, the same in every row, left out) per configuration,
   alternating, median of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

QUANT = [None, "int8", "int4"]


def configs(names, gen_length):
    from fastdllm import GenerationConfig

    made = {
        "baseline": GenerationConfig.baseline(gen_length=gen_length),
        "fast-dllm": GenerationConfig.fast_dllm(gen_length=gen_length),
        "default": None,  # the model's own: `GenerationConfig.for_model` (its checkpoint's block length)
    }
    return {n: made[n] for n in names}


def embedded_rows(args, dtype: str) -> list[dict]:
    import fastdllm
    from fastdllm.evaluation.harness import evaluate

    rows = []
    for name in args.models:
        models = {q: fastdllm.load(name, dtype=dtype, quantize=q) for q in QUANT}
        for cfg_name, cfg in configs(args.configs, args.gen_length).items():
            for q in QUANT:
                model, tok = models[q]
                config = cfg or fastdllm.GenerationConfig.for_model(model, gen_length=args.gen_length)
                m = evaluate(
                    model, tok, "arith", limit=args.limit, config=config, batch_size=args.batch_size, progress=False
                )
                row = {
                    "model": name,
                    "config": cfg_name,
                    "dtype": dtype,
                    "weights": q or str(model.dtype).removeprefix("torch."),
                    "accuracy": m["accuracy"],
                    "tokens_per_second": m["tokens_per_second"],
                    "nfe_per_sample": m["nfe_per_sample"],
                    "weight_bytes": m["weight_bytes"],
                    "linear_weight_bytes": m["linear_weight_bytes"],
                    "kv_cache_bytes": m["kv_cache_bytes"],
                    "num_samples": m["num_samples"],
                    "quantization": m["quantization"],
                }
                rows.append(row)
                print(
                    f"{name} {cfg_name:<10} {row['weights']:<9} acc {100 * row['accuracy']:5.1f}  "
                    f"{row['tokens_per_second']:8.1f} tok/s  NFE {row['nfe_per_sample']:.2f}  "
                    f"linear {row['linear_weight_bytes'] / 2**20:.2f} MiB",
                    flush=True,
                )
    return rows


def layer_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


@torch.inference_mode()
def wide_rows(args, dtype: str) -> dict:
    from wide_model_replay import wide_model

    from fastdllm.quant import quantize_model, weight_bytes

    models = {}
    for q in QUANT:
        model = wide_model(args.wide_layers, getattr(torch, dtype))
        if q:
            quantize_model(model, 8 if q == "int8" else 4, 128 if q == "int4" else None)
        models[q or dtype] = model
    out = {"dtype": dtype, "layers_built": args.wide_layers, "rows": {}}
    length, block = 512, 32
    for name, model in models.items():
        per_layer = layer_bytes(model.layers[0])
        rest = weight_bytes(model)["weight_bytes"] - args.wide_layers * per_layer  # embeddings, head, norm
        out["rows"][name] = {
            "bytes_per_layer": per_layer,
            "embeddings_and_head_bytes": rest,
            "full_32_layers_bytes": rest + 32 * per_layer,
            "kernels": (model.quantization or {}).get("kernels"),
            "forward_s": [],
        }
    x = torch.randint(0, 1000, (1, length))
    positions = torch.arange(length)[None]
    ws = length - block
    from fastdllm.engine.kv.pages import FixedSlots, PagedKVCache

    pools = {name: PagedKVCache.for_rows(model, 1, length) for name, model in models.items()}
    caches = {name: FixedSlots(pool, pool.slot_table(length)) for name, pool in pools.items()}
    for name, model in models.items():  # fill each cache once (and warm up)
        model.hidden(x, positions, None, caches[name], positions)
    # The layers only: the output head (126464 x 4096) stays unquantized in every row and would dominate.
    for _ in range(args.repeats):
        for name, model in models.items():
            t0 = time.perf_counter()
            model.hidden(x[:, ws:], positions[:, ws:], None, caches[name], positions[:, ws:])
            out["rows"][name]["forward_s"].append(time.perf_counter() - t0)
    for name, r in out["rows"].items():
        r["forward_median_s"] = statistics.median(r.pop("forward_s"))
        print(
            f"wide {name:<9} {r['bytes_per_layer'] / 2**20:8.1f} MiB/layer  full 8B "
            f"{r['full_32_layers_bytes'] / 2**30:6.2f} GiB  block forward {1000 * r['forward_median_s']:.1f} ms "
            f"({args.wide_layers} layers)",
            flush=True,
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--models", nargs="+", default=["llada-arith"])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["baseline", "fast-dllm", "default"],
        choices=["baseline", "fast-dllm", "default"],
    )
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wide-layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-wide", action="store_true")
    p.add_argument("--out", default="docs/results/quantization.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {
        "command": "python benchmarks/quantization.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
        "threads": args.threads,
    }
    record["embedded"] = [row for dtype in args.dtypes for row in embedded_rows(args, dtype)]
    if not args.no_wide:
        record["wide"] = [wide_rows(args, dtype) for dtype in args.dtypes]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
