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

A family whose layers are its own (DiffusionGemma) says how they split: `tp_cuts` (its parts, as
`cuts` gives the shared transformer's) and `split_layers` (their shapes and all-reduces).

Every rank then runs the same decoding loop on the same inputs and takes the same decisions (an
all-reduce hands every rank the same bits); rank 0 speaks for them. A rank's sums are split
differently from one process's, so logits differ by float rounding (~1e-6 in float32).

The loader reads only a rank's parts from the safetensors (`load(..., tp=(rank, world))`, with
`cuts`): no rank holds the whole model, even while loading. A quantized checkpoint (int8 / int4)
splits the same way: each of its layers is read whole (its packing does not split on file
offsets), cut (`QuantizedWeight.cut`: rows, or whole scale groups of columns) and the rest
dropped. `serve --tp` and `chat --tp` keep the ranks in step with commands from rank 0
(`engine/ranks.py`).

Expert parallelism (`ep` = world): each rank holds E / world routed experts whole (`cuts` by
experts, `MoEFeedForward.first_expert`), and the tokens reach them by `AllToAll` or, by default,
by each rank computing its experts' pairs for every token, added up by the layer's all-reduce.

Not yet: quantizing in memory under `--tp` (write a quantized checkpoint first), and `ep`
between 1 and world.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..config import is_int


def check_split(args, tp: int, ep: int) -> None:
    """A ValueError naming the field when `tp` / `ep` does not divide what they split."""
    for name, value in (("tp", tp), ("ep", ep)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}: must be a positive integer (got {value!r})")
    if args.n_heads % tp:
        ok = [d for d in range(1, args.n_heads + 1) if args.n_heads % d == 0]
        raise ValueError(f"tp: {tp} does not divide the {args.n_heads} attention heads (it may be one of {ok})")
    if args.n_kv_heads % tp and tp % args.n_kv_heads:
        raise ValueError(f"tp: {tp} neither divides nor is a multiple of the {args.n_kv_heads} kv heads")
    if ep > 1:
        if not args.n_experts:
            raise ValueError("ep: this model has no experts to split")
        if args.n_experts % ep or tp % ep:
            ok = [d for d in range(1, args.n_experts + 1) if args.n_experts % d == 0 and tp % d == 0]
            raise ValueError(f"ep: {ep} must divide the {args.n_experts} experts and tp={tp} (it may be one of {ok})")


def init(tp: int, device: str | None = None) -> tuple[int, int]:
    """Join torchrun's ranks for `tp`-way tensor parallelism: (rank, world). A ValueError naming
    `tp` when the processes were not started for it."""
    if not is_int(tp) or tp < 1:
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
        _STARTED.append(True)
    return dist.get_rank(), dist.get_world_size()


_STARTED: list[bool] = []  # whether this process joined the ranks (`init`)


def started() -> bool:
    return bool(_STARTED)


def exit_after_teardown(status: int) -> None:
    """A rank's end: every rank reaches the teardown and the process group is destroyed, then the
    process exits with `status` at once. Interpreter finalisation after a clean teardown now and
    then destroys a joinable C++ thread (not ours) and aborts the rank ("terminate called without
    an active exception"), as `fastdllm eval`'s ranks found first (`cli.eval._finish_distributed`)."""
    _leave()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _leave() -> None:
    if dist.is_initialized():
        try:
            # Every rank reaches the teardown before any closes its connections: a rank whose peer
            # closed them first can abort at exit. A rank that is gone does not hold the others.
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=30))
        except Exception:
            pass
        dist.destroy_process_group()


# A cut: (dim, [(start, stop), ...]): the rows (dim 0) or columns (dim 1) of the whole tensor a
# rank keeps, its segments concatenated along dim.
Cut = tuple[int, list[tuple[int, int]]]


