"""The packed step's attention on this machine: PyTorch's ways of attending ragged rows.

A step of the loop packs every row's window end to end; each row's queries attend over its own
keys (its cache row up to what it sees). Measured here on one layer's shapes (random tensors,
float32), for a batch of rows at typical places: most rows in the middle of a block (a window of
one block over a long cache), a few at a block's start (a wider window):

- `sdpa per row`: `scaled_dot_product_attention` once per row, on views of the cache (what
  `Attention.attend_segments` does);
- `sdpa padded`: one call over the batch padded to the longest window and the longest keys, a
  boolean mask for the padding (what the lockstep loop did);
- `flex eager` / `flex compiled`: `torch.nn.attention.flex_attention` over the packed queries and
  the rows' keys laid end to end, with a block mask that keeps each query to its row's keys
  (`create_block_mask`; the keys gathered from the cache rows each call);
- `sdpa jagged`: one `scaled_dot_product_attention` call over nested tensors of jagged layout
  (`torch.nested`, the rows' queries and keys each of its own length: varlen attention with no
  padding), the nested tensors built from the packed queries and the cache rows each call;
  `sdpa jagged kernel` the call alone (on a CPU only with `--jagged`: its math path is slow);
- `flex kernel`: the compiled flex call alone, its block mask and keys built beforehand: what each
  layer pays when a step builds its mask once for all layers and the keys already lie end to end
  (a paged pool); `flex mask` is the building of that block mask alone.

Reported: milliseconds per call (median of `--repeats`; on a GPU each call synchronised) and the
largest difference from the per-row result.

    python benchmarks/attention_kernels.py --out docs/results/attention_kernels.json
    python benchmarks/attention_kernels.py --device cuda --dtype bfloat16 --heads 32 --head-dim 128 \
        --prompt 1024 --rows 1 8 32 64        # LLaDA-8B's attention shapes on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.quantized_kernels import timed as timed_cpu  # noqa: E402  (ms, the median of repeats)


def timed(fn, repeats: int, device: torch.device) -> float:
    if device.type != "cuda":
        return timed_cpu(fn, repeats)
    return timed_cpu(lambda: (fn(), torch.cuda.synchronize()), repeats)


def layout(rows: int, heads: int, dim: int, prompt: int, block: int, starting: int, device, dtype, seed: int = 0):
    """Per row (window width, keys) and the tensors: packed queries (1, H, N, D), cache K/V
    (rows, H, L, D)."""
    g = torch.Generator().manual_seed(seed)
    shapes = []
    for i in range(rows):
        keys = prompt + block * (1 + i % 7)
        width = 3 * block if i < starting else block
        shapes.append((width, keys))
    length = max(k for _, k in shapes)
    n = sum(w for w, _ in shapes)
    q, k, v = (
        torch.randn(*shape, generator=g).to(device, dtype)
        for shape in ((1, heads, n, dim), (rows, heads, length, dim), (rows, heads, length, dim))
    )
    return shapes, q, k, v


def per_row(shapes, q, k, v):
    out, off = torch.empty_like(q), 0
    for i, (w, keys) in enumerate(shapes):
        out[:, :, off : off + w] = F.scaled_dot_product_attention(
            q[:, :, off : off + w], k[i : i + 1, :, :keys], v[i : i + 1, :, :keys]
        )
        off += w
    return out


def padded(shapes, q, k, v):
    rows, width, keys = len(shapes), max(w for w, _ in shapes), max(kk for _, kk in shapes)
    qp = q.new_zeros(rows, q.shape[1], width, q.shape[3])
    off = 0
    for i, (w, _) in enumerate(shapes):
        qp[i, :, :w] = q[0, :, off : off + w]
        off += w
    mask = (
        torch.arange(keys, device=q.device)[None, :] < torch.tensor([kk for _, kk in shapes], device=q.device)[:, None]
    )
    o = F.scaled_dot_product_attention(qp, k[:, :, :keys], v[:, :, :keys], attn_mask=mask[:, None, None, :])
    return torch.cat([o[i : i + 1, :, :w] for i, (w, _) in enumerate(shapes)], 2)


def jagged_inputs(shapes, q, k, v):
    """The rows' queries, keys and values as nested tensors (rows, heads, jagged, head_dim)."""
    qs, ks, vs, off = [], [], [], 0
    for i, (w, keys) in enumerate(shapes):
        qs.append(q[0, :, off : off + w].transpose(0, 1))
        ks.append(k[i, :, :keys].transpose(0, 1))
        vs.append(v[i, :, :keys].transpose(0, 1))
        off += w
    return tuple(torch.nested.nested_tensor(t, layout=torch.jagged).transpose(1, 2) for t in (qs, ks, vs))


