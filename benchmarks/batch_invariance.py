"""What `deterministic=True` buys and costs, side by side in one process.

    python benchmarks/batch_invariance.py [--model M] [--dtype bfloat16] [--batches 1 8 32] [--out FILE]

For each batch size: held-out arith prompts of mixed lengths (0- to 4-shot) decoded in one batch
with the default config, deterministic off and on, alternately (best of `--repeats`); printed:
tokens/s of each and their ratio, NFE per row, and how many rows of the batch decode exactly as
they do alone (each row decoded alone with the same setting), and how many of their forwards'
logits are bit-identical to the row's alone (a row's first forward, its padded prefill).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import fastdllm
    from fastdllm.evaluation.tasks import get_task

    model, tok = fastdllm.load(args.model, dtype=args.dtype)
    task = get_task("arith")
    docs = task.load(limit=max(args.batches))
    shots = task.fewshot(4)
    prompts = [task.encode(tok, d, shots[: i % 5]) for i, d in enumerate(docs)]
    base = fastdllm.GenerationConfig.for_model(model, fastdllm.GenerationConfig(gen_length=args.gen_length))
    rows = []
    for b in args.batches:
        batch = prompts[:b]
        row = {"batch": b, "prompt_lengths": sorted(len(x) for x in batch)}
        best = {False: float("inf"), True: float("inf")}
        outs = {}
        for _ in range(args.repeats):
            for det in (False, True):
                cfg = base.replace(deterministic=det)
                t0 = time.perf_counter()
                outs[det] = fastdllm.generate(model, batch, config=cfg)
                best[det] = min(best[det], time.perf_counter() - t0)
        for det in (False, True):
            out, key = outs[det], "deterministic" if det else "default"
            cfg = base.replace(deterministic=det)
            alone = [fastdllm.generate(model, [x], config=cfg).sequences[0] for x in batch]
            tokens = sum(out.num_tokens)
            padded = [x for x in batch if len(x) < max(map(len, batch))]
            row[key] = {
                "seconds": round(best[det], 3),
                "tokens_per_second": round(tokens / best[det], 1),
                "nfe_per_row": round(sum(out.nfe_per_row) / b, 2),
                "rows_as_alone": sum(torch.equal(out.sequences[i], alone[i]) for i in range(b)),
                "padded_prefill_logits_as_alone": _prefill_equal(model, batch, padded, det),
            }
        row["throughput_ratio"] = round(
            row["deterministic"]["tokens_per_second"] / row["default"]["tokens_per_second"], 3
        )
        rows.append(row)
        d, o = row["default"], row["deterministic"]
        print(
            f"batch {b:3d}: default {d['tokens_per_second']:8.1f} tok/s ({d['rows_as_alone']}/{b} as alone, "
            f"{d['padded_prefill_logits_as_alone']} padded prefills exact) | deterministic "
            f"{o['tokens_per_second']:8.1f} tok/s ({o['rows_as_alone']}/{b} as alone, "
            f"{o['padded_prefill_logits_as_alone']} exact) | ratio {row['throughput_ratio']:.3f}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "model": args.model or "llada-arith",
                    "dtype": args.dtype,
                    "gen_length": args.gen_length,
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


def _prefill_equal(model, batch, padded, invariant: bool) -> str:
    """How many padded rows' logits of one full forward of the batch equal their own alone."""
    from fastdllm import GenerationConfig
    from fastdllm.engine.rows import prepare_inputs

    ids, mask = prepare_inputs(model, batch, None, GenerationConfig(gen_length=32, block_length=32))
    width = ids.shape[1]
    with torch.no_grad():
        full = model(ids, attention_mask=mask, batch_invariant=invariant)
        same = sum(
            torch.equal(full[i, width - len(x) :], model(torch.tensor([x]), batch_invariant=invariant)[0])
            for i, x in enumerate(batch)
            if len(x) < width
        )
    return f"{same}/{len(padded)}"


if __name__ == "__main__":
    raise SystemExit(main())
