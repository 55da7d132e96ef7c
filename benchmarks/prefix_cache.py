"""Shared prompt K/V (`GenerationConfig.prefix_cache`): positions computed per generated token, wall
time, tokens and the K/V held, with the store on and off, on few-shot prompts that share their
exemplars. `kv_cache_bytes` is the most the rows held at once (a stored block shared by several
rows counted once); `store_bytes` what the store keeps after the run (pages of the same pool).

For each case a batch of `--rows` held-out arith problems, k-shot, is decoded three times with a
fresh store: `off`, `on` (the first batch: rows share what one of them computes) and `again` (the
same prompts once more: every exemplar block is found). Block-causal twins share exactly, by
default (`exact`); LLaDA's bidirectional prompts only with `approximate` (accuracy: `fastdllm eval
--prefix-cache approximate`).

    python benchmarks/prefix_cache.py --out docs/results/prefix_cache/positions.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.engine.kv import runner_for
from fastdllm.evaluation.tasks import arith

CASES = [("sdar-arith", 4, "exact"), ("llada2-arith", 4, "exact"), ("llada-arith", 4, "approximate")]


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
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, shots, mode in CASES:
        model, tok = fastdllm.load(name, dtype="float32")
        pool = arith.fewshot_pool()[:shots]
        ids = [arith.prompt_ids(tok, p.question, pool) for p in arith.test_split()[: args.rows]]
        config = GenerationConfig.for_model(model, checkpoint_defaults=False, prefix_cache=mode)
        runs, rates, stored = {}, {}, {}
        with torch.inference_mode():
            generate(model, ids[:2], config.replace(prefix_cache="off"))  # warm-up
            runner_for(model).reset_prefix_cache()
            for run in ("off", "on", "again"):
                hits, queries = runner_for(model).lookups.hits, runner_for(model).lookups.queries
                runs[run] = generate(model, ids, config.replace(prefix_cache="off") if run == "off" else config)
                counted = runner_for(model).lookups
                rates[run] = (counted.hits - hits) / (counted.queries - queries) if counted.queries > queries else None
                stored[run] = runner_for(model).prefix_bytes
        for run, out in runs.items():
            row = {
                "model": name,
                "shots": shots,
                "prefix_cache": mode if run != "off" else "off",
                "run": run,
                "rows": args.rows,
                "prompt_tokens": sum(len(p) for p in ids),
                "positions_per_token": round(out.positions_per_token, 2),
                "wall_s": round(out.wall_time, 3),
                "tokens_per_s": round(out.tokens_per_second, 1),
                "nfe": out.nfe,
                "kv_cache_bytes": out.kv_cache_bytes,
                "store_bytes": stored[run],
                "same_tokens_as_off": torch.equal(out.sequences, runs["off"].sequences),
                "store_hit_rate": None if rates[run] is None else round(rates[run], 3),
            }
            emit(row, rows)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
