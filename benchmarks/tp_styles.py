"""Tensor parallelism two ways, side by side: fastdllm's (gpt-fast's: parameters cut in place, an
all-reduce hook after each row-parallel layer) against DTensor's `parallelize_module` with the same
plan (q/k/v, gate/up column-wise, o/down row-wise), and DTensor with a vocabulary-parallel
embedding and output head besides. Forward time per batch and max logit difference from one
process.

    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --master-addr 127.0.0.1 \\
        benchmarks/tp_styles.py --out docs/results/tp_styles.json

A random LLaDA-layout model (float32, `--dim`, `--layers`, vocabulary of `--vocab`), one thread
per rank, the median of `--repeats` forwards over batches of rows x `--seq` positions.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fastdllm.embedded.recipe import build_tokenizer, new_model
from fastdllm.models import tp
from fastdllm.models.args import ModelArgs
from fastdllm.models.transformer import Transformer


def dtensor(model: Transformer, world: int, vocab: bool) -> Transformer:
    """`model` split by DTensor's plan; with `vocab`, the embedding row-wise (each rank its rows of the
    vocabulary) and the output head column-wise, its logits gathered."""
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        parallelize_module(layer, mesh, plan)
        layer.attention.n_heads //= world
        layer.attention.n_kv_heads //= world
    if vocab:
        parallelize_module(
            model,
            mesh,
            {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate()),
            },
        )
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = tp.init(int(os.environ["WORLD_SIZE"]))
    base = new_model("llada", "micro", build_tokenizer(), seed=0)
    margs = ModelArgs(
        **{
            **base.args.__dict__,
            "dim": args.dim,
            "n_layers": args.layers,
            "n_heads": 8,
            "n_kv_heads": 8,
            "head_size": args.dim // 8,
            "hidden_dim": 4 * args.dim,
            "vocab_size": args.vocab,
            "mask_token_id": args.vocab - 1,
            "eos_token_id": args.vocab - 2,
        }
    )
    torch.manual_seed(0)
    whole = Transformer(margs, family=base.family, stop_token_ids=[args.vocab - 2])
    for param in whole.parameters():
        torch.nn.init.normal_(param, std=0.02)
    whole = whole.eval().requires_grad_(False)
    ways = {
        "hooks (fastdllm, gpt-fast's pattern)": tp.apply(copy.deepcopy(whole), rank, world),
        "DTensor parallelize_module": dtensor(copy.deepcopy(whole), world, vocab=False),
        "DTensor + vocab-parallel embedding and head": dtensor(copy.deepcopy(whole), world, vocab=True),
    }
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        ids = torch.randint(0, args.vocab - 8, (batch, args.seq), generator=g)
        with torch.no_grad():
            reference = whole(ids)
            for name, model in ways.items():
                diff = (model(ids) - reference).abs().max().item()
                times = []
                for _ in range(args.repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    model(ids)
                    times.append(time.perf_counter() - t0)
                weights = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in model.parameters())
                rows.append(
                    {
                        "way": name,
                        "batch": batch,
                        "forward_ms": round(1000 * statistics.median(times), 2),
                        "max_logit_diff": diff,
                        "parameters_per_rank": weights,
                    }
                )
    if rank == 0:
        setup = {k: v for k, v in vars(args).items() if k != "out"} | {"ranks": world}
        print(f"setup: {setup}")
        print("| way | batch (rows x seq) | forward ms | parameters per rank | max logit diff |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['way']} | {r['batch']} x {args.seq} | {r['forward_ms']} | {r['parameters_per_rank']:,} | "
                f"{r['max_logit_diff']:.1e} |"
            )
        if args.out:
            Path(args.out).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
