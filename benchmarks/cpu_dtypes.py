"""Each embedded twin in bfloat16 and in float32 on this machine, side by side, and what
`dtype="auto"` chooses here.

    python benchmarks/cpu_dtypes.py [--limit 200] [--rounds 2] [--threads 1]
        [--models llada-arith dream-arith sdar-arith llada2-arith] [--out docs/results/cpu_dtypes.json]

Per round, per model, the two dtypes one after the other (so that a ratio is measured in one
stretch of this noisy machine): accuracy, tokens/s and NFE per sample of the default decoding on
the first `--limit` held-out arith problems, batch 16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    import fastdllm
    from fastdllm.evaluation.harness import evaluate
    from fastdllm.models.loading import DTYPES, auto_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", nargs="+", default=["llada-arith", "dream-arith", "sdar-arith", "llada2-arith"])
    p.add_argument("--out", default="docs/results/cpu_dtypes.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    chosen, why = auto_dtype(torch.bfloat16, "cpu")
    caps = torch.cpu.get_capabilities()
    record = {
        "command": "python benchmarks/cpu_dtypes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
        "cpu": {k: caps.get(k) for k in ("cpu_name", "avx2", "avx512_f", "avx512_bf16", "amx_bf16")},
        "auto_for_bfloat16": str(chosen).removeprefix("torch."),
        "auto_note": why,
        "rows": [],
    }
    print(f"auto: a bfloat16 checkpoint loads in {record['auto_for_bfloat16']} here ({why or 'native'})")
    for r in range(args.rounds):
        for name in args.models:
            for dtype in ("bfloat16", "float32"):
                model, tok = fastdllm.load(name, dtype=DTYPES[dtype])
                m = evaluate(model, tok, "arith", limit=args.limit, batch_size=16, progress=False)
                row = {"round": r, "model": name, "dtype": dtype}
                row |= {k: m[k] for k in ("accuracy", "tokens_per_second", "nfe_per_sample", "num_samples")}
                record["rows"].append(row)
                print(
                    f"{r} {name:<13} {dtype:<9} acc {100 * m['accuracy']:5.1f}  {m['tokens_per_second']:8.1f} tok/s  "
                    f"NFE {m['nfe_per_sample']:.2f}",
                    flush=True,
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
