"""Cache policies: which part of each row each decoding step recomputes.

Every policy answers one question for the generation loop: "give me the logits of every row's
current block at this step". They differ only in the window they recompute of each row, and all
rows' windows go into one packed forward (`Transformer.packed_logits`): no padding, each row
attending over its own keys:

- `NoCache`: the whole sequence at every step (LLaDA's baseline).
- `PrefixCache`: at a block's first step a full forward fills the cache (and decodes); later steps
  recompute [block start, end of sequence) against the cached prefix (Fast-dLLM prefix cache).
- `DualCache`: the same, but later steps recompute only the block, against the cached prefix *and*
  the cached masked suffix (Fast-dLLM DualCache).
- `SubBlockCache`: DualCache, and with sub-blocks, later steps of a sub-block recompute only that
  sub-block against the cached block (Fast-dLLM v2's block cache).
- `DelayedCache`: a committed prefix that takes a finished block only `cache_delay` forwards after
  it finished, full forwards while one waits (d3LLM's KV cache for decoding several blocks at once).

Rows are on their own clocks: in one step some rows are at their block's first step and others in
the middle of theirs; each gets its own window in the same forward. The cache is refreshed when a
row's new block starts, i.e. when its previous one completed. How much a block-start forward
recomputes is the policy's refresh rule (a `RefreshRule`, named in `REFRESH_RULES`):
- "full" (Fast-dLLM): the whole sequence;
- "vicinity" (after dInfer's vicinity refresh): only from the just-finished block (blocks, when
  multi-block decoding finished more than one since the last block start) to the end
  (its tokens just became final, and the current block and what follows it see them), against
  the cached K/V of everything before it; the prompt's K/V are computed once per generation, at
  the first block. `refresh_every` N adds a full refresh every N blocks (1: every block, which is
  "full"). A row that joins gets a full forward at its first block;
- "adaptive": the vicinity refresh, then a test of whether it sufficed. The current block's
  positions are all still masked, so their tokens did not change since their keys were cached:
  any change of their last-layer keys, cached against recomputed now, is the effect of the
  just-finished block's tokens through attention, the same effect that leaves the older prefix's
  cached K/V stale. A row whose relative change exceeds `refresh_tol` gets a full forward at once
  (its logits and cache replaced). The test is per row, so a row decodes the same in a batch as
  alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv.pages import FixedSlots, PagedKVCache
from .kv.rows import RowPages, Window
from .registry import CACHE_POLICIES, REFRESH_RULES


@dataclass
class SequenceView:
    """What a policy needs about the rows being decoded: the layout `x` (B, L), where row i holds
    its prompt and answer region from column 0 on (a column's RoPE position is its index), and
    per row its current block's first column (`starts`), how far its forwards see (`seen`: its
    keys are the columns [0, seen), a suffix window's cut), its block's index and how many blocks
    before it became final since its last block-start forward (`refreshes`: more than one when
    multi-block decoding revealed a block whole before it was current). Every row's logits cover
    `width` columns from its start: its block, and with multi-block decoding those after it."""

    x: torch.Tensor
    starts: tuple[int, ...]
    seen: tuple[int, ...]
    blocks: tuple[int, ...]
    block_length: int
    width: int
    refreshes: tuple[int, ...] = ()
    # per row: its prompt's leading columns whose K/V the prefix store gave it when it joined
    # (its first full forward starts after them)
    reused: tuple[int, ...] = ()
    # per row: input vectors that replace some columns' token embeddings in every forward of this
    # step ({row: (columns, vectors)}; DMax's soft embeddings, `Transformer.packed_logits`)
    embeds: dict | None = None
    # per row that decodes with a LoRA adapter, its index (`Transformer.lora`); other rows: the base
    adapters: dict | None = None

    def refresh(self, i: int) -> int:
        return self.refreshes[i] if self.refreshes else 1

    def end(self, i: int) -> int:
        """The last column (exclusive) a forward of row i must compute: what it sees, and at least
        its logits' columns (past its region: padding, whose logits nothing reads)."""
        return max(self.seen[i], self.starts[i] + self.width)


class CachePolicy:
    """Answers "every row's block logits at this step" by one packed forward over a window of each
    row. `forward` runs one and records its work in `work`: per forward, (row, query positions,
    key positions) for each row it computed, which the loop charges to those rows (`take_work`)."""

    name = "none"
    # Whether a row's block-start forward refreshes its cache (the step where Fast-dLLM's cached
    # Dream loops reveal the block's first position: `policies.policies_for`).
    refreshes_at_block_start = True
    # Whether a row's forwards after its first read its prompt's K/V from the cache, so that a
    # prompt computed before the row joins is worth computing (chunked prefill, `BlockDecoder`).
    keeps_prompt = False
    # Whether a forward reads keys an earlier forward wrote: the rows' pages are a cache (counted
    # in `RunStats.kv_cache_bytes`, and prompts shared through the prefix store), not one
    # forward's working memory.
    holds_cache = True

    def __init__(self, model, compiled: bool = False):
        self.model = model
        self.compiled = compiled  # forwards through the model's torch.compile'd layers
        # each row's logits exactly as computed alone, whatever the batch (`models.invariance`)
        self.batch_invariant = False
        # DualCache's steps after a block's first through fixed shapes, captured as CUDA graphs
        # (`PrefixCache._graphed_step`)
        self.graphs = False
        self.work: list[list[tuple[int, int, int]]] = []
        self.history: list[list[Window]] | None = None  # set to [] to record windows
        # the rows' pages (`kv.rows.RowPages`), given by the loop that decodes with this policy
        self.pages: RowPages | None = None

    @classmethod
    def from_config(cls, model, config) -> CachePolicy:
        return cls(model, compiled=config.compile)

    def record(self) -> CachePolicy:
        """Record every forward's windows in `history`: the schedule a benchmark can replay on
        another model."""
        self.history = []
        return self

    def take_work(self) -> list[list[tuple[int, int, int]]]:
        work, self.work = self.work, []
        return work

    def block_logits(self, seq: SequenceView, steps: list[int]) -> torch.Tensor:
        """Logits (B, seq.width, V) of every row's current block (and the blocks after it, up to
        the width), where row i has taken `steps[i]` steps in its block (0: the block begins)."""
        raise NotImplementedError

    def relayout(self, sources: list[int | None]) -> None:
        """The loop laid its rows out again: new row i is old row `sources[i]` (None: a row that
        just joined). A policy with state per row moves it here; the rows' pages move by
        themselves (`RowPages.relayout`)."""

    def prefill_only(self) -> None:
        """A forward of the queued prefill chunks alone (no row is decoding)."""
        empty = torch.zeros((0, 0), dtype=torch.long, device=self.model.device)
        self.forward(SequenceView(empty, (), (), (), self.pages.page_size, 0), [])

    def forward(self, seq: SequenceView, windows: list[Window]) -> list[torch.Tensor]:
        """One packed forward of `windows` over the rows' pages (`RowPages.run`: this step's
        prefill chunks ride in it); per window, the logits from its start column on."""
        self.work.append([(row, hi - lo, keys) for row, lo, hi, keys, _ in windows])
        if self.history is not None:
            self.history.append(list(windows))

        def packed(x, windows, cache):
            return self.model.packed_logits(
                x,
                windows,
                cache,
                compiled=self.compiled,
                block_size=seq.block_length or None,
                batch_invariant=self.batch_invariant,
                embeds=seq.embeds,
                adapters=seq.adapters,
            )

        return self.pages.run(seq, windows, packed)

    def full_window(self, seq: SequenceView, i: int) -> Window:
        """The whole row; at its first block, after what the prefix store gave it (as far as the
        first logit's column allows)."""
        lo = 0
        if seq.reused and seq.blocks[i] == 0:
            lo = min(seq.reused[i], seq.starts[i] - int(self.model.args.shifted_logits))
        return (i, max(0, lo), seq.end(i), seq.seen[i], seq.starts[i])

    @staticmethod
    def stack(seq: SequenceView, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-row logits (each `seq.width` wide) as one (B, width, V) tensor."""
        return torch.stack([p[: seq.width] for p in parts])


@CACHE_POLICIES.register
class NoCache(CachePolicy):
    name = "none"
    refreshes_at_block_start = False
    holds_cache = False  # every key a row reads is one its own window writes

    def block_logits(self, seq, steps):
        return self.stack(seq, self.forward(seq, [self.full_window(seq, i) for i in range(len(steps))]))


# ---- refresh rules: what a block-start forward recomputes --------------------------------------
class RefreshRule:
    """How a caching policy's block-start forward refreshes a row's cache. `needs_full(block)`:
    whether a row at `block` recomputes its whole sequence; the other rows recompute from
    `first_column` on, against their cached K/V. `check` may then ask for full forwards of some
    of those rows (their cache did not suffice)."""

    name = ""

    def __init__(self, every: int | None = None, tol: float = 0.1):
        self.every, self.tol = every, tol

    @classmethod
    def from_config(cls, config) -> RefreshRule:
        return cls(every=config.refresh_every, tol=config.refresh_tol)

    def needs_full(self, block: int) -> bool:
        raise NotImplementedError

    def first_column(self, seq: SequenceView, i: int) -> int:
        raise NotImplementedError

    def probe(self, cache: PagedKVCache, seq: SequenceView, rows: list[int]):
        """What `check` compares against, read before the forward."""
        return None

    def check(self, cache: PagedKVCache, seq: SequenceView, rows: list[int], before) -> list[int]:
        """The rows (of `rows`, refreshed partially) that need a full forward now."""
        return []


@REFRESH_RULES.register
class FullRefresh(RefreshRule):
    """Fast-dLLM: every block-start forward recomputes the whole sequence."""

    name = "full"

    def needs_full(self, block):
        return True


@REFRESH_RULES.register
class VicinityRefresh(RefreshRule):
    """After dInfer: from the just-finished block to the end, against the cached K/V of the older
    prefix; the whole sequence at a row's first block (nothing is cached yet) and every `every`
    blocks."""

    name = "vicinity"

    def needs_full(self, block):
        return block == 0 or bool(self.every and block % self.every == 0)

    def first_column(self, seq, i):
        return max(0, seq.starts[i] - seq.refresh(i) * seq.block_length)


@REFRESH_RULES.register
class AdaptiveRefresh(VicinityRefresh):
    """The vicinity refresh, then a per-row test of whether it sufficed (see the module
    docstring): a row whose current block's last-layer keys moved by more than `tol` (relative)
    gets a full forward at once."""

    name = "adaptive"

    def _keys(self, cache, seq, rows):
        blk = seq.block_length
        return [cache.read(i, seq.starts[i], seq.starts[i] + blk, layer=-1)[0].float() for i in rows]

    def probe(self, cache, seq, rows):
        return [k.clone() for k in self._keys(cache, seq, rows)]

    def check(self, cache, seq, rows, before):
        after = self._keys(cache, seq, rows)
        drift = [float((a - b).norm() / b.norm().clamp_min(1e-12)) if b.numel() else 0.0 for a, b in zip(after, before)]
        return [i for i, d in zip(rows, drift) if d > self.tol]


def register_refresh_rule(cls: type[RefreshRule]) -> type[RefreshRule]:
    """Make `cls` a refresh rule that configs name by `cls.name` (usable as a class decorator)."""
    return REFRESH_RULES.register(cls)


def _refresh_rule(refresh: RefreshRule | str, every=None, tol=0.1) -> RefreshRule:
    if isinstance(refresh, RefreshRule):
        return refresh
    if refresh not in REFRESH_RULES:
        raise ValueError(f"refresh: must be one of {', '.join(REFRESH_RULES)} (got {refresh!r})")
    return REFRESH_RULES[refresh](every=every, tol=tol)


# ---- caching policies ---------------------------------------------------------------------------
@CACHE_POLICIES.register
class PrefixCache(CachePolicy):
    name = "prefix"
    keeps_prompt = True
    # Whether later steps also reuse the suffix after the block (DualCache) or recompute it.
    reuse_suffix = False

    def __init__(
        self,
        model,
        refresh: RefreshRule | str = "full",
        refresh_every: int | None = None,
        refresh_tol: float = 0.1,
        compiled: bool = False,
    ):
        super().__init__(model, compiled)
        self.refresh = _refresh_rule(refresh, refresh_every, refresh_tol)

    @classmethod
    def from_config(cls, model, config) -> PrefixCache:
        return cls(model, refresh=REFRESH_RULES[config.refresh].from_config(config), compiled=config.compile)

    def block_logits(self, seq, steps):
        n = len(steps)
        shift = int(self.model.args.shifted_logits)
        if self.graphs and self.reuse_suffix and all(steps) and min(seq.starts) - shift > 0 and not self.pages.chunks:
            return self._graphed_step(seq)
        windows, partial = [], []
        for i, k in enumerate(steps):
            if k > 0:
                windows.append(self.step_window(seq, i))
            elif self.refresh.needs_full(seq.blocks[i]):
                windows.append(self.full_window(seq, i))
            else:
                partial.append(i)
                windows.append((i, self.refresh.first_column(seq, i), seq.end(i), seq.seen[i], seq.starts[i]))
        cache = self.pages.cache_for(seq)
        before = self.refresh.probe(cache, seq, partial) if partial else None
        parts = self.forward(seq, windows)
        stale = self.refresh.check(cache, seq, partial, before) if partial else []
        if stale:  # a full forward for those rows, replacing their logits and cache
            for i, out in zip(stale, self.forward(seq, [self.full_window(seq, i) for i in stale])):
                parts[i] = out
        assert len(parts) == n
        return self.stack(seq, parts)

    def step_window(self, seq, i) -> Window:
        """A step after the block's first: the block and the blocks after it in the logits
        (DualCache), or everything from the block on (prefix cache), against the cached rest. With
        shifted logits the window starts one column earlier (the block's first token's logit)."""
        start = seq.starts[i]
        lo = max(0, start - int(self.model.args.shifted_logits))
        hi = start + seq.width if self.reuse_suffix else seq.end(i)
        return (i, lo, hi, seq.seen[i], start)

    def _graphed_step(self, seq) -> torch.Tensor:
        """A cached step of DualCache with the shapes of every step of a layout: each row's window
        (its block, and the column before it with shifted logits) attends over its whole cache row,
        the keys past what the step sees masked rather than cut off, and the windows' columns
        are a tensor (`Transformer.window_logits_static`). The same arithmetic as the eager step
        over more (masked) keys."""
        bsz = seq.x.shape[0]
        cache = self.pages.cache_for(seq)
        capacity = seq.x.shape[1]
        shift = int(self.model.args.shifted_logits)
        width = seq.width + shift
        dev = seq.x.device
        for i, s in enumerate(seq.starts):
            cache.own(i, s - shift, s + seq.width)
        first = torch.tensor([s - shift for s in seq.starts], device=dev)
        columns = first[:, None] + torch.arange(width, device=dev)
        key_ok = torch.arange(capacity, device=dev)[None, :] < torch.tensor(seq.seen, device=dev)[:, None]
        key_positions = torch.arange(capacity, device=dev).expand(bsz, capacity)
        self.work.append([(i, width, seq.seen[i]) for i in range(bsz)])
        if self.history is not None:
            self.history.append([(i, s - shift, s + seq.width, seq.seen[i], s) for i, s in enumerate(seq.starts)])
        return self.model.graphed_window_logits()(
            seq.x.gather(1, columns),
            columns,
            columns,
            key_ok,
            key_positions,
            FixedSlots(cache, cache.slot_table(capacity)),
            seq.block_length or None,
            seq.width,
        )


@CACHE_POLICIES.register
class DualCache(PrefixCache):
    name = "dual"
    reuse_suffix = True


@CACHE_POLICIES.register
class SubBlockCache(DualCache):
    """DualCache, and inside a block Fast-dLLM v2's block cache (its `generate(use_block_cache=True)`).

    With `sub_block_length` the block is revealed sub-block by sub-block, left to right. A step whose
    current sub-block (the first that still has a mask) opens with a masked position recomputes the
    whole block against the cached prefix, as DualCache does, and that forward's K/V of the block
    are the block cache; a step whose sub-block opens with a revealed position recomputes only the
    sub-block, writing its K/V into the block cache, and attends over the prefix and the whole
    cached block. The opening position decides because of the shifted prediction: the sub-block's
    first token is predicted by the position before the sub-block, which a sub-block forward does
    not compute. With a family whose block-start step reveals the block's first token (v2: the
    reference's commit forward predicts it), that step's forward makes no block cache: the next
    step recomputes the whole block with the first token in place, as the reference's first
    decoding forward of a block does. The positions outside the sub-block keep the logits of
    their row's last forward (no rule reveals them in this step). Approximate within a block (the
    other sub-blocks' K/V are those of the last whole-block forward); across blocks it is the
    exact cache.

    The decision is per row, so a row decodes the same in a batch as alone. *Deliberate
    difference*: the reference keeps its block cache from one block to the next, so the first
    sub-block of every later block (whose opening token the commit forward revealed) attends to
    the previous block's K/V as if they were the current block's; here each block gets a block
    cache of its own (`tests/test_reference.py` runs the reference with that one change)."""

    name = "sub-block"

    def __init__(self, model, sub_block_length: int, **kwargs):
        super().__init__(model, **kwargs)
        self.sub_block_length = sub_block_length
        self._logits: torch.Tensor | None = None  # (B, block_length, V): each row's latest logits
        # A family whose block-start step reveals the block's first token (Fast-dLLM v2): that step
        # is the reference's commit forward, which makes no block cache; the block's first decoding
        # forward does, with the first token in place.
        family = getattr(model, "family", None)
        self._first_at_start = family is not None and family.rules.block_start_reveals_first
        self._uncached: list[bool] = []  # per row: no whole-block forward of this block yet

    @classmethod
    def from_config(cls, model, config) -> SubBlockCache:
        return cls(
            model,
            config.sub_block_length,
            refresh=REFRESH_RULES[config.refresh].from_config(config),
            compiled=config.compile,
        )

    def relayout(self, sources):
        if self._logits is not None:
            kept = [(i, j) for i, j in enumerate(sources) if j is not None]
            logits = self._logits.new_zeros((len(sources),) + tuple(self._logits.shape[1:]))
            if kept:
                dst, src = (torch.tensor(t, device=logits.device) for t in zip(*kept))
                logits[dst] = self._logits[src]
            self._logits = logits
        self._uncached = [False if j is None else self._uncached[j] for j in sources]

    def block_logits(self, seq, steps):
        bsz, blk = len(steps), seq.block_length
        size, shift, mask_id = self.sub_block_length, int(self.model.args.shifted_logits), self.model.mask_token_id
        starting = [i for i, k in enumerate(steps) if k == 0]
        if starting:
            firsts = seq.x[starting, [seq.starts[i] for i in starting]]
            opens = [bool(o) for o in (firsts == mask_id).tolist()]
        # the block-start rows as the DualCache does; the others' whole block or current sub-block
        windows, places = [], []
        if len(starting) < bsz:
            idx = torch.tensor(seq.starts, device=seq.x.device)[:, None] + torch.arange(blk, device=seq.x.device)
            masked = seq.x.gather(1, idx) == mask_id
            opening = masked.view(bsz, -1, size).any(-1).long().argmax(-1) * size  # (B,) the current sub-block
            opens_masked = masked.gather(1, opening[:, None]).squeeze(1)
            flags = torch.stack([opening, opens_masked, masked.any(-1)]).tolist()
        for i in range(bsz):
            start = seq.starts[i]
            if steps[i] == 0:
                windows.append(self._start_window(seq, i))
                places.append((i, 0))
                continue
            o, m, live = flags[0][i], flags[1][i], flags[2][i]
            if not live:  # a row whose block is done needs no logits
                continue
            if m or self._uncached[i]:
                windows.append((i, max(0, start - shift), start + blk, seq.seen[i], start))
                places.append((i, 0))
                self._uncached[i] = False
            else:
                sub = start + o
                windows.append((i, sub, sub + size, seq.seen[i], sub + shift))
                places.append((i, o + shift))
        parts = self.forward(seq, windows)
        if self._logits is None or self._logits.shape[0] != bsz:
            self._logits = parts[0].new_zeros((bsz, blk, parts[0].shape[-1]))
            self._uncached = [False] * bsz
        for (i, at), out in zip(places, parts):
            width = min(out.shape[0], blk - at)
            self._logits[i, at : at + width] = out[:width].to(self._logits.dtype)
        for i, o in zip(starting, opens if starting else []):
            self._uncached[i] = o and self._first_at_start
        return self._logits.clone()

    def _start_window(self, seq, i) -> Window:
        if self.refresh.needs_full(seq.blocks[i]):
            return self.full_window(seq, i)
        return (i, self.refresh.first_column(seq, i), seq.end(i), seq.seen[i], seq.starts[i])


@CACHE_POLICIES.register
class DelayedCache(CachePolicy):
    """d3LLM's delayed KV cache (`generate_multi_block_kv_cache`), for decoding over several blocks
    at once: a row's cache holds its committed prefix, the prompt and the blocks finished
    `cache_delay` forwards ago, in order. A forward recomputes from the end of that prefix to the end
    of the row against it, except while a finished block waits to be committed (its tokens final,
    their K/V still settling as later blocks change): then every forward is full, and so is every
    `refresh_interval`-th. The forward in which a waiting block's delay is over computes its K/V
    against the committed prefix and commits them.

    Per row, as d3LLM's loop per sequence: the blocks are walked in order from the committed end;
    a finished block's wait starts at the first forward that reaches it in that walk (the prompt's
    at forward 0). The walk stops at the first unfinished block, and in its LLaDA code also at the
    first block still waiting (the family's `d3llm_code`). Its Dream code reads the logit of a
    cached forward's first column from that column's own output (`Transformer.packed_logits`).

    *Deliberate difference*: we attend each position once. d3LLM's refresh keeps the K/V up to the
    last waiting block's start while its committed prefix ends at the first's; where two blocks wait
    at once (its Dream code) its next cached forward attends the columns between them twice."""

    name = "delayed"
    refreshes_at_block_start = False

    def __init__(self, model, delay: int = 2, refresh_interval: int | None = None, compiled: bool = False):
        super().__init__(model, compiled)
        self.delay, self.refresh_interval = delay, refresh_interval
        self.row_states: list[_DelayedRow] = []
        family = getattr(model, "family", None)
        self.dream_code = family is not None and family.rules.d3llm_code == "dream"

    @classmethod
    def from_config(cls, model, config) -> DelayedCache:
        return cls(model, config.cache_delay, config.refresh_interval, compiled=config.compile)

    def relayout(self, sources):
        old = self.row_states
        self.row_states = [old[j] if j is not None and j < len(old) else _DelayedRow() for j in sources]

    def block_logits(self, seq, steps):
        bsz = seq.x.shape[0]
        self.row_states += [_DelayedRow() for _ in range(bsz - len(self.row_states))]
        masked = (seq.x == self.model.mask_token_id).tolist()
        windows = [self._window(seq, i, masked[i]) for i in range(bsz)]
        return self.stack(seq, self.forward(seq, windows))

    def _window(self, seq: SequenceView, i: int, masked: list[bool]) -> Window:
        row, shift = self.row_states[i], int(self.model.args.shifted_logits)
        row.forwards += 1
        length, end = seq.block_length, seq.seen[i]
        prompt = seq.starts[i] - seq.blocks[i] * length
        bounds = [(0, prompt)] + [(lo, min(lo + length, end)) for lo in range(prompt, end, length)]
        commit, waiting = None, False
        for k, (lo, hi) in enumerate(bounds):
            if hi <= row.committed:
                continue
            if any(masked[lo:hi]):
                break
            if row.forwards - row.finished.setdefault(k, row.forwards if k else 0) < self.delay:
                waiting = True
                if self.dream_code:
                    continue
                break
            commit = hi
        lo = row.committed if self.dream_code else min(row.committed, seq.starts[i] - shift)
        partial = (i, max(0, lo), seq.end(i), seq.seen[i], seq.starts[i])
        if commit is not None:
            row.committed = commit
            return partial if lo > 0 else self.full_window(seq, i)
        periodic = self.refresh_interval is not None and row.forwards % self.refresh_interval == 0
        if row.committed and not waiting and not periodic:
            return partial
        return self.full_window(seq, i)


@dataclass
class _DelayedRow:
    """A row's state under `DelayedCache`: its forwards, the end of its committed prefix (0: nothing
    committed yet), and when each finished block's wait began (block 0: the prompt)."""

    forwards: int = 0
    committed: int = 0
    finished: dict = field(default_factory=dict)


def register_cache_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Make `cls` a cache policy that configs name by `cls.name`; it is built by
    `cls.from_config(model, config)`."""
    return CACHE_POLICIES.register(cls)


def cache_policy(model, config) -> CachePolicy:
    """The policy a config names, with the config's engine settings (`configure`)."""
    return configure(CACHE_POLICIES[config.cache].from_config(model, config), model, config)


def configure(policy: CachePolicy, model, config) -> CachePolicy:
    """The settings a config gives every policy alike, whether it names the policy or a caller
    passed the object (`policies.Policies`): batch-invariant forwards with `config.deterministic`,
    CUDA graphs. (Pages and prefix sharing are the loop's, for every policy: `kv.rows.RowPages`.)"""
    policy.batch_invariant = config.deterministic
    policy.graphs = config.cuda_graphs
    return policy
