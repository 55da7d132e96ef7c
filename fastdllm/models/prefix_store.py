"""Prompt K/V kept across rows and requests: a prefix cache keyed by blocks, as vLLM's automatic
prefix caching and SGLang's radix cache key theirs.

A prompt is cut into blocks of `block_size` tokens; block j's key is a hash of block j-1's key and
block j's tokens (a hash chain), so a key stands for the whole prefix up to the block's end. An
entry keeps the block's K/V of every layer, its tokens and its parent's key: a lookup walks a new
prompt's chain from the first block and stops at the first miss, and every hit compares the
entry's tokens and parent with the prompt's own, so a hash collision never serves another
prompt's K/V. Entries are evicted least recently used first once their bytes pass the budget.

For a block-causal model (SDAR / TraDo, Fast-dLLM v2, LLaDA2) a prompt block's K/V depend only on
the tokens up to the block's end: a stored block is exactly what the row would compute, so the
sharing is exact. For a bidirectional model (LLaDA, Dream) a prompt position's K/V also depend on
everything after it (the rest of its prompt, the masked answer), so sharing them is an
approximation, of the kind Fast-dLLM's prefix cache already makes; `GenerationConfig.prefix_cache`
says which the caller wants.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    parent: int | None
    tokens: tuple[int, ...]
    k: torch.Tensor  # (layers, kv_heads, block_size, head_dim)
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()


class PrefixStore:
    """Block-aligned prompt K/V under a byte budget (LRU). `hits` and `queries` count prompt
    tokens looked up and found (vLLM's prefix-cache hit rate is hits / queries)."""

    def __init__(self, budget_bytes: int, block_size: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be >= 0 (got {budget_bytes})")
        self.budget, self.block_size = budget_bytes, block_size
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.bytes = 0
        self.hits = self.queries = 0

    def keys(self, tokens: list[int]) -> list[int]:
        """The chain's keys of the prompt's full blocks."""
        out, parent, bs = [], None, self.block_size
        for j in range(len(tokens) // bs):
            parent = hash((parent, tuple(tokens[j * bs : (j + 1) * bs])))
            out.append(parent)
        return out

    def _chain(self, tokens: list[int]) -> list[tuple[int, Entry]]:
        found, parent, bs = [], None, self.block_size
        for j, key in enumerate(self.keys(tokens)):
            entry = self.entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != tuple(tokens[j * bs : (j + 1) * bs]):
                break
            found.append((key, entry))
            parent = key
        return found

    def match(self, tokens: list[int]) -> int:
        """How many of the prompt's leading full blocks are stored (nothing counted or touched)."""
        return len(self._chain(tokens))

    def _touch(self, keys: list[int]) -> None:
        # the deepest block first and the first block last: eviction takes a chain's tail before its head
        for key in reversed(keys):
            self.entries.move_to_end(key)

    def lookup(self, tokens: list[int]) -> list[Entry]:
        """The stored entries of the prompt's longest stored prefix of full blocks (marked as
        recently used)."""
        found, bs = self._chain(tokens), self.block_size
        self._touch([key for key, _ in found])
        self.queries += len(tokens) // bs * bs
        self.hits += len(found) * bs
        return [entry for _, entry in found]

    def insert(self, tokens: list[int], first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep blocks `first`.. of the prompt's full blocks, whose K/V are `k`, `v` (layers,
        kv_heads, columns, head_dim) from column `first * block_size` on."""
        keys, bs = self.keys(tokens), self.block_size
        for j in range(first, len(keys)):
            if keys[j] in self.entries:
                continue
            lo = (j - first) * bs
            entry = Entry(
                keys[j - 1] if j else None,
                tuple(tokens[j * bs : (j + 1) * bs]),
                k[:, :, lo : lo + bs].clone(),
                v[:, :, lo : lo + bs].clone(),
            )
            if entry.nbytes > self.budget:
                return
            self.entries[keys[j]] = entry
            self.bytes += entry.nbytes
            self._touch(keys[: j + 1])
            while self.bytes > self.budget:
                _, old = self.entries.popitem(last=False)
                self.bytes -= old.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


DEFAULT_BUDGET_BYTES = 256 << 20


def store_for(model, block_size: int) -> PrefixStore:
    """The model's store for prompts cut in blocks of `block_size` (one per block size: a
    block-causal model's K/V are exact only in its attention's blocks), under
    `model.prefix_cache_bytes` (default 256 MiB)."""
    stores = model.__dict__.setdefault("_prefix_stores", {})
    if block_size not in stores:
        stores[block_size] = PrefixStore(getattr(model, "prefix_cache_bytes", DEFAULT_BUDGET_BYTES), block_size)
    return stores[block_size]
