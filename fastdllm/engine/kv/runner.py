"""The one owner of a model's decode K/V: its page pool and the prefix store over it.

`generate`, the server's scheduler, the demo and the evaluation harness each hold a `KVRunner` and
hand it to the decoding loop (`BlockDecoder(kv=...)`); a call that brings none decodes with the
model's default runner (`runner_for`), so that plain `generate` calls share prompts through one
prefix store as a server's requests do. Nothing rides on the model: its layers only read and write
the slots a step hands them.

The runner also runs every decode's forwards (`logits`): the windows a cache policy chose, packed
into one forward over the rows' pages, the same for every policy; with CUDA graphs, any step of
at most one window per row in fixed shapes (`FixedForm`, in parts where its windows' widths part);
and the full re-forward a refresh rule's check asks for. `record` keeps every
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

from ...models.transformer import placed_vectors
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
        if pages.graphs and not (pages.chunks or joined) and not (partial and policy.refresh.checks):
            forms = FixedForm.parts(self.model, seq, windows)
            if forms is not None:
                return pages.block_logits(seq, windows, self.forward(pages, seq, windows, forms), policy.partial_logits)
        cache = pages.cache_for(seq) if partial else None  # the check reads it; the forward takes its own
        before = policy.refresh.probe(cache, seq, partial) if partial else None
        parts = self.forward(pages, seq, windows)
        stale = policy.refresh.check(cache, seq, partial, before) if partial else []
        if stale:  # a full forward of those rows, replacing their logits and cache
            full = [policy.full_window(seq, i) for i in stale]
            windows, parts = windows + full, parts + self.forward(pages, seq, full)
        return pages.block_logits(seq, windows, parts, policy.partial_logits)

    def forward(self, pages, seq, windows: list, forms: list[FixedForm] | None = None) -> list[torch.Tensor]:
        """One packed forward of `windows` over the rows' pages (`RowPages.run`: this step's
        prefill chunks ride in it), or with `forms` the fixed-shape steps that compute them (a
        CUDA graph each on a GPU); per window, the logits from its start column on."""
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

        def fixed(x, windows, cache):
            # rows of other block lengths share a step only where the masks read none (`fits_fixed_form`)
            block_size = None if isinstance(seq.block_size, dict) else seq.block_size
            by_row = {}
            for form in forms:
                logits = self.model.graphed_window_logits()(*form.inputs(x, cache, block_size))
                by_row.update((w[0], logits[i, :n]) for i, (w, n) in enumerate(zip(form.windows, form.logits)))
            return [by_row[row] for row, *_ in windows]

        return pages.run(seq, windows, packed if forms is None else fixed)

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


# The shapes a fixed-shape step is padded to, so that a server's ever-changing batches replay a
# few captured graphs: rows in vLLM's capture sizes, keys in multiples of KEY_BUCKET.
ROW_BUCKETS = (1, 2, 4, *range(8, 513, 8))
KEY_BUCKET = 128
# A step whose windows, padded to one width, would compute more than this many times their own
# columns stays eager: a graph saves launches, not arithmetic.
PADDING = 2


class FixedForm:
    """A step's windows in the fixed shapes a CUDA graph replays, whatever policy chose them: one
    window per row, in order, each `width` columns from its first (the rows' block and its shift,
    or the widest window's rounded up to a power of two blocks), attending over its cache row's
    keys with those past what it sees masked; rows padded to a bucket of `ROW_BUCKETS` and keys to
    whole `KEY_BUCKET`s, so that a few shapes serve every step of every batch. Windows that padding
    would more than double (`PADDING`: a long one among short ones) are no fixed form. A window's
    padding past its own end computes at its last column's position, and a padding row at column
    0 seeing key 0; both write their K/V to the pool's scratch slot (`PagedKVCache.slot_table`),
    and their logits are dropped: the same arithmetic as the eager step for every real column,
    over more (masked) keys. `keys`: the keys' bucket; `logits`: per row, how many of its logits
    the loop reads (from its window's start, within the step's width)."""

    def __init__(
        self, windows: list, width: int, keys: int, picks: list[list[int]], most: int, spans: list, embeds=None
    ):
        self.windows, self.width, self.keys, self.picks, self.most, self.spans = (
            windows,
            width,
            keys,
            picks,
            most,
            spans,
        )
        self.embeds = embeds  # {row: (columns, vectors)}: input vectors (`SequenceView.embeds`)
        self.logits = [len(p) for p in picks]

    @classmethod
    def of(cls, model, seq, windows: list) -> FixedForm | None:
        """The fixed form of `windows` (at most one per row, in the rows' order; a row without one
        is left out of the step), or None where the model's rule or `PADDING` says no."""
        if not cls.takes(model, seq, windows):
            return None
        keys = cls.key_bucket(seq)
        width = cls.padded_width(seq, [hi - lo for _, lo, hi, _, _ in windows], keys)
        return None if width is None else cls.built(model, seq, windows, width, keys)

    @classmethod
    def parts(cls, model, seq, windows: list) -> list[FixedForm] | None:
        """The step as few fixed forms as its windows need: one, or where padding them to one
        width would more than double them (rows far apart in their blocks: a row's block start,
        its window to the row's end, among rows inside their blocks), groups of windows of near
        widths, narrowest first, each its own fixed-shape step (a graph each on a GPU, where
        the eager step would launch every kernel). None where no fixed form takes them."""
        whole = cls.of(model, seq, windows)
        if whole is not None:
            return [whole]
        if not cls.takes(model, seq, windows):
            return None
        keys, groups = cls.key_bucket(seq), []  # (windows, width) each
        for w in sorted(windows, key=lambda w: w[2] - w[1]):
            if groups:
                joined = groups[-1][0] + [w]
                width = cls.padded_width(seq, [hi - lo for _, lo, hi, _, _ in joined], keys)
                if width is not None:
                    groups[-1] = (joined, width)
                    continue
            width = cls.padded_width(seq, [w[2] - w[1]], keys)
            if width is None:  # a window no padding fits even alone
                return None
            groups.append(([w], width))
        return [cls.built(model, seq, sorted(group), width, keys) for group, width in groups]

    @staticmethod
    def takes(model, seq, windows: list) -> bool:
        """Whether the model's rules let these windows take fixed shapes: at most one per row, in
        the rows' order; no decoder's choice of how a window attends on a model with one way; and
        the model's own rule (`fits_fixed_form`)."""
        rows = [row for row, *_ in windows]
        if not rows or rows != sorted(set(rows)):
            return False
        if seq.canvas and not model.two_passes:  # the eager step says why
            return False
        return model.fits_fixed_form(seq, windows)

    @staticmethod
    def key_bucket(seq) -> int:
        """The keys every row attends over: the layout's columns in whole `KEY_BUCKET`s."""
        return -(-seq.x.shape[1] // KEY_BUCKET) * KEY_BUCKET

    @staticmethod
    def padded_width(seq, lengths: list[int], keys: int) -> int | None:
        """The width windows of these lengths take: their own where they are one length and no
        wider than the rows' logits and a shift, else the widest rounded up to a power of two
        blocks; None where padding would more than double their columns (`PADDING`)."""
        width = max(lengths)
        if len(set(lengths)) == 1 and width <= seq.width + 1:  # a step of the blocks alone
            return width
        bucket = min(seq.block_lengths)
        while bucket < width:
            bucket *= 2
        width = max(width, min(bucket, keys))
        return None if len(lengths) * width > PADDING * sum(lengths) else width

    @classmethod
    def built(cls, model, seq, windows: list, width: int, keys: int) -> FixedForm:
        """The form of windows that `takes` and `padded_width` admitted: which of each window's
        columns give its logits, as the eager step's (`logit_columns`), and how each row's window
        attends where its decoder chooses (-1: the model's own rule)."""
        canvas, picks = seq.canvas or {}, []
        for row, lo, hi, _, start in windows:
            columns = model.logit_columns(lo, hi, start, canvas.get(row))
            columns = list(range(columns.start, columns.stop)) if isinstance(columns, slice) else columns.tolist()
            picks.append(columns[: seq.width - (start - seq.starts[row])])
        spans = [canvas.get(row, -1) for row, *_ in windows]
        return cls(windows, width, keys, picks, max(seq.width, 1), spans, seq.embeds)

    def inputs(self, x: torch.Tensor, cache, block_size) -> tuple:
        """`Transformer.window_logits_static`'s arguments for these windows of the layout `x`
        over the pool `cache`: the index tables made on the host and sent in one copy. The step's
        rows are the windows' (the layout's rows without one left out)."""
        bsz, width, most, capacity = len(self.windows), self.width, self.most, self.keys
        rows = next((b for b in ROW_BUCKETS if b >= bsz), bsz)
        pad = rows - bsz
        positions, columns, keep = [], [], []
        for (_, lo, hi, _, _), picks in zip(self.windows, self.picks):
            real = list(range(lo, hi))
            positions += real + [hi - 1] * (width - len(real))
            columns += real + [capacity] * (width - len(real))  # the slot table's scratch column
            keep += picks + (picks[-1:] or [0]) * (most - len(picks))
        positions += [0] * (pad * width)
        columns += [capacity] * (pad * width)
        keep += [0] * (pad * most)
        keys = [seen for _, _, _, seen, _ in self.windows] + [1] * pad
        starts = [start for *_, start in self.windows] + [0] * pad
        spans = self.spans + [-1] * pad
        taken = [row for row, *_ in self.windows]  # the layout's rows the step computes
        tables = torch.tensor(positions + columns + keep + keys + starts + spans + taken, device=x.device)
        # each its own tensor: views at offsets would be guarded on them (a graph per offset)
        tables = [t.clone() for t in tables.split([rows * width] * 2 + [rows * most, rows, rows, rows, bsz])]
        positions, columns, keep, keys, starts, spans, taken = tables
        positions, columns = positions.view(rows, width), columns.view(rows, width)
        ahead = torch.arange(capacity, device=x.device)[None]  # every row's key positions
        slots = cache.slot_table(capacity)
        if bsz < x.shape[0]:
            x, slots = x[taken], slots[taken]
        slots = torch.nn.functional.pad(slots, (0, 0, 0, pad), value=cache.scratch)
        return (
            torch.nn.functional.pad(x, (0, 0, 0, pad)).gather(1, positions),
            positions,
            columns,
            ahead < keys[:, None],
            ahead,
            FixedSlots(cache, slots),
            block_size,
            keep.view(rows, most),
            starts,
            spans,
            self.given(rows),
        )

    def given(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' input vectors at their windows' columns (rows, width, dim) and which columns
        take them (rows, width) (`placed_vectors`)."""
        places = {row: (i * self.width, lo, hi) for i, (row, lo, hi, _, _) in enumerate(self.windows)}
        given = placed_vectors(self.embeds, places, rows * self.width)
        return None if given is None else (given[0].view(rows, self.width, -1), given[1].view(rows, self.width))


_DEFAULT: weakref.WeakKeyDictionary[torch.nn.Module, KVRunner] = weakref.WeakKeyDictionary()


def runner_for(model) -> KVRunner:
    """The runner of decodes that bring none (`generate` without `kv=`): one per model, unbounded,
    its prefix store of the default budget."""
    runner = _DEFAULT.get(model)
    if runner is None:
        runner = _DEFAULT[model] = KVRunner(model)
    return runner
