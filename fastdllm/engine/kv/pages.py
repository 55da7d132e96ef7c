"""The rows' K/V in one pool of pages (`PagedKVCache`), read and written by the model's layers
through the slots a step hands them (`PagedLayerKV`, `FixedSlots`). Each owns its writes (as
gpt-fast's `KVCache.update`): a layer's attention hands it the fresh K/V of the window it computed,
the cache writes them in place and returns the K/V to attend over, so nothing is concatenated per
step. Who holds the pool: `kv.runner.KVRunner`."""

from __future__ import annotations

import torch


def kv_bytes(kv_shape: tuple[int, int, int], positions: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values of `positions` positions in every layer, for a model's `kv_shape`
    (layers, K/V heads, head width)."""
    layers, heads, dim = kv_shape
    return 2 * layers * heads * dim * positions * dtype.itemsize


class PagedKVCache:
    """The rows' K/V in one pool of pages, each `page_size` positions (a decoding block) of every
    layer, as vLLM's and SGLang's paged KV caches keep theirs.

    A row owns a page table: its columns [0, n) live in its pages in order, column c in page
    `table[c // page_size]`. Pages are taken when a row needs them and returned when it leaves, so
    the pool holds what the rows use, not rows times the longest row, and rows that join or leave
    move nothing: only page tables change. A row's pages are taken as one run where the pool has
    one free, so its keys are one slice of the pool (read in place); otherwise its runs of
    consecutive pages are read in place and joined.

    Pages are shared by reference, as vLLM's and SGLang's are: each page counts its holders (row
    tables, prompts being prefilled, the prefix store in `prefix`), and returns to the pool when
    the last lets go. A prefix-cache hit puts the store's pages in the row's table; before a
    forward writes columns of a page another holder shares, the row takes a copy of it
    (copy-on-write, `own`), so that nothing a row writes changes another row's keys. Pages only
    the store holds are cached, not in use: a pool that runs out evicts them (least recently used
    first) before it grows or fails.

    A pool that is `growable` doubles when it runs out of pages (its tensors reallocated); a
    pool under a budget is allocated once and never grows (`KVRunner.pool`): the server admits
    rows only while their pages fit (`server.scheduler`). The cache owns its writes
    (`PagedLayerKV.write`: every packed row's K/V of a layer in one copy)."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        page_size: int,
        pages: int = 0,
        *,
        dtype,
        device,
        growable: bool = True,
    ):
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1 (got {page_size})")
        self.page_size, self.growable = page_size, growable
        with torch.inference_mode(False):  # a pool serves decodes in and out of inference mode
            # one slot past the pages: where a fixed-shape step writes its padding's K/V (`scratch`)
            self.k = torch.zeros((n_layers, n_kv_heads, pages * page_size + 1, head_dim), dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
        self.free: set[int] = set(range(pages))
        self.refs: dict[int, int] = {}  # page -> its holders (row tables, pending prompts, the store)
        self.stored: set[int] = set()  # the pages the prefix store holds
        self.cached_pages = 0  # of those, the pages no one else holds (evictable), counted as refs change
        self.prefix = None  # the prefix store whose blocks are pages of this pool (`kv.prefix.PrefixStore`)
        self.tables: list[list[int]] = []
        # pages of prompts being prefilled before their rows join the layout (key -> page table)
        self.pending: dict[int, list[int]] = {}
        self._spans: list = []  # per row: its runs of consecutive pages (`_runs`), None: not yet known
        self.peak_pages = 0

    @classmethod
    def for_rows(cls, model, rows: int, columns: int) -> PagedKVCache:
        """A pool of `rows` rows of `columns` columns each, every row one run of pages, laid out:
        the cache of a forward outside the decoding loop (a benchmark's replay, a test)."""
        pool = cls(*model.kv_shape, columns, rows, dtype=model.dtype, device=model.device, growable=False)
        pool.set_rows([None] * rows, [columns] * rows)
        return pool

    @property
    def pages(self) -> int:
        return (self.k.shape[2] - 1) // self.page_size

    @property
    def scratch(self) -> int:
        """The slot past every page: no row's column, never read unmasked; a fixed-shape step
        writes the K/V of its windows' padding there (`slot_table`)."""
        return self.k.shape[2] - 1

    @property
    def pages_in_use(self) -> int:
        """Pages rows hold (prompts being prefilled included); those only the prefix store holds
        are cached, not in use (vLLM counts its cached blocks as free)."""
        return self.pages - len(self.free) - self.cached_pages

    @property
    def page_bytes(self) -> int:
        """One page of keys and values in every layer (from the shape: also while no page is held)."""
        layers, heads, _, dim = self.k.shape
        return kv_bytes((layers, heads, dim), self.page_size, self.k.dtype)

    def layer(self, i: int) -> PagedLayerKV:
        return PagedLayerKV(self, i)

    # -- page tables
    def set_rows(
        self, sources: list[int | None], columns: list[int | None] | None = None, adopt: dict | None = None
    ) -> None:
        """The rows were laid out again: new row i is old row `sources[i]` (its pages move with it,
        nothing is copied), or a new row (None) that takes the pending pages `adopt[i]` names (a
        prompt prefilled before it joined), and pages for `columns[i]` columns, as one run where
        it can. The pages of old rows left out return to the pool."""
        adopt, taken = adopt or {}, set()
        tables = []
        for i, s in enumerate(sources):
            if s is None:
                tables.append(self.pending.pop(adopt[i]) if i in adopt else [])
            else:
                tables.append(list(self.tables[s]))
                if s in taken:  # a second row from the same one holds its pages too
                    self.hold(tables[-1])
                taken.add(s)
        for j, table in enumerate(self.tables):
            if j not in taken:
                self.drop(table)
        self.tables = tables
        self._spans = [None] * len(sources)
        if columns is not None:
            for i, s in enumerate(sources):
                if s is None and columns[i] is not None:
                    self.reserve(i, columns[i])

    def reset(self) -> None:
        """No rows, nothing pending (and the peak counted afresh): every page free but those the
        prefix store keeps."""
        self.set_rows([])
        for key in list(self.pending):
            self.release(key)
        self.peak_pages = 0

    # -- prompts prefilled before their rows join (chunked prefill)
    def start_pending(self, key: int) -> None:
        self.pending[key] = []

    def release(self, key: int) -> None:
        """A pending prompt's pages back to the pool (its row was dropped)."""
        self.drop(self.pending.pop(key, []))

    def append_pending(self, keys: list[int]) -> int:
        """Lay the pending prompts `keys` out after the rows, for one forward (their pages reserved
        and written as a row's are); returns the first one's row index. `drop_appended` undoes it."""
        first = len(self.tables)
        self.tables.extend(self.pending[k] for k in keys)  # the same lists: what they reserve stays pending
        self._spans.extend([None] * len(keys))
        return first

    def drop_appended(self, first: int) -> None:
        del self.tables[first:], self._spans[first:]

    def reserve(self, row: int, columns: int) -> None:
        """Pages for row `row`'s columns [0, columns): those it lacks are taken, after its last page
        where that one is free."""
        table, need = self.tables[row], -(-columns // self.page_size) - len(self.tables[row])
        if need <= 0:
            return
        table.extend(self._take(need, table[-1] + 1 if table else None))
        self._spans[row] = None
        self.peak_pages = max(self.peak_pages, self.pages_in_use)

    # -- holders of pages
    def _cached(self, p: int) -> bool:
        return p in self.stored and self.refs.get(p) == 1

    def hold(self, pages: list[int], stored: bool = False) -> None:
        """Hold `pages` once more (`stored`: the prefix store is the holder)."""
        for p in pages:
            was = self._cached(p)
            self.refs[p] += 1
            if stored:
                self.stored.add(p)
            self.cached_pages += self._cached(p) - was

    def drop(self, pages: list[int], stored: bool = False) -> None:
        """Let go of `pages` (`stored`: the prefix store lets go): each returns to the pool when its
        last holder lets go."""
        for p in pages:
            was = self._cached(p)
            self.refs[p] -= 1
            if stored:
                self.stored.discard(p)
            if not self.refs[p]:
                del self.refs[p]
                self.free.add(p)
            self.cached_pages += self._cached(p) - was

    def share(self, row: int, pages: list[int]) -> None:
        """Row `row`'s first columns are the pages `pages` (the prefix store's), held by reference;
        the pages it held there return to the pool."""
        table = self.tables[row]
        self.hold(pages)
        self.drop(table[: len(pages)])
        table[: len(pages)] = pages
        self._spans[row] = None

    def own(self, row: int, lo: int, hi: int) -> None:
        """Before row `row`'s columns [lo, hi) are written: each of their pages that another holder
        shares is replaced by a copy of it that the row alone holds (copy-on-write)."""
        table, p = self.tables[row], self.page_size
        shared = [j for j in range(lo // p, min(-(-hi // p), len(table))) if self.refs[table[j]] > 1]
        if not shared:
            return
        for j in shared:  # eviction for a new page takes only pages no row holds: never these
            old = table[j]
            new = self._take(1, None)[0]
            self.k[:, :, new * p : (new + 1) * p] = self.k[:, :, old * p : (old + 1) * p]
            self.v[:, :, new * p : (new + 1) * p] = self.v[:, :, old * p : (old + 1) * p]
            table[j] = new
            self.drop([old])
        self._spans[row] = None
        self.peak_pages = max(self.peak_pages, self.pages_in_use)

    def _make_free(self, n: int) -> None:
        """At least `n` free pages: a pool that cannot grow evicts what only the prefix store holds
        (least recently used first), then one that can grows."""
        if len(self.free) < n and not self.growable and self.prefix is not None:
            self.prefix.evict(n - len(self.free))
        if len(self.free) < n:
            self._grow(n - len(self.free))

    def _take(self, n: int, after: int | None) -> list[int]:
        self._make_free(n)
        free = sorted(self.free)
        start = None
        if after is not None and all(p in self.free for p in range(after, after + n)):
            start = after
        else:  # the first run of n free pages
            run = 0
            for j, p in enumerate(free):
                run = run + 1 if j and p == free[j - 1] + 1 else 1
                if run == n:
                    start = p - n + 1
                    break
        taken = list(range(start, start + n)) if start is not None else free[:n]
        self.free.difference_update(taken)
        self.refs.update(dict.fromkeys(taken, 1))
        return taken

    def _grow(self, pages: int) -> None:
        if not self.growable:
            raise RuntimeError(
                f"the K/V pool is full: {pages} more pages of {self.page_size} positions needed, "
                f"{self.pages} held in all (the server admits rows only while theirs fit)"
            )
        old = self.pages
        new = max(old + pages, 2 * old)
        held = old * self.page_size
        with torch.inference_mode(False):
            k = self.k.new_zeros(self.k.shape[:2] + (new * self.page_size + 1,) + self.k.shape[3:])
            v = torch.zeros_like(k)
            k[:, :, :held] = self.k[:, :, :held]
            v[:, :, :held] = self.v[:, :, :held]
        self.k, self.v = k, v
        self.free.update(range(old, new))

    def _runs(self, row: int) -> list[tuple[int, int, int]]:
        """Row `row`'s runs of consecutive pages: (first column, end column, first slot)."""
        runs = self._spans[row]
        if runs is None:
            table, p, runs, j = self.tables[row], self.page_size, [], 0
            while j < len(table):
                k = j
                while k + 1 < len(table) and table[k + 1] == table[k] + 1:
                    k += 1
                runs.append((j * p, (k + 1) * p, table[j] * p))
                j = k + 1
            self._spans[row] = runs
        return runs

    def slices(self, row: int, lo: int, hi: int) -> list[slice]:
        """The pool slots of row `row`'s columns [lo, hi), a slice per run of consecutive pages (one
        where its pages are one run: a view of the pool, nothing gathered)."""
        if hi > len(self.tables[row]) * self.page_size:
            raise IndexError(f"row {row} holds {len(self.tables[row])} pages, not columns up to {hi}")
        out = []
        for first, end, slot in self._runs(row):
            a, b = max(lo, first), min(hi, end)
            if a < b:
                out.append(slice(slot + a - first, slot + b - first))
        return out

    def span(self, row: int, lo: int, hi: int):
        """The pool slots of row `row`'s columns [lo, hi): a slice where they lie in one run of
        pages, else an index tensor."""
        parts = self.slices(row, lo, hi)
        if len(parts) <= 1:
            return parts[0] if parts else slice(0, 0)
        return torch.cat([torch.arange(s.start, s.stop, device=self.k.device) for s in parts])

    def slot_ids(self, row: int, lo: int, hi: int) -> list[int]:
        """The pool slots of row `row`'s columns [lo, hi), as host ints."""
        return [i for s in self.slices(row, lo, hi) for i in range(s.start, s.stop)]

    def write_slots(self, spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """The pool slots of the columns [lo, hi) of each (row, lo, hi), one after another: where a
        forward that packs those rows' windows writes their K/V, one copy per layer for them all
        (`PagedLayerKV.write`). Made on the host and sent in one copy."""
        slots = [i for row, lo, hi in spans for i in self.slot_ids(row, lo, hi)]
        return torch.tensor(slots, dtype=torch.long, device=self.k.device)

    def key_slots(self, rows: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
        """(len(rows), most) the pool slots of the columns [0, keys) of each (row, keys), padded with
        slot 0 (keys a caller masks), and each one's count: made on the host and sent in one copy."""
        most = max((keys for _, keys in rows), default=0)
        table = [self.slot_ids(row, 0, keys) + [0] * (most - keys) for row, keys in rows]
        return torch.tensor(table, dtype=torch.long, device=self.k.device).view(len(rows), most), [k for _, k in rows]

    def read(self, row: int, lo: int, hi: int, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s K/V of columns [lo, hi): (layers, kv_heads, hi - lo, head_dim), or one
        layer's (kv_heads, hi - lo, head_dim)."""
        where = self.span(row, lo, hi)
        k, v = (self.k, self.v) if layer is None else (self.k[layer], self.v[layer])
        return k[..., where, :], v[..., where, :]

    def slot_table(self, columns: int) -> torch.Tensor:
        """(rows, columns + 1) the pool slot of every row's columns [0, columns) (slot 0 past a row's
        pages: keys a fixed-shape step masks), then the `scratch` slot: the column a fixed-shape
        step writes its padding at (`PagedLayerKV.update`)."""
        held = [min(columns, len(table) * self.page_size) for table in self.tables]
        table, _ = self.key_slots(list(enumerate(held)))
        table = torch.nn.functional.pad(table, (0, columns - table.shape[1]))
        return torch.nn.functional.pad(table, (0, 1), value=self.scratch)


class PagedLayerKV:
    """One layer of a PagedKVCache."""

    __slots__ = ("cache", "k", "v", "slots")

    def __init__(self, cache: PagedKVCache, i: int, slots: torch.Tensor | None = None):
        self.cache, self.k, self.v, self.slots = cache, cache.k[i], cache.v[i], slots

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every packed row's K/V (1, heads, N, head_dim) into the pool at `slots` (N,: `write_slots`),
        in one copy each: a row writes only pages it owns (copy-on-write), so writing every row
        before any attends reads what writing each row before it attends reads."""
        self.k.index_copy_(1, slots, k[0])
        self.v.index_copy_(1, slots, v[0])

    def keys(self, row: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s K/V of columns [0, keys) (1, heads, keys, head_dim): views of the pool where
        its pages are one run, else its runs joined (a shared prefix's run, then its own)."""
        runs = self.cache.slices(row, 0, keys)
        if len(runs) == 1:
            return self.k[:, runs[0]][None], self.v[:, runs[0]][None]
        return torch.cat([self.k[:, r] for r in runs], 1)[None], torch.cat([self.v[:, r] for r in runs], 1)[None]

    def update(self, columns: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape step's write and read (`LayerKV.update` with (B, T) `columns`): each
        row's window written at its `columns` through `slots` (B, S + 1: `PagedKVCache.slot_table`;
        column S, the scratch slot, for padding), the rows' keys of their S columns returned
        (B, heads, S, head_dim)."""
        where = self.slots.gather(1, columns).flatten()
        heads, dim = k.shape[1], k.shape[3]
        self.k.index_copy_(1, where, k.transpose(0, 1).reshape(heads, -1, dim))
        self.v.index_copy_(1, where, v.transpose(0, 1).reshape(heads, -1, dim))
        keys = self.slots[:, :-1]
        bsz, s = keys.shape
        return tuple(t[:, keys.flatten()].view(heads, bsz, s, dim).transpose(0, 1) for t in (self.k, self.v))


class FixedSlots:
    """A PagedKVCache read through a (rows, columns) slot table (`PagedKVCache.slot_table`): the
    cache of a step whose shapes are fixed for a layout (`Transformer.window_logits_static`)."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots
        self.k, self.v = cache.k, cache.v

    def layer(self, i: int) -> PagedLayerKV:
        return PagedLayerKV(self.cache, i, self.slots)
