"""Batch-invariant forwards: a row's logits bit for bit the same whatever else is in its batch.

A batched forward computes each row with the same formulas as alone, but not with the same
arithmetic: a matrix multiply's kernel picks its blocking (and so its order of summation) from the
number of rows it is given, and attention over a left-padded row splits its sums differently.
In float32 the difference is ~1e-6; in bfloat16 ~1e-2 of a logit, which flips a near-tied token
and, decoding greedily, the rest of the answer. Under `BatchInvariant` (after Thinking Machines'
"Defeating Nondeterminism in LLM Inference", SGLang's deterministic inference):

- every linear layer (`F.linear`: projections, MLPs, routers, the head) runs in tiles of a fixed
  number of rows (`TILE_ROWS`, the last one zero-padded), so the kernel sees the same shape
  whatever the batch; a row's result does not depend on where in a tile it falls;
- a mixture's routed experts (`F.grouped_mm`, groups as many rows as were routed there) run as one
  small multiply per (token, expert) pair;
- attention runs row by row over the row's own keys and queries (`Transformer.hidden` hands
  `Attention.attend` each row's span), as an unbatched row attends.

This costs throughput (more, smaller kernels), so it is a flag (`GenerationConfig.deterministic`,
`fastdllm serve --deterministic`); docs/serving.md gives the measured cost. Quantized layers
(int8 / int4 kernels) are not covered: their kernels are chosen by the number of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TILE_ROWS = 64


def linear_in_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` computed in tiles of exactly TILE_ROWS rows."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = rows.shape[0]
    pad = (-n) % TILE_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    out = torch.cat([F.linear(tile, weight, bias) for tile in rows.split(TILE_ROWS)])
    return out[:n].reshape(*lead, weight.shape[0])


def grouped_as_pairs(
    x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor | None = None, **kwargs
) -> torch.Tensor:
    """`F.grouped_mm(x, weight_t, offs=offs)` (rows of x in groups ending at `offs`, group g times
    weight_t[g]) as one (1, K) x (K, N) multiply per row."""
    if offs is None or x.dim() != 2 or kwargs:
        return F.grouped_mm(x, weight_t, offs=offs, **kwargs)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    group = torch.repeat_interleave(torch.arange(len(offs), device=x.device), counts, output_size=x.shape[0])
    return torch.bmm(x.unsqueeze(1), weight_t[group]).squeeze(1)


class BatchInvariant(TorchFunctionMode):
    """While active (a `with` block), the forwards' batch-dependent kernels run batch-invariantly."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear_in_tiles(*args, **kwargs)
        if func is F.grouped_mm:
            return grouped_as_pairs(*args, **kwargs)
        return func(*args, **kwargs)