def cuts(args, rank: int, world: int, ep: int = 1) -> dict[str, Cut]:
    """Per parameter (our names) that tensor parallelism splits, the part rank `rank` keeps; every
    other parameter is kept whole. A routed expert's stack (E, out, in) is cut in its dims 1 / 2,
    or, with expert parallelism (`ep` = world), by whole experts in dim 0."""
    check_split(args, world, ep)
    if ep not in (1, world):
        raise ValueError(f"ep: must be 1 or the number of ranks ({world}); got {ep}")
    for name in ("hidden_dim", "moe_hidden_dim", "shared_expert_hidden_dim"):
        if getattr(args, name) % world:
            raise ValueError(f"tp: {world} does not divide the MLP's {name} ({getattr(args, name)})")
    hd, h = args.head_dim, args.n_heads // world
    q = (rank * h * hd, (rank + 1) * h * hd)
    if args.n_kv_heads >= world:
        kv_n = args.n_kv_heads // world
        kv = (rank * kv_n * hd, (rank + 1) * kv_n * hd)
    else:  # the one kv head this rank's q heads read
        head = rank * h // (args.n_heads // args.n_kv_heads)
        kv = (head * hd, (head + 1) * hd)
    qw, kvw = args.n_heads * hd, args.n_kv_heads * hd
    out: dict[str, Cut] = {}

    def mlp(prefix: str, width: int, stacked: bool = False) -> None:
        part = (rank * width // world, (rank + 1) * width // world)
        out[f"{prefix}w1{'' if stacked else '.weight'}"] = (1 if stacked else 0, [part])
        out[f"{prefix}w3{'' if stacked else '.weight'}"] = (1 if stacked else 0, [part])
        out[f"{prefix}w2{'' if stacked else '.weight'}"] = (2 if stacked else 1, [part])

    for i in range(args.n_layers):
        a = f"layers.{i}.attention."
        if args.fused_qkv:
            rows = [q, (qw + kv[0], qw + kv[1]), (qw + kvw + kv[0], qw + kvw + kv[1])]
            out[a + "wqkv.weight"] = out[a + "wqkv.bias"] = (0, rows)
        else:
            for p, part in (("wq", q), ("wk", kv), ("wv", kv)):
                out[f"{a}{p}.weight"] = out[f"{a}{p}.bias"] = (0, [part])
        out[a + "wo.weight"] = (1, [q])
        f = f"layers.{i}.feed_forward."
        if args.is_moe_layer(i) and ep > 1:
            held = args.n_experts // ep
            for w in ("w1", "w3", "w2"):
                out[f + w] = (0, [(rank * held, (rank + 1) * held)])
            if args.shared_expert_hidden_dim:
                mlp(f + "shared.", args.shared_expert_hidden_dim)
        elif args.is_moe_layer(i):
            mlp(f, args.moe_hidden_dim, stacked=True)
            if args.shared_expert_hidden_dim:
                mlp(f + "shared.", args.shared_expert_hidden_dim)
        else:
            mlp(f, args.hidden_dim)
    return out


def cuts_of(model, rank: int, world: int, ep: int = 1) -> dict[str, Cut]:
    """`cuts` for the model's layers: the shared transformer's, or a family's own (`tp_cuts`)."""
    own = getattr(model, "tp_cuts", None)
    return own(rank, world, ep) if own is not None else cuts(model.args, rank, world, ep)


def take(t: torch.Tensor, cut: Cut) -> torch.Tensor:
    """The part of the whole tensor `t` that `cut` keeps."""
    dim, segments = cut
    return torch.cat([t.narrow(dim, a, b - a) for a, b in segments], dim).contiguous()


class RankLost(RuntimeError):
    """A collective failed: another rank is gone (its process died, or its connection did). The
    ranks can no longer decode together; the caller answers with an error and stops."""


def collective(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, a torch.distributed collective; its failure raised as RankLost."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ConnectionError, OSError) as e:  # gloo / NCCL report a lost peer so
        raise RankLost(f"a tensor-parallel rank is gone ({_first_sentence(str(e))})") from e


def _first_sentence(message: str) -> str:
    """gloo's "[/path/pair.cc:537] Read error [127.0.0.1]:2793: Connection reset by peer. This is
    typically ..." as "Read error [127.0.0.1]:2793: Connection reset by peer"."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", (message.splitlines() or [""])[0])
    return text.split(". ")[0].rstrip(".") or message


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the ranks, in place (a lost rank raised as RankLost)."""
    collective(dist.all_reduce, t)
    return t


def _all_reduce_output(module: nn.Module) -> None:
    module.register_forward_hook(lambda _module, _inputs, output: all_reduce(output))


def apply(model, rank: int, world: int, split: bool = True, ep: int = 1, dispatch: str = "all-reduce"):
    """Make `model` rank `rank` of `world` (see the module docstring); returns it. `split=False`:
    its parameters already hold the rank's parts (read so by the loader) and only the rest changes.
    `ep` = world: expert parallelism, each rank holding E / world whole routed experts, their
    tokens reached by `dispatch` ("all-reduce" or "all-to-all", see `AllToAll`)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"ep_dispatch: must be one of {', '.join(DISPATCHES)} (got {dispatch!r})")
    if world == 1:
        return model
    if getattr(model, "quantization", None):
        raise ValueError(
            "tp: a model quantized in memory is not split; write a quantized checkpoint (fastdllm quantize) "
            "and load it with tp"
        )
    args = model.args
    parts = cuts_of(model, rank, world, ep)
    if split:
        with torch.no_grad():
            for name, param in list(model.named_parameters()):
                if name in parts:
                    module_name, attr = name.rsplit(".", 1)
                    setattr(
                        model.get_submodule(module_name),
                        attr,
                        nn.Parameter(take(param.data, parts[name]), requires_grad=False),
                    )
    model.tp, model.ep = (rank, world), ep
    if hasattr(model, "split_layers"):  # a family with layers of its own (DiffusionGemma)
        model.split_layers(rank, world, all_reduce)
        return model
    hd = args.head_dim
    n_heads = args.n_heads // world
    n_kv = max(1, args.n_kv_heads // world)
    for layer in model.layers:
        att = layer.attention
        att.n_heads, att.n_kv_heads = n_heads, n_kv
        for linear in (m for m in att.modules() if isinstance(m, nn.Linear)):
            linear.out_features, linear.in_features = linear.weight.shape
        _all_reduce_output(att.wo)
        _all_reduce_output(layer.feed_forward)
        ff = layer.feed_forward
        if ep > 1 and hasattr(ff, "first_expert"):
            ff.first_expert = rank * (args.n_experts // ep)
            ff.dispatch = AllToAll(ff, rank, world) if dispatch == "all-to-all" else ff.experts
    model.args = replace(
        args,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_size=hd,
        hidden_dim=args.hidden_dim // world,
        moe_hidden_dim=args.moe_hidden_dim // (1 if ep > 1 else world),
        shared_expert_hidden_dim=args.shared_expert_hidden_dim // world,
    )
    return model


DISPATCHES = ("all-reduce", "all-to-all")


class AllToAll:
    """Expert parallelism's token dispatch by all-to-all: each rank takes its share of the tokens
    (every rank holds all of them: attention's all-reduce made them whole), sends each (token,
    expert) pair to the rank holding that expert, computes the pairs it received, sends the
    outputs back and weights them for its own tokens; other tokens' rows are zero, and the layer's
    all-reduce (with the shared expert's partial sums) makes the output whole. The other dispatch,
    "all-reduce", has every rank compute the pairs of its own experts for all tokens and lets the
    same all-reduce add them up: no collective of its own."""

    def __init__(self, module, rank: int, world: int):
        self.module, self.rank, self.world = module, rank, world

    def __call__(self, flat_x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        m, world = self.module, self.world
        n, k = chosen.shape
        share = -(-n // world)
        lo, hi = min(n, self.rank * share), min(n, (self.rank + 1) * share)
        pairs = chosen[lo:hi].reshape(-1)
        held = m.w1.shape[0]
        owner = pairs // held
        order = owner.argsort(stable=True)
        send = torch.bincount(owner, minlength=world)
        recv = torch.empty_like(send)
        collective(dist.all_to_all_single, recv, send)
        sends, recvs = send.tolist(), recv.tolist()  # the split sizes: one host read per layer
        rows = flat_x[lo:hi][order // k]
        got_x = rows.new_empty((sum(recvs), rows.shape[-1]))
        collective(dist.all_to_all_single, got_x, rows, recvs, sends)
        got_e = pairs.new_empty(sum(recvs))
        collective(dist.all_to_all_single, got_e, pairs[order], recvs, sends)
        ys = m.pair_outputs(got_x, got_e - m.first_expert)
        back = ys.new_empty((sum(sends), ys.shape[-1]))
        collective(dist.all_to_all_single, back, ys, sends, recvs)
        out = torch.empty_like(back)
        out[order] = back
        y = flat_x.new_zeros(flat_x.shape)
        y[lo:hi] = m.combine(out, weights[lo:hi], flat_x.dtype)
        return y
