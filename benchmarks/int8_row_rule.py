"""The embedded model with int8 weights, decoded with each layer's `dequantize_above` (the rule of
`quant.linear.dequantize_above_rows`) against one fixed threshold of 128 rows for every layer,
side by side in one process, alternating rounds; float32 and bfloat16 activations, one prompt at a
time and batches of 16.

    python benchmarks/int8_row_rule.py [--limit 100] [--rounds 3] [--threads 1]
        [--out docs/results/int8_row_rule.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv=None) -> int:
    import fastdllm
    from fastdllm.evaluation.harness import evaluate
    from fastdllm.quant import QuantizedLinear

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/results/int8_row_rule.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in ("float32", "bfloat16"):
        model, tok = fastdllm.load(dtype=dtype, quantize="int8")
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.kernel == "int8"]
        rule = {id(m): m.dequantize_above for m in layers}
        for batch in (1, 16):
            for r in range(args.rounds):
                for name in ("rule", "fixed 128"):
                    for m in layers:
                        m.dequantize_above = rule[id(m)] if name == "rule" else 128
                    res = evaluate(model, tok, "arith", limit=args.limit, batch_size=batch)
                    row = {
                        "dtype": dtype,
                        "batch": batch,
                        "round": r,
                        "threshold": name,
                        "accuracy": res["accuracy"],
                        "tokens_per_second": res["tokens_per_second"],
                        "nfe_per_sample": res["nfe_per_sample"],
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    Path(args.out).write_text(
        json.dumps({"command": "python benchmarks/int8_row_rule.py " + " ".join(argv or []), "rows": rows}, indent=2)
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
