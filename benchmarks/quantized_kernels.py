"""One linear layer, bf16 against int8 and int4 weights, by the number of rows it multiplies.

    python benchmarks/quantized_kernels.py [--threads 1] [--dtype bfloat16|float32]
        [--out docs/results/quantized_kernels.json]

For a layer of LLaDA-8B's width (4096 x 4096) and one of the embedded model's (512 x 192): the
milliseconds of bf16 `F.linear`, of PyTorch's int8 kernel (`_weight_int8pack_mm`), of its CPU int4
kernel (`_weight_int4pack_mm_for_cpu`, groups of 64) and of dequantizing the int8 weight then one
dense matmul, for 1 to 1024 (and 2048) rows. A diffusion model's forward multiplies a block of
positions per batch row, so the rows that matter are 32 and up; this is where
`QuantizedLinear.dequantize_above` comes from. `--dtype float32`: the activations and the dense
weight in float32, the quantized layers built for float32 (their kernels then run in bfloat16,
`quant.linear.kernel_dtype_for`). Median of `--repeats` calls after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    from fastdllm.quant import QuantizedLinear, quantize_weight

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default="docs/results/quantized_kernels.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    dtype = getattr(torch, args.dtype)
    for (n, k), ms in (((4096, 4096), (1, 32, 64, 128, 256, 1024)), ((512, 192), (1, 32, 64, 128, 256, 2048))):
        w = torch.randn(n, k, dtype=dtype)
        int8 = QuantizedLinear(quantize_weight(w, 8))
        int4 = QuantizedLinear(quantize_weight(w, 4, 64))
        kernel_dtype = int8.kernel_dtype
        for m in ms:
            x = torch.randn(m, k, dtype=dtype)
            row = {
                "out": n,
                "in": k,
                "rows": m,
                "dense_ms": timed(lambda: F.linear(x, w), args.repeats),
                "int8_kernel_ms": timed(
                    lambda: torch._weight_int8pack_mm(x.to(kernel_dtype), int8.qweight, int8.kernel_scales).to(dtype),
                    args.repeats,
                ),
                "int4_kernel_ms": timed(lambda: int4(x), args.repeats),
                "int8_dequantize_ms": timed(lambda: F.linear(x, int8.dequantized()), args.repeats),
            }
            rows.append(row)
            print(
                " ".join(f"{k_}={v:.3f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()), flush=True
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "command": "python benchmarks/quantized_kernels.py " + " ".join(argv or []),
                "threads": args.threads,
                "dtype": args.dtype,
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
