"""A decode's rows over its runner's pool: page tables, prompts shared through the prefix store,
prompts prefilled in chunks, copy-on-write before a write. One `RowPages` per decoding loop
(`BlockDecoder.pages`), the same for every cache policy: a policy says which windows to compute
(`engine.cache`), the runner computes them (`KVRunner.logits`), and `run` gives their forward its
pages. It also holds the decode's forward settings and the work its forwards did.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .pages import PagedKVCache
from .prefix import PrefixStore
from .runner import KVRunner

# A row's window: (row, first column, end column, keys it attends, first column whose logits are read)
Window = tuple[int, int, int, int, int]


def shares_prefixes(model, config) -> bool:
    """Whether rows decoded under `config` share prompt K/V across rows and requests: where
    `config.prefix_cache` asks for it, exactly (a prompt block's K/V depend on it and what comes
    before alone: `Transformer.causal_prompt`) or approximately (any model)."""
    exact = model.causal_prompt
    return config.prefix_cache == "approximate" or (config.prefix_cache == "exact" and exact)


class RowPages:
    """The pages of a decode's rows (`layout` columns of each, in pages of `page_size`), in a pool
    of `runner`'s. `shares`: rows share prompt blocks through the runner's prefix store. `counted`:
    the pages count as a cache in `peak_bytes` (not so for a policy whose every forward computes
    all the keys it reads: working memory of one forward)."""

    def __init__(
        self,
        runner: KVRunner,
        page_size: int,
        shares: bool = False,
        counted: bool = True,
        compiled: bool = False,
        batch_invariant: bool = False,
        graphs: bool = False,
    ):
        self.runner, self.page_size, self.shares, self.counted = runner, page_size, shares, counted
        # the forwards: through the model's torch.compile'd layers; each row's logits exactly as
        # computed alone, whatever the batch (`models.invariance`); DualCache's steps captured as
        # CUDA graphs (`KVRunner.logits`)
        self.compiled, self.batch_invariant, self.graphs = compiled, batch_invariant, graphs
        # per forward, (row, query positions, key positions) for each row it computed, which the
        # loop charges to those rows (`take_work`)
        self.work: list[list[tuple[int, int, int]]] = []
        self.latest: torch.Tensor | None = None  # (B, width, V) rows' latest logits (`block_logits`)
        self.pool: PagedKVCache | None = None
        self.peak_bytes = 0  # the most K/V bytes the rows held at once
        self.unstored: dict[int, tuple[int, list[int]]] = {}  # row -> (first block to store, prompt)
        self.chunks: list = []  # this step's prefill chunks (`queue_prefill`)
        self.prefill_work: list[tuple[int, int, int]] = []  # (key, query positions, keys) per chunk computed
        self.adopted: dict[int, int] = {}  # at the last relayout: new row -> the prefilled prompt's key
        self.joined: dict[int, int] = {}  # at the last relayout: new row -> its columns (taken in `reuse`)

    @classmethod
    def of(cls, runner: KVRunner, model, config, holds_cache: bool) -> RowPages:
        """The pages of a decode of `model` under `config` whose cache policy holds a cache across
        forwards (`holds_cache`: they count as one, and prompts are shared where the config asks) or
        not (one forward's working memory)."""
        return cls(
            runner,
            config.block_length,
            shares=holds_cache and shares_prefixes(model, config),
            counted=holds_cache,
            compiled=config.compile,
            batch_invariant=config.deterministic,
            graphs=config.cuda_graphs,
        )

    @property
    def store(self) -> PrefixStore | None:
        """The prefix store the rows share prompt K/V through, None where they do not."""
        return self.runner.store(self._the_pool()) if self.shares else None

    def _the_pool(self) -> PagedKVCache:
        if self.pool is None:
            self.pool = self.runner.pool(self.page_size)
        return self.pool

    def _rows(self, bsz: int) -> PagedKVCache:
        pool = self._the_pool()
        if len(pool.tables) != bsz:  # rows laid out without `relayout` (a first batch)
            kept = list(range(min(bsz, len(pool.tables))))
            pool.set_rows(kept + [None] * (bsz - len(kept)))
        return pool

    def _account(self, pool: PagedKVCache) -> None:
        if self.counted:
            self.peak_bytes = max(self.peak_bytes, pool.peak_pages * pool.page_bytes)

    def cache_for(self, seq) -> PagedKVCache:
        """The pool, with pages for every column each row's forwards may write (to `seq.end`)."""
        pool = self._rows(seq.x.shape[0])
        for i in range(seq.x.shape[0]):
            pool.reserve(i, seq.end(i))
        self._account(pool)
        return pool

    def relayout(self, sources: list[int | None], columns: list[int] | None = None, adopt: dict | None = None) -> None:
        """The loop laid its rows out again: new row i is old row `sources[i]` (None: a row that
        just joined, whose region takes `columns[i]` columns, and whose prompt's pages are those
        prefilled under the key `adopt[i]`, if any; its other pages are taken in `reuse`, after
        those the prefix store shares). Each kept row keeps its pages; those of rows that left
        return to the pool. Nothing is copied. No rows and nothing pending: the pool goes back to
        the runner."""
        if not sources and (self.pool is None or not self.pool.pending):
            if self.pool is not None:
                self.runner.release(self.pool)
            self.pool = self.latest = None
            return
        if self.latest is not None:  # each kept row keeps its latest logits
            kept = [(i, j) for i, j in enumerate(sources) if j is not None]
            latest = self.latest.new_zeros((len(sources), *self.latest.shape[1:]))
            if kept:
                dst, src = (torch.tensor(t, device=latest.device) for t in zip(*kept))
                latest[dst] = self.latest[src]
            self.latest = latest
        pool = self._the_pool()
        pool.set_rows(sources, None, adopt)
        self.adopted = dict(adopt or {})
        self.joined = {i: c for i, (s, c) in enumerate(zip(sources, columns or [None] * len(sources))) if s is None}
        self._account(pool)

    def take_work(self) -> list[list[tuple[int, int, int]]]:
        work, self.work = self.work, []
        return work

    def block_logits(self, seq, windows: list[Window], parts: list[torch.Tensor], partial: bool) -> torch.Tensor:
        """Every row's logits (B, seq.width, V) from the forward's `parts` (one per window, from its
        start column on; a later window of a row replaces an earlier one's). With `partial` (a
        policy whose windows may cover part of a row's block) each window's logits are written at
        its own columns over the row's latest logits, which the columns it did not compute keep."""
        width = seq.width
        if not partial:
            by_row = {w[0]: p for w, p in zip(windows, parts)}
            rows = [by_row[i][:width] for i in range(len(seq.starts))]
            if any(r.shape[0] < width for r in rows):  # a narrower row's (rows of other block lengths)
                rows = [torch.nn.functional.pad(r, (0, 0, 0, width - r.shape[0])) for r in rows]
            return torch.stack(rows)
        bsz = len(seq.starts)
        if self.latest is None or self.latest.shape[0] != bsz:
            self.latest = parts[0].new_zeros((bsz, width, parts[0].shape[-1]))
        for (i, _, _, _, start), out in zip(windows, parts):
            at = start - seq.starts[i]
            n = min(out.shape[0], width - at)
            self.latest[i, at : at + n] = out[:n].to(self.latest.dtype)
        return self.latest.clone()

    def reuse(self, bsz: int, prompts: dict[int, list[int]]) -> dict[int, int]:
        """Rows that just joined (row -> its prompt): the stored K/V of each prompt's longest stored
        prefix of blocks, shared as the row's first pages, then pages for the rest of its columns;
        per row, the columns reused. The blocks it then computes itself are stored after its first
        forward."""
        out = {i: len(prompts[i]) for i in self.adopted}  # prefilled in chunks: its pages hold the whole prompt
        pool, store = self._rows(bsz), self.store
        for i, tokens in prompts.items():
            if store is not None and i not in self.adopted:
                bs = store.block_size
                out[i] = self._share_stored(pool, i, tokens)
                if out[i] < len(tokens) // bs * bs:
                    self.unstored[i] = (out[i] // bs, tokens)
            if self.joined.get(i) is not None:
                pool.reserve(i, self.joined[i])
        self.joined = {}
        self._account(pool)
        return out

    def _share_stored(self, pool: PagedKVCache, row: int, tokens: list[int]) -> int:
        """The store's pages of the prompt's longest stored prefix of blocks, made row `row`'s first
        pages (by reference); the columns they hold."""
        pages = self.store.lookup(tokens)
        pool.share(row, pages)
        return len(pages) * pool.page_size

    # -- chunked prefill: a prompt's K/V computed in the forwards of the rows decoding, before its
    # row joins them (block-causal models, whose prompt blocks' K/V depend on nothing after them)
    def waits(self, joining: list[list[int]], prefilling: list[list[int]]) -> list[bool]:
        """Per prompt of rows about to join, whether it waits a step: its first block missing from
        the prefix store is one that a prompt joining before it (or one being prefilled) computes,
        so it waits for it to be stored rather than compute it too (a batch of prompts sharing
        few-shot exemplars computes them once)."""
        store = self.store
        if store is None:
            return [False] * len(joining)
        computing, out = set(), []
        for tokens in prefilling:  # the blocks their chunks are computing
            computing.update(store.keys(tokens)[store.match(tokens) :])
        for tokens in joining:
            keys, first = store.keys(tokens), store.match(tokens)
            out.append(first < len(keys) and keys[first] in computing)
            if not out[-1]:
                computing.update(keys[first:])
        return out

    def start_prefill(self, key: int, tokens: list[int]) -> int:
        """Pending pages for a prompt (`key`: its row's), holding what the prefix store has of it;
        returns the columns found there, from which its prefill starts."""
        pool = self._the_pool()
        pool.start_pending(key)
        if self.store is None:
            return 0
        row = pool.append_pending([key])
        found = self._share_stored(pool, row, tokens)
        pool.drop_appended(row)
        return found

    def queue_prefill(self, chunks: list[tuple[int, torch.Tensor, int, int]]) -> None:
        """Prompts' columns to compute in this step's first forward: (key, the prompt's tokens,
        first column, end column); their logits are not read, their K/V written to their pages."""
        self.chunks = list(chunks)

    def charge_prefill(self, rows) -> int:
        """The chunks this step's forwards computed, charged to their rows (those being prefilled:
        a row's key is its id); returns the query positions computed."""
        by_key, computed = {id(r): r for r in rows}, 0
        for key, queries, keys in self.prefill_work:
            r = by_key[key]
            r.prefilled += queries
            r.forward_positions += queries
            r.attended_positions += queries * keys
            computed += queries
        self.prefill_work.clear()
        return computed

    def release_prefill(self, key: int) -> None:
        if self.pool is not None:
            self.pool.release(key)

    def run(
        self,
        seq,
        windows: list[Window],
        forward: Callable[[torch.Tensor, list[Window], PagedKVCache], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        """`forward(x, windows, cache)` over the rows' pages: each window's pages that another
        holder shares copied first, this step's prefill chunks laid out after the rows (their
        logits dropped), and the prompt blocks the store lacked stored after it."""
        x, cache, chunks = seq.x, self.cache_for(seq), self.chunks
        self.chunks = []
        for row, lo, hi, _, _ in windows:
            cache.own(row, lo, hi)
        if chunks:
            first = cache.append_pending([key for key, *_ in chunks])
            width = max([x.shape[1]] + [hi for *_, hi in chunks])
            pad = torch.nn.functional.pad
            x = torch.cat(
                [pad(x, (0, width - x.shape[1]))] + [pad(t[None], (0, width - len(t))) for _, t, _, _ in chunks]
            )
            for j, (key, _, lo, hi) in enumerate(chunks):
                cache.reserve(first + j, hi)
                cache.own(first + j, lo, hi)
                windows = windows + [(first + j, lo, hi, hi, hi - 1)]
                self.prefill_work.append((key, hi - lo, hi))
        try:
            parts = forward(x, windows, cache)
            self._store_prompts()
            store = self.store if chunks else None
            for j, (_, tokens, lo, hi) in enumerate(chunks if store is not None else ()):
                # exact (a block-causal prompt): stored now, for the rows that share the prefix
                bs = store.block_size
                store.insert(tokens[: hi // bs * bs].tolist(), lo // bs, cache.tables[first + j][lo // bs : hi // bs])
        finally:
            if chunks:
                cache.drop_appended(first)
        return parts[: len(parts) - len(chunks)]

    def _store_prompts(self) -> None:
        """After the forward of rows that just joined (their first, whatever the policy's windows):
        their prompts' blocks that the store lacked."""
        if not self.unstored:
            return
        store = self.store
        for i, (first, tokens) in self.unstored.items():
            store.insert(tokens, first, self.pool.tables[i][first : len(tokens) // store.block_size])
        self.unstored.clear()
