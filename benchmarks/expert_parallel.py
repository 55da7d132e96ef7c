"""Expert parallelism against tensor parallelism on a mixture of experts, side by side in one run:
forward time, its split into compute and communication, and collective calls per forward.

    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --master-addr 127.0.0.1 \\
        benchmarks/expert_parallel.py --out docs/results/expert_parallel.json

A random LLaDA2-layout model (float32, `--dim`, `--experts`, `--layers`) on every rank, split three
ways: tensor parallelism (every expert split by its hidden width), expert parallelism with the
"all-reduce" dispatch (each rank computes its own experts' pairs for every token) and with the
"all-to-all" dispatch (each rank routes its share of the tokens to the experts' ranks). For each
batch (rows x `--seq` positions) the median of `--repeats` forwards; "communication" is the time
inside torch.distributed's calls, timed on each rank and taken from rank 0.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fastdllm.embedded.recipe import build_tokenizer, new_model
from fastdllm.models import tp
from fastdllm.models.args import ModelArgs
from fastdllm.models.transformer import Transformer

OPS = ("all_reduce", "all_to_all_single")


def timed(clock: dict, name: str, op, *args, **kwargs):
    t0 = time.perf_counter()
    try:
        return op(*args, **kwargs)
    finally:
        clock["seconds"] += time.perf_counter() - t0
        clock[name] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--moe-hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = tp.init(int(__import__("os").environ["WORLD_SIZE"]))
    base = new_model("llada2_moe", "micro", build_tokenizer(), seed=0)
    margs = ModelArgs(
        **{
            **base.args.__dict__,
            "dim": args.dim,
            "n_layers": args.layers,
            "n_heads": 8,
            "n_kv_heads": 4,
            "head_size": args.dim // 8,
            "rope_dim": args.dim // 16,
            "hidden_dim": 4 * args.dim,
            "n_experts": args.experts,
            "n_active_experts": args.active,
            "moe_hidden_dim": args.moe_hidden,
            "shared_expert_hidden_dim": args.moe_hidden,
            "first_dense_layers": 0,
        }
    )
    torch.manual_seed(0)
    whole = Transformer(margs, family=base.family, stop_token_ids=base.stop_token_ids)
    for param in whole.parameters():
        if param.dim() >= 2:
            torch.nn.init.normal_(param, std=0.02)
    whole = whole.eval().requires_grad_(False)
    ways = {
        "tensor parallel (experts split by width)": tp.apply(copy.deepcopy(whole), rank, world),
        "expert parallel, all-reduce dispatch": tp.apply(copy.deepcopy(whole), rank, world, ep=world),
        "expert parallel, all-to-all dispatch": tp.apply(
            copy.deepcopy(whole), rank, world, ep=world, dispatch="all-to-all"
        ),
    }
    clock = {"seconds": 0.0, **{op: 0 for op in OPS}}
    real = {op: getattr(dist, op) for op in OPS}
    for op in OPS:
        setattr(dist, op, functools.partial(timed, clock, op, real[op]))
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        ids = torch.randint(0, margs.vocab_size - 8, (batch, args.seq), generator=g)
        with torch.no_grad():
            reference = whole(ids)
            for name, model in ways.items():
                diff = (model(ids) - reference).abs().max().item()
                times, comm = [], []
                for _ in range(args.repeats):
                    dist.barrier()
                    clock.update(seconds=0.0, **{op: 0 for op in OPS})
                    t0 = time.perf_counter()
                    model(ids)
                    times.append(time.perf_counter() - t0)
                    comm.append(clock["seconds"])
                    calls = {op: clock[op] for op in OPS}
                rows.append(
                    {
                        "way": name,
                        "batch": batch,
                        "tokens": batch * args.seq,
                        "forward_ms": round(1000 * statistics.median(times), 2),
                        "communication_ms": round(1000 * statistics.median(comm), 2),
                        "collectives_per_forward": calls,
                        "max_logit_diff": diff,
                    }
                )
    for op in OPS:
        setattr(dist, op, real[op])
    if rank == 0:
        setup = {k: v for k, v in vars(args).items() if k != "out"} | {"ranks": world, "backend": dist.get_backend()}
        print(f"setup: {setup}")
        print("| way | batch (rows x seq) | forward ms | communication ms | collectives per forward | max logit diff |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            calls = ", ".join(f"{k} {v}" for k, v in r["collectives_per_forward"].items() if v)
            print(
                f"| {r['way']} | {r['batch']} x {args.seq} | {r['forward_ms']} | {r['communication_ms']} | "
                f"{calls} | {r['max_logit_diff']:.1e} |"
            )
        if args.out:
            Path(args.out).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
