"""One attention call per layer for every row of a packed forward.

A packed forward lays its rows' windows end to end (no padding): row r's queries are `widths[r]`
consecutive positions, and it attends over its own keys, wherever they are (pool slots, or the
packed positions of its window). `PackedRows` is built once per forward and shared by its layers:
the rows' queries padded to the widest window and their keys to the most keys, as index tables,
so that a layer gathers every row's queries and keys in one index each and runs one SDPA; a padded
key is masked, a padded query sees key 0 (no row of -inf) and is dropped.

Where it pays is the device's question: on a GPU every call is a kernel launch (an H200 ran one
padded call per layer faster than a call per row from about 8 rows, `docs/results.md`); on this
project's CPU a call per row over views of the pool was measured faster for the shared
transformer's shapes. Padding also changes how a row's sums are split and rounded, so batch
invariance (`--deterministic`) keeps a call per row at the row's own shapes (`one_call`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# What a model's packed forward does: "auto" (its rule: `one_call`), "one" or "per_row".
ATTENTION_CALLS = ("auto", "one", "per_row")


def one_call(setting: str, device: torch.device, rows: int, batch_invariant: bool, cpu_too: bool) -> bool:
    """Whether a packed forward attends in one call per layer: never under batch invariance; "one"
    and "per_row" as they say; "auto" from 8 rows on a GPU, and on a CPU where the model's own
    measurements say so (`cpu_too`)."""
    if setting not in ATTENTION_CALLS:
        raise ValueError(f"attention_calls: must be one of {', '.join(ATTENTION_CALLS)} (got {setting!r})")
    if batch_invariant or setting == "per_row" or rows < 2:
        return False
    return setting == "one" or cpu_too or (device.type != "cpu" and rows >= 8)


class PackedRows:
    """The index tables of one call for rows of `widths` queries packed end to end, row r attending
    over its keys `key_slots[r, :keys[r]]` (positions in whatever its keys are gathered from; the
    table padded past them)."""

    def __init__(self, widths: list[int], key_slots: torch.Tensor, keys: list[int], device):
        width, most = max(widths), key_slots.shape[1]
        sizes = torch.tensor([widths, keys], device=device)
        offsets = sizes[0].cumsum(0) - sizes[0]
        self.queries = (offsets[:, None] + torch.arange(width, device=device)).clamp(max=sum(widths) - 1)
        self.valid = torch.arange(width, device=device)[None, :] < sizes[0][:, None]
        # where each packed query sits in the (rows x width) padded output: no boolean index (on a
        # GPU, a host read per layer)
        self.unpadded = torch.tensor(
            [r * width + j for r, w in enumerate(widths) for j in range(w)], dtype=torch.long, device=device
        )
        self.keys = key_slots
        # (rows, queries, keys): a row's real keys
        self.seen = (torch.arange(most, device=device)[None, None, :] < sizes[1][:, None, None]).expand(
            len(widths), width, most
        )
        self.padded_queries = width > min(widths)

    def mask(self, allowed: torch.Tensor | None) -> torch.Tensor:
        """(rows, 1, queries, keys) of what each row's queries attend: `allowed` (rows, queries,
        keys; None: every real key) within its real keys; a padded query sees key 0 too (never a
        row of -inf: its output is dropped)."""
        mask = self.seen.clone() if allowed is None else allowed & self.seen
        if self.padded_queries:
            mask[:, :, 0] |= ~self.valid
        return mask[:, None]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale=None, gqa=False):
        """q (N, heads, d) packed; keys, values (rows, keys, kv heads, d) gathered at `self.keys`;
        returns (N, heads, d) in packing order."""
        out = F.scaled_dot_product_attention(
            q[self.queries].transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        )
        return out.transpose(1, 2).flatten(0, 1)[self.unpadded]
