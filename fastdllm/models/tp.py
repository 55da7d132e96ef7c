"""Tensor parallelism: one model split over the ranks of `torch.distributed`, as gpt-fast's tp.py
splits it, for every family.

torchrun starts the ranks (`torchrun --nproc-per-node N -m fastdllm generate --tp N ...`; across
machines with its own `--nnodes` and rendezvous); `init(tp)` joins them (NCCL on GPUs, gloo on
CPUs) and `apply(model, rank, world)` splits the model in place:

- attention: q/k/v by heads (column-parallel; LLaDA2's fused `query_key_value` as its q, k and v
  parts), the output projection by its input columns (row-parallel). With fewer kv heads than
  ranks each rank keeps the kv head its q heads read (GQA's heads replicated). Per-head q/k norms
  and RoPE stay as they are;
- MLPs: gate and up by output rows, down by input columns; a mixture of experts splits every
  routed expert and the shared expert so, and keeps its router whole (every rank routes alike);
- one all-reduce after the attention and one after the MLP of each layer (a forward hook on each),
  so every rank's hidden states, and so its logits, are the whole model's. The embedding, the
  norms and the output head are replicated.

Every rank then runs the same decoding loop on the same inputs and takes the same decisions (an
all-reduce hands every rank the same bits); rank 0 speaks for them. A rank's sums are split
differently from one process's, so logits differ by float rounding (~1e-6 in float32).

Not yet: reading only a rank's shard from the safetensors (each rank loads the whole checkpoint,
then keeps its part), quantized layers, expert parallelism, and `serve` / `eval` / `bench` /
`chat` with `--tp` (they refuse it).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from .moe import MoEFeedForward
from .plan import check_split


def init(tp: int, device: str | None = None) -> tuple[int, int]:
    """Join torchrun's ranks for `tp`-way tensor parallelism: (rank, world). A ValueError naming
    `tp` when the processes were not started for it."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp: must be a positive integer (got {tp!r})")
    if tp == 1:
        return 0, 1
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if not world:
        raise ValueError(
            f"tp: {tp} ranks run as {tp} processes: launch with `torchrun --nproc-per-node {tp} "
            f"-m fastdllm <command> --tp {tp} ...`"
        )
    if world != tp:
        raise ValueError(f"tp: {tp}, but torchrun started {world} processes; give --nproc-per-node {tp}")
    if not dist.is_initialized():
        cuda = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        atexit.register(_leave)  # a process group left open aborts the process at exit
    return dist.get_rank(), dist.get_world_size()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _part(t: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    return t.chunk(world, dim)[rank].contiguous()


def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def _heads(n: int, head_dim: int, heads: range, offset: int = 0) -> torch.Tensor:
    """Row indices of `heads` in a projection of n heads (starting at row `offset`)."""
    return torch.cat([torch.arange(offset + h * head_dim, offset + (h + 1) * head_dim) for h in heads])


def _all_reduce_output(module: nn.Module) -> None:
    def hook(_module, _inputs, output):
        dist.all_reduce(output)
        return output

    module.register_forward_hook(hook)


def _split_mlp(ff: nn.Module, rank: int, world: int) -> None:
    _set(ff.w1, _part(ff.w1.weight.data, rank, world, 0))
    _set(ff.w3, _part(ff.w3.weight.data, rank, world, 0))
    _set(ff.w2, _part(ff.w2.weight.data, rank, world, 1))


def apply(model, rank: int, world: int):
    """Split `model` in place for rank `rank` of `world` (see the module docstring); returns it."""
    if world == 1:
        return model
    args = model.args
    if getattr(model, "quantization", None):
        raise ValueError("tp: quantized layers are not split yet; load the model unquantized")
    check_split(args, world, 1)
    for name, width in (
        ("hidden_dim", args.hidden_dim),
        ("moe_hidden_dim", args.moe_hidden_dim),
        ("shared_expert_hidden_dim", args.shared_expert_hidden_dim),
    ):
        if width % world:
            raise ValueError(f"tp: {world} does not divide the MLP's {name} ({width})")
    hd, h = args.head_dim, args.n_heads // world
    q_heads = range(rank * h, (rank + 1) * h)
    if args.n_kv_heads >= world:
        kv = args.n_kv_heads // world
        kv_heads = range(rank * kv, (rank + 1) * kv)
    else:  # the one kv head this rank's q heads read
        first = q_heads.start // (args.n_heads // args.n_kv_heads)
        kv_heads = range(first, first + 1)
    q_rows, kv_rows = _heads(args.n_heads, hd, q_heads), _heads(args.n_kv_heads, hd, kv_heads)
    with torch.no_grad():
        for layer in model.layers:
            att = layer.attention
            if hasattr(att, "wqkv"):
                q_width, kv_width = args.n_heads * hd, args.n_kv_heads * hd
                rows = torch.cat([q_rows, q_width + kv_rows, q_width + kv_width + kv_rows])
                _set(att.wqkv, att.wqkv.weight.data[rows], None if att.wqkv.bias is None else att.wqkv.bias.data[rows])
            else:
                for proj, idx in ((att.wq, q_rows), (att.wk, kv_rows), (att.wv, kv_rows)):
                    _set(proj, proj.weight.data[idx], None if proj.bias is None else proj.bias.data[idx])
            _set(att.wo, att.wo.weight.data[:, q_rows].contiguous())
            att.n_heads, att.n_kv_heads = len(q_heads), len(kv_heads)
            _all_reduce_output(att.wo)
            ff = layer.feed_forward
            if isinstance(ff, MoEFeedForward):
                ff.w1 = nn.Parameter(_part(ff.w1.data, rank, world, 1), requires_grad=False)
                ff.w3 = nn.Parameter(_part(ff.w3.data, rank, world, 1), requires_grad=False)
                ff.w2 = nn.Parameter(_part(ff.w2.data, rank, world, 2), requires_grad=False)
                if ff.shared is not None:
                    _split_mlp(ff.shared, rank, world)
            else:
                _split_mlp(ff, rank, world)
            _all_reduce_output(ff)
    model.args = replace(
        args,
        n_heads=len(q_heads),
        n_kv_heads=len(kv_heads),
        head_size=hd,
        hidden_dim=args.hidden_dim // world,
        moe_hidden_dim=args.moe_hidden_dim // world,
        shared_expert_hidden_dim=args.shared_expert_hidden_dim // world,
    )
    model.tp = (rank, world)
    return model
