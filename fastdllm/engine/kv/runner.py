"""The one owner of a model's decode K/V: its page pool and the prefix store over it.

`generate`, the server's scheduler, the demo and the evaluation harness each hold a `KVRunner` and
hand it to the decoding loop (`BlockDecoder(kv=...)`); a call that brings none decodes with the
model's default runner (`runner_for`), so that plain `generate` calls share prompts through one
prefix store as a server's requests do. Nothing rides on the model: its layers only read and write
the slots a step hands them.

The runner also runs every decode's forwards (`logits`): the windows a cache policy chose, packed
into one forward over the rows' pages, the same for every policy; DualCache-shaped steps through
CUDA graphs; and the full re-forward a refresh rule's check asks for. `record` keeps every
forward's windows (`history`), the schedule a benchmark can replay on another model.

Budgets are the runner's own: `budget_bytes` (the server's `--kv-cache-memory`) is one pool of that
many bytes, allocated once and handed to each decode in turn with every page free (the server
decodes one batch at a time); without one, a decode's pool grows as its rows need and is kept for
the next decode (as a caching allocator keeps freed memory). `prefix_cache_bytes` (the server's
`--prefix-cache-memory`) bounds the prompt K/V the store keeps.
"""

from __future__ import annotations

import weakref

import torch

from ..registry import CACHE_POLICIES, REFRESH_RULES
from .pages import FixedSlots, PagedKVCache, kv_bytes
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
        self.history: list[list] | None = None  # every forward's windows, once `record` is called

    def record(self) -> KVRunner:
        """Keep every forward's windows in `history` from now on."""
        self.history = []
        return self

    # -- the forwards of a decode (`RowPages` its rows' pages and settings)
    def logits(self, pages, seq, policy, steps: list[int]) -> torch.Tensor:
        """Logits (B, seq.width, V) of every row's current block (and the blocks after it, up to
        the width) at this step: the policy's windows in one packed forward; a row refreshed in
        part whose refresh rule finds its cache stale (`RefreshRule.check`) forwarded again whole,
        its logits replaced; with CUDA graphs, fixed-shape steps replayed."""
        windows = policy.windows(seq, steps)
        partial = policy.partial_refreshes(seq, steps)
        joined = any(k == 0 and b == 0 for k, b in zip(steps, seq.blocks))  # a first forward stores its prompt
        if pages.graphs and not (pages.chunks or joined or seq.canvas) and not (partial and policy.refresh.checks):
            shift = fixed_shift(seq, windows)
            if shift is not None:
                logits = self._graphed(pages, seq, shift)
                if policy.partial_logits:  # the columns a later step's window leaves out keep these
                    pages.latest = logits.clone()
                return logits
        cache = pages.cache_for(seq) if partial else None  # the check reads it; the forward takes its own
        before = policy.refresh.probe(cache, seq, partial) if partial else None
        parts = self.forward(pages, seq, windows)
        stale = policy.refresh.check(cache, seq, partial, before) if partial else []
        if stale:  # a full forward of those rows, replacing their logits and cache
            full = [policy.full_window(seq, i) for i in stale]
            windows, parts = windows + full, parts + self.forward(pages, seq, full)
        return pages.block_logits(seq, windows, parts, policy.partial_logits)

    def forward(self, pages, seq, windows: list) -> list[torch.Tensor]:
        """One packed forward of `windows` over the rows' pages (`RowPages.run`: this step's
        prefill chunks ride in it); per window, the logits from its start column on."""
        pages.work.append([(row, hi - lo, keys) for row, lo, hi, keys, _ in windows])
        if self.history is not None:
            self.history.append(list(windows))

        def packed(x, windows, cache):
            return self.model.packed_logits(
                x,
                windows,
                cache,
                compiled=pages.compiled,
                block_size=seq.block_size or pages.page_size,  # a forward of prefill chunks alone: the decode's
                batch_invariant=pages.batch_invariant,
                embeds=seq.embeds,
                adapters=seq.adapters,
                canvas=seq.canvas,
            )

        return pages.run(seq, windows, packed)

    def _graphed(self, pages, seq, shift: int) -> torch.Tensor:
        """A step of fixed shapes (`fixed_shift`): each row's window (its block, and `shift`
        columns before it) attends over its whole cache row, the keys past what the step sees
        masked rather than cut off, and the windows' columns are a tensor
        (`Transformer.window_logits_static`). The same arithmetic as the eager step over more
        (masked) keys."""
        bsz, capacity, dev = seq.x.shape[0], seq.x.shape[1], seq.x.device
        cache = pages.cache_for(seq)
        width = seq.width + shift
        for i, s in enumerate(seq.starts):
            cache.own(i, s - shift, s + seq.width)
        first = torch.tensor([s - shift for s in seq.starts], device=dev)
        columns = first[:, None] + torch.arange(width, device=dev)
        key_ok = torch.arange(capacity, device=dev)[None, :] < torch.tensor(seq.seen, device=dev)[:, None]
        key_positions = torch.arange(capacity, device=dev).expand(bsz, capacity)
        pages.work.append([(i, width, seq.seen[i]) for i in range(bsz)])
        if self.history is not None:
            self.history.append([(i, s - shift, s + seq.width, seq.seen[i], s) for i, s in enumerate(seq.starts)])
        picks = self.model.logit_columns(0, width, shift)  # as the eager window's (`packed_logits`)
        return self.model.graphed_window_logits()(
            seq.x.gather(1, columns),
            columns,
            columns,
            key_ok,
            key_positions,
            FixedSlots(cache, cache.slot_table(capacity)),
            seq.block_size,
            picks if isinstance(picks, slice) else picks.to(dev),
        )

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

    # -- admission: what requests' rows hold at most, asked before they join a decode
    def shares_prompt_pages(self, config) -> bool:
        """Whether rows decoded under `config` hold the prompt blocks that another row holds by
        reference, and never write into them: a block-causal model's exact prefix cache (a row
        waits for a block another row is computing rather than compute it too: `RowPages.waits`),
        under a cache policy that keeps the prompt and a refresh that never recomputes it, with a
        store that may keep as many pages as the pool holds (so it drops none that rows still
        share)."""
        return (
            self.model.causal_prompt
            and config.prefix_cache != "off"
            and CACHE_POLICIES[config.cache].keeps_prompt
            and not REFRESH_RULES[config.refresh].recomputes_prompt
            and config.refresh_every is None
            and (self.budget_bytes is None or self.prefix_cache_bytes >= self.budget_bytes)
        )

    def pages_held(self, requests) -> int:
        """The pages the rows of `requests` ((config, pages, prompt blocks) each: the pages of a
        block its rows hold at most, and per row the chain keys of its prompt's full blocks) hold
        at most together: each row's own, less the full prompt blocks an earlier row holds where
        they are shared (`shares_prompt_pages`); a row that shares any takes at most one copy of
        one (with shifted logits its first forward writes the column before its answer,
        copy-on-write)."""
        held, seen = 0, set()
        copies = int(bool(self.model.args.shifted_logits))
        for config, pages, prompt_blocks in requests:
            held += pages
            if not self.shares_prompt_pages(config):
                continue
            for keys in prompt_blocks:
                shared = sum(k in seen for k in keys)
                held -= shared - (copies if shared else 0)
                seen.update(keys)
        return held

    def held_bytes(self, requests, page_size: int) -> int:
        """`pages_held` in bytes, for requests counted in pages of `page_size`."""
        return self.pages_held(requests) * page_size * self.page_bytes(1)

    def can_admit(self, requests, page_size: int) -> bool:
        """Whether the rows of `requests` (an iterable, read only where there is a budget; counted
        in pages of `page_size`) fit the pool's budget together (always, without one)."""
        return self.budget_bytes is None or self.held_bytes(requests, page_size) <= self.budget_bytes

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


