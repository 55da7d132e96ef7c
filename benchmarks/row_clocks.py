"""Every row on its own clock: what a batch computes against what its rows need.

A batch of `--rows` held-out arith problems decoded by `generate` with each embedded twin's default
config (and, with `--calibrated`, in the calibrated view: confidences from logits / 1.9, about 2.5
tokens per step, the regime of LLaDA-8B). Per run:
- row-forwards: needed (sum of `nfe_per_row`, what each row costs alone) over computed (rows summed
  over the batch's forwards: `row_forwards`, or `nfe` x rows where the loop moved in lockstep);
- positions: needed (each row's query positions when decoded alone) over computed (the batch's
  query positions, padding included);
- wall time, NFE, tokens and a digest of the sequences (the same tokens, whatever the loop).

Run it once per checkout, alternating, to compare two versions side by side on this machine:

    python benchmarks/row_clocks.py --out docs/results/row_clocks/after.jsonl
    PYTHONPATH=/path/to/other/checkout python benchmarks/row_clocks.py --out .../before.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.evaluation.tasks import arith

CASES = [  # (model, shots), as in the measurement that opened the issue
    ("llada-arith", 0),
    ("llada-arith", 4),
    ("dream-arith", 0),
    ("sdar-arith", 4),
    ("llada2-arith", 4),
]


def prompts(tokenizer, n: int, shots: int) -> list[list[int]]:
    pool = arith.fewshot_pool()[:shots]
    return [arith.prompt_ids(tokenizer, p.question, pool) for p in arith.test_split()[:n]]


def measure(model, ids: list[list[int]], config: GenerationConfig) -> dict:
    out = generate(model, ids, config=config)
    computed = getattr(out, "row_forwards", 0) or out.nfe * len(ids)
    alone = [generate(model, [p], config=config) for p in ids]
    needed_positions = sum(a.forward_positions[0] for a in alone)
    computed_positions = getattr(out, "computed_positions", 0) or None
    digest = hashlib.sha256(str(out.sequences.tolist()).encode()).hexdigest()[:16]
    return {
        "wall_s": round(out.wall_time, 4),
        "nfe": out.nfe,
        "row_forwards_needed": sum(out.nfe_per_row),
        "row_forwards_computed": computed,
        "row_efficiency": round(sum(out.nfe_per_row) / computed, 3),
        "positions_needed": needed_positions,
        "positions_computed": computed_positions,
        "position_efficiency": round(needed_positions / computed_positions, 3) if computed_positions else None,
        "tokens": sum(out.num_tokens),
        "tokens_per_s": round(sum(out.num_tokens) / out.wall_time, 1),
        "same_as_alone": all(torch.equal(a.sequences[0], s) for a, s in zip(alone, out.sequences)),
        "digest": digest,
    }


def emit(row: dict, rows: list[dict]) -> None:
    """Print a result row as JSON and keep it."""
    print(json.dumps(row), flush=True)
    rows.append(row)


def write_rows(path: Path | None, rows: list[dict]) -> None:
    """The rows as JSON lines at `path` (none: nothing written)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="timed batches per case (the fastest is kept)")
    ap.add_argument("--cases", default=",".join(f"{m}:{k}" for m, k in CASES))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    version = getattr(fastdllm, "__file__", "")
    rows = []
    for case in args.cases.split(","):
        name, shots = case.split(":")
        model, tokenizer = fastdllm.load(name, dtype="float32")
        ids = prompts(tokenizer, args.rows, int(shots))
        for view, extra in (("default", {}), ("calibrated", {"confidence_temperature": 1.9})):
            config = GenerationConfig.for_model(model, checkpoint_defaults=False, **extra)
            with torch.inference_mode():
                best = None
                for _ in range(args.repeats):
                    m = measure(model, ids, config)
                    best = m if best is None or m["wall_s"] < best["wall_s"] else best
            emit({"model": name, "shots": int(shots), "view": view, "rows": args.rows, **best, "code": version}, rows)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