def unpack_jagged(out):
    """A nested (rows, heads, jagged, head_dim) result as the packed (1, heads, N, head_dim)."""
    return torch.cat([t.transpose(0, 1) for t in out.transpose(1, 2).unbind()], 1)[None]


def jagged(shapes, q, k, v):
    return unpack_jagged(F.scaled_dot_product_attention(*jagged_inputs(shapes, q, k, v)))


def flex_inputs(shapes, k, v):
    """The rows' keys end to end (1, H, S, D) and a block mask: query row == key row."""
    ks = torch.cat([k[i : i + 1, :, :keys] for i, (_, keys) in enumerate(shapes)], 2)
    vs = torch.cat([v[i : i + 1, :, :keys] for i, (_, keys) in enumerate(shapes)], 2)
    q_row = torch.cat([torch.full((w,), i, device=k.device) for i, (w, _) in enumerate(shapes)])
    k_row = torch.cat([torch.full((keys,), i, device=k.device) for i, (_, keys) in enumerate(shapes)])

    def same_row(b, h, qi, ki):
        return q_row[qi] == k_row[ki]

    mask = create_block_mask(same_row, None, None, len(q_row), len(k_row), device=k.device)
    return ks, vs, mask


def flex(attend, shapes, q, k, v):
    """One step's flex attention, its block mask and gathered keys built for the step's layout."""
    ks, vs, mask = flex_inputs(shapes, k, v)
    return attend(q, ks, vs, block_mask=mask)


def measure(rows_list, heads, head_dim, prompt, block, repeats, device, dtype_name, jagged_on_cpu=False) -> list[dict]:
    """One result per batch size in `rows_list`: each way's milliseconds and its largest difference
    from the per-row result (a way this torch build cannot run: why it failed)."""
    device, dtype = torch.device(device), getattr(torch, dtype_name)
    compiled = torch.compile(flex_attention)
    results = []
    with torch.inference_mode():
        for rows in rows_list:
            shapes, q, k, v = layout(rows, heads, head_dim, prompt, block, max(1, rows // 4), device, dtype)
            ref = per_row(shapes, q, k, v)
            row = {"rows": rows, "queries": q.shape[2], "keys": sum(kk for _, kk in shapes), "device": str(device)}
            row |= {"dtype": dtype_name, "heads": heads, "head_dim": head_dim}
            ways = {
                "sdpa per row": lambda: per_row(shapes, q, k, v),
                "sdpa padded": lambda: padded(shapes, q, k, v),
                "flex eager": lambda: flex(flex_attention, shapes, q, k, v),
                "flex compiled": lambda: flex(compiled, shapes, q, k, v),
            }
            if device.type == "cuda" or jagged_on_cpu:
                ways["sdpa jagged"] = lambda: jagged(shapes, q, k, v)
                nested = jagged_inputs(shapes, q, k, v)
                ways["sdpa jagged kernel"] = lambda: unpack_jagged(F.scaled_dot_product_attention(*nested))
            ks, vs, mask = flex_inputs(shapes, k, v)
            ways["flex kernel"] = lambda: compiled(q, ks, vs, block_mask=mask)
            ways["flex mask"] = lambda: flex_inputs(shapes, k, v)
            for name, fn in ways.items():
                try:
                    row[name + " ms"] = round(timed(fn, repeats, device), 3)
                    if name != "flex mask":
                        row[name + " max diff"] = float((fn() - ref).abs().max().float())
                except Exception as e:  # a way this torch build cannot run here
                    row[name + " ms"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=320)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=1, help="CPU threads")
    ap.add_argument("--jagged", action="store_true", help="also SDPA over jagged nested tensors on a CPU")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = measure(
        args.rows,
        args.heads,
        args.head_dim,
        args.prompt,
        args.block,
        args.repeats,
        args.device,
        args.dtype,
        args.jagged,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