def fixed_shift(seq, windows: list) -> int | None:
    """Where this step's windows have the fixed-shape step's form, whatever policy chose them: one
    per row, in order, from `shift` columns before the row's block (the same for every row, at
    most one block and one column, and after column 0) to the end of its logits' columns, over
    every key the row sees, the rows of one block length and width; that `shift`, else None.
    DualCache's steps after a block's first have it, and so do the vicinity refresh's block starts
    where nothing past the block is seen (an autoregressive decode's every step)."""
    if len(windows) != len(seq.starts) or len(set(seq.widths)) != 1 or isinstance(seq.block_size, dict):
        return None
    shifts = set()
    for i, (row, lo, hi, keys, start) in enumerate(windows):
        if (row, start, hi, keys) != (i, seq.starts[i], start + seq.widths[i], seq.seen[i]) or lo <= 0:
            return None
        shifts.add(start - lo)
    shift = shifts.pop() if len(shifts) == 1 else None
    return shift if shift is not None and shift <= seq.block_lengths[0] + 1 else None


_DEFAULT: weakref.WeakKeyDictionary[torch.nn.Module, KVRunner] = weakref.WeakKeyDictionary()


def runner_for(model) -> KVRunner:
    """The runner of decodes that bring none (`generate` without `kv=`): one per model, unbounded,
    its prefix store of the default budget."""
    runner = _DEFAULT.get(model)
    if runner is None:
        runner = _DEFAULT[model] = KVRunner(model)
    return runner
