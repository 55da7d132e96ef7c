"""Preallocated key/value buffers for block-wise approximate KV caching (Fast-dLLM).

One buffer per layer for keys and one for values, each (batch, kv_heads, length, head_dim),
allocated once per generation. A full forward writes every position; a windowed forward
(prefix or dual mode) overwrites only its window in place, so nothing is concatenated per step.
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

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def narrow(self, batch: int) -> "KVCache":
        """A view of the first `batch` rows (no copy): used when finished rows leave the batch."""
        if batch == self.batch:
            return self
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, :batch], self.v[:, :batch]
        return view

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
