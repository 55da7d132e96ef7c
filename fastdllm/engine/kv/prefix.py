"""Prompt K/V kept across rows and requests: a prefix cache keyed by blocks, as vLLM's automatic
prefix caching and SGLang's radix cache key theirs.

A prompt is cut into blocks of `block_size` tokens; block j's key is a hash of block j-1's key and
block j's tokens (a hash chain), so a key stands for the whole prefix up to the block's end. An
entry keeps the block's K/V of every layer, its tokens and its parent's key: a lookup walks a new
prompt's chain from the first block and stops at the first miss, and every hit compares the
entry's tokens and parent with the prompt's own, so a hash collision never serves another
prompt's K/V. An entry's K/V is a page of the K/V pool (`kv.pages.PagedKVCache`), the page
of the row that computed it, held by reference: a row that finds it holds the same page, and
copies it only before writing into it. Entries are evicted least recently used first once their
bytes pass the store's budget, and when the pool needs their pages for rows (only pages no row
holds).

For a block-causal model (SDAR / TraDo, Fast-dLLM v2, LLaDA2) a prompt block's K/V depend only on
the tokens up to the block's end: a stored block is exactly what the row would compute, so the
sharing is exact. For a bidirectional model (LLaDA, Dream) a prompt position's K/V also depend on
everything after it (the rest of its prompt, the masked answer), so sharing them is an
approximation, of the kind Fast-dLLM's prefix cache already makes; `GenerationConfig.prefix_cache`
says which the caller wants.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Lookups:
    """Prompt tokens looked up and found (vLLM's prefix-cache hit rate is hits / queries), counted
    by a runner across its stores, so that they only grow while pools come and go."""

    hits: int = 0
    queries: int = 0


@dataclass
class Entry:
    parent: int | None
    tokens: tuple[int, ...]
    page: int  # the pool's page that holds the block's K/V of every layer


class PrefixStore:
    """Block-aligned prompt K/V, pages of `pool` (blocks of its page size), under a byte budget
    (LRU), its lookups counted in `lookups`."""

    def __init__(self, pool, budget_bytes: int, lookups: Lookups | None = None):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be >= 0 (got {budget_bytes})")
        # the pool owns its store: a weak reference back, so that a pool let go is freed at once
        self.pool, self.budget, self.block_size = weakref.proxy(pool), budget_bytes, pool.page_size
        self.page_bytes = pool.page_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.lookups = lookups or Lookups()
        pool.prefix = self  # the pool evicts through it when it runs out

    @property
    def bytes(self) -> int:
        return len(self.entries) * self.page_bytes

    def keys(self, tokens: list[int]) -> list[int]:
        """The chain's keys of the prompt's full blocks."""
        return self.chain_keys(tokens, self.block_size)

    @staticmethod
    def chain_keys(tokens: list[int], block_size: int) -> list[int]:
        """The hash chain's keys of the full blocks of `block_size` tokens."""
        out, parent, bs = [], None, block_size
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
            if key in self.entries:  # an ancestor the pool evicted since the row found it
                self.entries.move_to_end(key)

    def lookup(self, tokens: list[int]) -> list[int]:
        """The pages of the prompt's longest stored prefix of full blocks, in order (marked as
        recently used)."""
        found, bs = self._chain(tokens), self.block_size
        self._touch([key for key, _ in found])
        self.lookups.queries += len(tokens) // bs * bs
        self.lookups.hits += len(found) * bs
        return [entry.page for _, entry in found]

    def insert(self, tokens: list[int], first: int, pages: list[int]) -> None:
        """Keep blocks `first`.. of the prompt's full blocks, whose K/V are the pool's `pages` (a
        row's, from its block `first` on): the store holds them too."""
        keys = self.keys(tokens)
        if self.page_bytes > self.budget:
            return
        for j in range(first, len(keys)):
            if keys[j] in self.entries:
                continue
            bs, page = self.block_size, pages[j - first]
            self.entries[keys[j]] = Entry(keys[j - 1] if j else None, tuple(tokens[j * bs : (j + 1) * bs]), page)
            self.pool.hold([page], stored=True)
            self._touch(keys[: j + 1])
            while self.bytes > self.budget:
                self._remove(next(iter(self.entries)))
            if keys[j] not in self.entries:  # the budget took it: a lookup would never reach its children
                break

    def _remove(self, key: int) -> None:
        self.pool.drop([self.entries.pop(key).page], stored=True)

    def evict(self, pages: int) -> None:
        """Give the pool up to `pages` pages that only the store holds, least recently used first."""
        refs, victims = self.pool.refs, []
        for key, entry in self.entries.items():  # oldest first: the walk usually stops at once
            if len(victims) == pages:
                break
            if refs[entry.page] == 1:
                victims.append(key)
        for key in victims:
            self._remove(key)

    def clear(self) -> None:
        for key in list(self.entries):
            self._remove(key)


DEFAULT_BUDGET_BYTES = 256 << 20  # a store's budget where its runner names none
