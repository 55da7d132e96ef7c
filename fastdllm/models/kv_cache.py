"""Key/value caches for block-wise approximate KV caching (Fast-dLLM).

`KVCache`: one buffer per layer for keys and one for values, each (batch, kv_heads, length,
head_dim), for a model's own cached forwards (`Transformer.logits_for`, the fixed-shape step, the
benchmarks); the decoding loop's rows page into `engine.kv.pages.PagedKVCache`. Each owns its writes
(as gpt-fast's `KVCache.update`): a layer's attention hands it the fresh K/V of the window it
computed, the cache writes them in place and returns the K/V to attend over. A full forward writes
every position; a windowed forward (prefix or dual mode, or any partial refresh) only its window,
so nothing is concatenated per step.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, length: int, head_dim: int, *, dtype, device):
        shape = (n_layers, batch, n_kv_heads, length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self.k[i], self.v[i])

    def narrow(self, batch: int, length: int | None = None) -> KVCache:
        """A view of the first `batch` rows and `length` positions (no copy)."""
        length = self.length if length is None else length
        if batch == self.batch and length == self.length:
            return self
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, :batch, :, :length], self.v[:, :batch, :, :length]
        return view

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class LayerKV:
    """One layer's slice of a KVCache."""

    __slots__ = ("k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def update_row(self, row: int, start: int, k, v, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one row's K/V (1, heads, T, head_dim) of positions [start, start + T) in place;
        return that row's cached K/V of positions [0, keys) (views)."""
        self.k[row : row + 1, :, start : start + k.shape[2]] = k
        self.v[row : row + 1, :, start : start + k.shape[2]] = v
        return self.k[row : row + 1, :, :keys], self.v[row : row + 1, :, :keys]

    def update(self, start, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the K/V of positions [start, start + T) in place; return the whole cached K/V
        (positions outside the window keep what an earlier forward wrote). `start` an int, or a
        0-d tensor, or a (B, T) tensor of each row's columns: the write's place is then data, not
        shape, so a captured graph replays it at every step."""
        if isinstance(start, torch.Tensor) and start.dim() == 2:  # (B, T): each row's own columns
            where = start[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.k.scatter_(2, where, k)
            self.v.scatter_(2, where, v)
            return self.k, self.v
        if isinstance(start, torch.Tensor):
            where = start + torch.arange(k.shape[2], device=k.device)
            self.k.index_copy_(2, where, k)
            self.v.index_copy_(2, where, v)
            return self.k, self.v
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k, self.v
