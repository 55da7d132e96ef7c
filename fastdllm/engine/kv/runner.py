"""The one owner of a model's decode K/V: its page pool and the prefix store over it.

`generate`, the server's scheduler, the demo and the evaluation harness each hold a `KVRunner` and
hand it to the decoding loop (`BlockDecoder(kv=...)`); a call that brings none decodes with the
model's default runner (`runner_for`), so that plain `generate` calls share prompts through one
prefix store as a server's requests do. Nothing rides on the model: its layers only read and write
the slots a step hands them.

Budgets are the runner's own: `budget_bytes` (the server's `--kv-cache-memory`) is one pool of that
many bytes, allocated once and handed to each decode in turn with every page free (the server
decodes one batch at a time); without one, a decode's pool grows as its rows need and is kept for
the next decode (as a caching allocator keeps freed memory). `prefix_cache_bytes` (the server's
`--prefix-cache-memory`) bounds the prompt K/V the store keeps.
"""

from __future__ import annotations

import weakref

import torch

from .pages import PagedKVCache, kv_bytes
from .prefix import DEFAULT_BUDGET_BYTES, Lookups, PrefixStore


class KVRunner:
    """A model's pages and stored prompts: `pool` / `release` per decode, `store` over a pool,
    `lookups` counted across the stores, `reset_prefix_cache`."""

    def __init__(self, model, budget_bytes: int | None = None, prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES):
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be >= 0 (got {budget_bytes})")
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes: must be >= 0 (got {prefix_cache_bytes})")
        self.model = weakref.proxy(model)  # a runner of the default table must not keep its model alive
        self.budget_bytes, self.prefix_cache_bytes = budget_bytes, prefix_cache_bytes
        self.lookups = Lookups()
        self._stores: weakref.WeakSet[PrefixStore] = weakref.WeakSet()
        self.spare: PagedKVCache | None = None  # the last decode's growable pool, for the next one
        self.budget_pool: PagedKVCache | None = None  # the one pool of `budget_bytes`

    def page_bytes(self, page_size: int) -> int:
        return kv_bytes(self.model.kv_shape, page_size, self.model.dtype)

    def pool(self, page_size: int) -> PagedKVCache:
        """The pool a decode's rows page into, every page free but those the store keeps."""
        model, shape = self.model, (*self.model.kv_shape, page_size)
        if self.budget_bytes is None:
            spare, self.spare = self.spare, None
            if spare is not None and (spare.page_size, spare.k.dtype, spare.k.device) == (
                page_size,
                model.dtype,
                model.device,
            ):
                spare.reset()
                return spare
            return PagedKVCache(*shape, dtype=model.dtype, device=model.device)
        pool = self.budget_pool
        if pool is None or pool.page_size != page_size:
            self.budget_pool = None  # freed before its successor is allocated
            pages = self.budget_bytes // self.page_bytes(page_size)
            pool = PagedKVCache(*shape, pages, dtype=model.dtype, device=model.device, growable=False)
            self.budget_pool = pool
        pool.reset()
        return pool

    def release(self, pool: PagedKVCache) -> None:
        """A decode is done with its pool: every page free, and a growable one kept for the next
        decode, so that a server's batches and an evaluation's calls do not grow a pool from
        nothing each time."""
        pool.reset()
        if pool.growable:
            self.spare = pool

    def store(self, pool: PagedKVCache) -> PrefixStore:
        """The prefix store over `pool` (one per pool: its pages are the store's blocks)."""
        if pool.prefix is None:
            self._stores.add(PrefixStore(pool, self.prefix_cache_bytes, self.lookups))
        return pool.prefix

    def stores(self) -> list[PrefixStore]:
        """The stores alive (one per pool)."""
        return list(self._stores)

    @property
    def prefix_bytes(self) -> int:
        """Bytes of prompt K/V the stores hold."""
        return sum(s.bytes for s in self._stores)

    def reset_prefix_cache(self) -> None:
        """Forget every stored prompt (vLLM's `reset_prefix_cache`)."""
        for store in self.stores():
            store.clear()


_DEFAULT: weakref.WeakKeyDictionary[torch.nn.Module, KVRunner] = weakref.WeakKeyDictionary()


def runner_for(model) -> KVRunner:
    """The runner of decodes that bring none (`generate` without `kv=`): one per model, unbounded,
    its prefix store of the default budget."""
    runner = _DEFAULT.get(model)
    if runner is None:
        runner = _DEFAULT[model] = KVRunner(model)
    return runner
