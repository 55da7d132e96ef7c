"""Cache policies: which part of the sequence each decoding step recomputes.

Every policy answers one question for the generation loop: "give me the logits of the current
block at this step". They differ only in the window they recompute (`Transformer.logits_for`):

- `NoCache`: the whole sequence at every step (LLaDA's baseline).
- `PrefixCache`: at a block's first step a full forward fills the cache (and decodes); later steps
  recompute [block start, end of sequence) against the cached prefix (Fast-dLLM prefix cache).
- `DualCache`: the same, but later steps recompute only the block, against the cached prefix *and*
  the cached masked suffix (Fast-dLLM DualCache).
- `SubBlockCache`: DualCache, and with sub-blocks, later steps of a sub-block recompute only that
  sub-block against the cached block (Fast-dLLM v2's block cache).

The cache is refreshed when a new block starts, i.e. when the previous one completed. How much a
block-start forward recomputes is the policy's refresh rule (a `RefreshRule`, named in `REFRESH_RULES`):
- "full" (Fast-dLLM): the whole sequence;
- "vicinity" (after dInfer's vicinity refresh): only from the just-finished block (blocks, when
  multi-block decoding finished more than one since the last block start) to the end
  (its tokens just became final, and the current block and what follows it see them), against
  the cached K/V of everything before it; the prompt's K/V are computed once per generation, at
  the first block. `refresh_every` N adds a full refresh every N blocks (1: every block, which is
  "full"). When rows leave or join the batch, the cache rows of the others move with them
  (`relayout`); a row that joined gets a full forward at its first block, in a forward of its own;
- "adaptive": the vicinity refresh, then a test of whether it sufficed. The current block's
  positions are all still masked, so their tokens did not change since their keys were cached:
  any change of their last-layer keys, cached against recomputed now, is the effect of the
  just-finished block's tokens through attention, the same effect that leaves the older prefix's
  cached K/V stale. A row whose relative change exceeds `refresh_tol` gets a full forward at once
  (its logits and cache replaced). The test is per row, so a row decodes the same in a batch as
  alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import CACHE_POLICIES, REFRESH_RULES
from ..models.kv_cache import KVCache


@dataclass
class SequenceView:
    """What a policy needs about the rows being decoded. Every row's current block sits at the same
    columns; rows are at different blocks of their own answers, each on its own clock."""

    x: torch.Tensor  # (B, L) token ids (L: up to the end of the suffix window)
    positions: torch.Tensor  # (B, L) RoPE positions (padding aware)
    key_mask: torch.Tensor | None  # (B, 1, 1, L) True where attention may look, None: no padding
    block: int = 0  # index of the current block (of the first row)
    block_length: int = 0
    capacity: int | None = None  # the whole layout's length (L grows with a suffix window)
    row_blocks: tuple[int, ...] = ()  # each row's own block index ((): every row at `block`)
    # how many blocks before the current one became final since the last block-start forward
    # (more than one when multi-block decoding revealed a block whole before it was current): of
    # the first row, and of each row ((): every row's is `refresh_blocks`)
    refresh_blocks: int = 1
    row_refresh: tuple[int, ...] = ()

    def refreshes(self) -> tuple[int, ...]:
        return self.row_refresh or (self.refresh_blocks,) * self.x.shape[0]

    def blocks(self) -> tuple[int, ...]:
        return self.row_blocks or (self.block,) * self.x.shape[0]

    def take(self, rows: list[int]) -> SequenceView:
        """The view of some rows alone."""
        idx = torch.tensor(rows, device=self.x.device)
        blocks, refreshes = self.blocks(), self.refreshes()
        return SequenceView(
            self.x[idx],
            self.positions[idx],
            None if self.key_mask is None else self.key_mask[idx],
            block=blocks[rows[0]],
            block_length=self.block_length,
            capacity=self.capacity,
            row_blocks=tuple(blocks[i] for i in rows),
            refresh_blocks=refreshes[rows[0]],
            row_refresh=tuple(refreshes[i] for i in rows),
        )

    def leading_padding(self) -> int:
        """How many leading columns every row pads (a row that joined a batch with a longer prompt)."""
        if self.key_mask is None:
            return 0
        return int(self.key_mask[:, 0, 0, :].any(0).long().argmax())

    def from_column(self, first: int) -> SequenceView:
        """The same rows without columns [0, first) (padding for all of them): positions are
        absolute, so the forward is the same with fewer masked keys."""
        if first == 0:
            return self
        return SequenceView(
            self.x[:, first:],
            self.positions[:, first:],
            self.key_mask[..., first:],
            block=self.block,
            block_length=self.block_length,
            capacity=None if self.capacity is None else self.capacity - first,
            row_blocks=self.row_blocks,
            refresh_blocks=self.refresh_blocks,
            row_refresh=self.row_refresh,
        )


class CachePolicy:
    """Answers "the block's logits at this step" by forwards over some window of the sequence.
    `forward` runs one and records its work in `work`: (the batch rows it served, None for all;
    query positions; key positions), which the loop charges to those rows (`take_work`)."""

    name = "none"

    def __init__(self, model, compiled: bool = False):
        self.model = model
        self.compiled = compiled  # forwards through the model's torch.compile'd layers
        # each row's logits exactly as computed alone, whatever the batch (`models.invariance`)
        self.batch_invariant = False
        # DualCache's steps after a block's first through fixed shapes, captured as CUDA graphs
        # (`PrefixCache._graphed_step`)
        self.graphs = False
        self.work: list[tuple[list[int] | None, int, int]] = []
        self.history: list[tuple[int, int, int, int, int]] | None = None  # set to [] to record windows
        self.peak_cache_bytes = 0  # the largest KV cache this policy held at once (memory accounting)

    @classmethod
    def from_config(cls, model, config) -> CachePolicy:
        return cls(model, compiled=config.compile)

    def record(self) -> CachePolicy:
        """Record every forward's (window start, window end, sequence length, block start, block end)
        in `history`: the schedule a benchmark can replay on another model."""
        self.history = []
        return self

    def take_work(self) -> list[tuple[list[int] | None, int, int]]:
        work, self.work = self.work, []
        return work

    def block_logits(self, seq: SequenceView, start: int, end: int, steps: list[int]) -> torch.Tensor:
        """Logits (B, end - start, V) of every row's current block (and, up to `end`, the blocks
        after it), where row i has taken `steps[i]` steps in its block (0: the block begins)."""
        raise NotImplementedError

    def relayout(self, sources: list[int | None], shifts: list[int | None], length: int) -> None:
        """The decoding loop moved its rows: new row i is old row `sources[i]` (None: a row that just
        joined) moved right by `shifts[i]` columns (left, when negative), in a layout of `length`
        columns."""

    def forward(self, seq: SequenceView, start: int, end: int, window=None, cache=None, rows=None) -> torch.Tensor:
        length = seq.x.shape[1]
        ws, we = (0, length) if window is None else window
        self.work.append((rows, we - ws, length))  # a window's queries attend over the whole sequence
        if self.history is not None:
            self.history.append((ws, we, length, start, end))
        return self.model.logits_for(
            seq.x,
            start,
            end,
            window=window,
            cache=cache,
            positions=seq.positions,
            key_mask=seq.key_mask,
            compiled=self.compiled,
            block_size=seq.block_length or None,
            batch_invariant=self.batch_invariant,
        )

    def split(self, seq: SequenceView, start: int, end: int, cache, rows, groups) -> torch.Tensor:
        """Logits of rows that need different forwards: `groups` are (rows of `seq`, run), each run
        as `run(seq, start, end, cache, rows)` over those rows alone, on a copy of their cache rows
        written back after. A group leaves out the leading columns all its rows pad. `rows`: the
        batch rows of `seq`'s rows (None: the same)."""
        logits = None
        for local, run in groups:
            part, sub = cache.take_rows(local), seq.take(local)
            first = sub.leading_padding()
            served = local if rows is None else [rows[i] for i in local]
            out = run(sub.from_column(first), start - first, end - first, part.columns_from(first), served)
            cache.put_rows(local, part)
            if logits is None:
                logits = out.new_empty((seq.x.shape[0],) + tuple(out.shape[1:]))
            logits[torch.tensor(local, device=out.device)] = out
        return logits


class NoCache(CachePolicy):
    name = "none"

    def block_logits(self, seq, start, end, steps):
        return self.forward(seq, start, end)


# ---- refresh rules: what a block-start forward recomputes --------------------------------------
class RefreshRule:
    """How a caching policy's block-start forward refreshes the cache. `needs_full(block)`: whether
    a row at `block` recomputes its whole sequence (it is then the plain full forward); the other
    rows get `partial`, a forward over less of the sequence against their cached K/V.
    `keeps_cache`: whether cached K/V outlive a block (then they move with rows that join or
    leave the batch)."""

    name = ""
    keeps_cache = True

    def __init__(self, every: int | None = None, tol: float = 0.1):
        self.every, self.tol = every, tol

    @classmethod
    def from_config(cls, config) -> RefreshRule:
        return cls(every=config.refresh_every, tol=config.refresh_tol)

    def needs_full(self, block: int) -> bool:
        raise NotImplementedError

    def partial(self, policy: PrefixCache, seq: SequenceView, start: int, end: int, cache, rows) -> torch.Tensor:
        raise NotImplementedError


class FullRefresh(RefreshRule):
    """Fast-dLLM: every block-start forward recomputes the whole sequence."""

    name = "full"
    keeps_cache = False

    def needs_full(self, block):
        return True


class VicinityRefresh(RefreshRule):
    """After dInfer: from the just-finished block to the end, against the cached K/V of the older
    prefix; the whole sequence at a row's first block (nothing is cached yet) and every `every`
    blocks."""

    name = "vicinity"

    def needs_full(self, block):
        return block == 0 or bool(self.every and block % self.every == 0)

    def partial(self, policy, seq, start, end, cache, rows):
        window = (max(0, start - seq.refresh_blocks * seq.block_length), seq.x.shape[1])
        return policy.forward(seq, start, end, window=window, cache=cache, rows=rows)


class AdaptiveRefresh(VicinityRefresh):
    """The vicinity refresh, then a per-row test of whether it sufficed (see the module
    docstring): a row whose current block's last-layer keys moved by more than `tol` (relative)
    gets a full forward at once."""

    name = "adaptive"

    def partial(self, policy, seq, start, end, cache, rows):
        probe = slice(start, min(end, seq.x.shape[1]))
        before = cache.k[-1, :, :, probe].float().clone()
        logits = super().partial(policy, seq, start, end, cache, rows)
        after = cache.k[-1, :, :, probe].float()
        drift = ((after - before).flatten(1).norm(dim=-1) / before.flatten(1).norm(dim=-1).clamp_min(1e-12)).tolist()
        stale = [i for i, d in enumerate(drift) if d > self.tol]
        if stale:
            # A full forward for those rows alone, in a cache of their own, copied back: the other
            # rows keep exactly what the vicinity refresh gave them.
            part = cache.take_rows(stale)
            full = policy.forward(
                seq.take(stale), start, end, cache=part, rows=stale if rows is None else [rows[i] for i in stale]
            )
            cache.put_rows(stale, part)
            logits = logits.clone()
            logits[torch.tensor(stale, device=logits.device)] = full.to(logits.dtype)
        return logits


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
class PrefixCache(CachePolicy):
    name = "prefix"
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
        self._buffer: KVCache | None = None
        self.cache: KVCache | None = None

    @classmethod
    def from_config(cls, model, config) -> PrefixCache:
        return cls(model, refresh=REFRESH_RULES[config.refresh].from_config(config), compiled=config.compile)

    def relayout(self, sources, shifts, length):
        old = self._buffer
        if old is None:
            return
        if not sources:
            self._buffer = self.cache = None
            return
        if length == old.length and all(s == 0 for s in shifts):
            old.keep_rows(sources)  # rows left the batch: the others move to the front
            return
        # Rows joined or moved on (or the layout's width changed): a new buffer, each kept row's
        # K/V moved with it (a negative shift: to the left).
        self._buffer = new = self.model.new_cache(len(sources), length)
        # Both buffers are alive while the kept rows move over.
        self.peak_cache_bytes = max(self.peak_cache_bytes, old.nbytes() + new.nbytes())
        for i, (src, shift) in enumerate(zip(sources, shifts)):
            if src is None:
                continue
            src_lo, dst_lo = max(0, -shift), max(0, shift)
            width = min(old.length - src_lo, length - dst_lo)
            new.k[:, i, :, dst_lo : dst_lo + width] = old.k[:, src, :, src_lo : src_lo + width]
            new.v[:, i, :, dst_lo : dst_lo + width] = old.v[:, src, :, src_lo : src_lo + width]

    def block_logits(self, seq, start, end, steps):
        bsz, length = seq.x.shape
        capacity = seq.capacity or length
        if self._buffer is None or self._buffer.batch < bsz or self._buffer.length != capacity:
            if any(steps):
                raise RuntimeError("the cache lost rows in the middle of their blocks")
            self._buffer = None  # freed before its successor is allocated
            self._buffer = self.model.new_cache(bsz, capacity)
            self.peak_cache_bytes = max(self.peak_cache_bytes, self._buffer.nbytes())
        self.cache = self._buffer.narrow(bsz, length)
        starting = [i for i, s in enumerate(steps) if s == 0]
        if len(starting) == bsz:
            return self._start(seq, start, end, self.cache, None)
        if not starting:
            return self._continue(seq, start, end, self.cache, None)
        # Rows at their block's first step get its block-start forward, the others their cached step.
        continuing = [i for i, s in enumerate(steps) if s > 0]
        return self.split(seq, start, end, self.cache, None, [(continuing, self._continue), (starting, self._start)])

    def _continue(self, seq, start, end, cache, rows):
        """A step after a block's first: the block (DualCache) or everything from it (prefix
        cache), against the cached rest."""
        if rows is None and self.graphs and self.reuse_suffix and start - int(self.model.args.shifted_logits) > 0:
            return self._graphed_step(seq, start, end)
        window = (start, end if self.reuse_suffix else seq.x.shape[1])
        return self.forward(seq, start, end, window=window, cache=cache, rows=rows)

    def _start(self, seq, start, end, cache, rows):
        """A block's first step: the refresh rule's forward (the whole sequence for a row whose
        refresh is full). Rows whose refresh differs (a row's first block, a periodic full
        refresh, blocks that multi-block decoding finished without a forward) get forwards of
        their own."""
        groups: dict[object, list[int]] = {}
        for i, (b, k) in enumerate(zip(seq.blocks(), seq.refreshes())):
            groups.setdefault("full" if self.refresh.needs_full(b) else k, []).append(i)
        if len(groups) == 1:
            if "full" in groups:
                return self.forward(seq, start, end, cache=cache, rows=rows)
            return self.refresh.partial(self, seq, start, end, cache, rows)
        return self.split(
            seq, start, end, cache, rows, [(g, self._full if k == "full" else self._partial) for k, g in groups.items()]
        )

    def _graphed_step(self, seq, start: int, end: int) -> torch.Tensor:
        """A cached step of DualCache with the shapes of every step of this layout: the window
        (the block, and the column before it with shifted logits) attends over the whole cache
        buffer, the keys past what the step sees masked rather than cut off, and its column is a
        tensor (`Transformer.window_logits_static`). The same arithmetic as the eager step over
        more (masked) keys."""
        bsz, seen = seq.x.shape
        capacity = seq.capacity or seen
        first = start - int(self.model.args.shifted_logits)
        cache = self._buffer.narrow(bsz, capacity)
        if seq.key_mask is None:
            key_ok = torch.ones(bsz, seen, dtype=torch.bool, device=seq.x.device)
        else:
            key_ok = seq.key_mask[:, 0, 0, :]
        key_ok = torch.nn.functional.pad(key_ok, (0, capacity - seen), value=False)
        key_positions = torch.nn.functional.pad(seq.positions, (0, capacity - seen))
        self.work.append((None, end - first, capacity))
        if self.history is not None:
            self.history.append((first, end, seen, start, end))
        column = torch.full((), first, dtype=torch.long, device=seq.x.device)
        return self.model.graphed_window_logits()(
            seq.x[:, first:end],
            seq.positions[:, first:end],
            column,
            key_ok,
            key_positions,
            cache,
            seq.block_length or None,
            end - start,
        )

    def _full(self, seq, start, end, cache, rows):
        return self.forward(seq, start, end, cache=cache, rows=rows)

    def _partial(self, seq, start, end, cache, rows):
        return self.refresh.partial(self, seq, start, end, cache, rows)


class DualCache(PrefixCache):
    name = "dual"
    reuse_suffix = True


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

    def relayout(self, sources, shifts, length):
        super().relayout(sources, shifts, length)
        if self._logits is not None and sources:
            kept = [(i, j) for i, j in enumerate(sources) if j is not None]
            logits = self._logits.new_zeros((len(sources),) + tuple(self._logits.shape[1:]))
            if kept:
                dst, src = (torch.tensor(t, device=logits.device) for t in zip(*kept))
                logits[dst] = self._logits[src]
            self._logits = logits
        self._uncached = [False if j is None else self._uncached[j] for j in sources]

    def _start(self, seq, start, end, cache, rows):
        out = super()._start(seq, start, end, cache, rows)
        batch = list(range(seq.x.shape[0])) if rows is None else rows
        if self._logits is None or self._logits.shape[0] < max(batch) + 1:
            self._logits = out.new_zeros((max(batch) + 1,) + tuple(out.shape[1:]))
        self._logits[torch.tensor(batch, device=out.device)] = out.to(self._logits.dtype)
        opens = (seq.x[:, start] == self.model.mask_token_id).tolist()
        self._uncached += [False] * (len(self._logits) - len(self._uncached))
        for g, o in zip(batch, opens):
            self._uncached[g] = o and self._first_at_start
        return out

    def _continue(self, seq, start, end, cache, rows):
        size, shift = self.sub_block_length, int(self.model.args.shifted_logits)
        bsz = seq.x.shape[0]
        batch = list(range(bsz)) if rows is None else rows
        masked = seq.x[:, start:end] == self.model.mask_token_id
        opening = masked.view(bsz, -1, size).any(-1).long().argmax(-1) * size  # (B,) the current sub-block
        opens_masked = masked.gather(1, opening[:, None]).squeeze(1)
        groups: dict[int | None, list[int]] = {}  # sub-block start (None: the whole block) -> rows
        for i, (o, m, live) in enumerate(zip(*torch.stack([opening, opens_masked, masked.any(-1)]).tolist())):
            if live:  # a row whose block is done needs no logits
                groups.setdefault(None if m or self._uncached[batch[i]] else start + o, []).append(i)
        for sub, local in groups.items():
            lo, hi, window = (start, end, (start, end)) if sub is None else (sub + shift, sub + size, (sub, sub + size))
            served = [batch[i] for i in local]
            if len(local) == bsz:
                out = self.forward(seq, lo, hi, window=window, cache=cache, rows=rows)
            else:
                part = cache.take_rows(local)
                out = self.forward(seq.take(local), lo, hi, window=window, cache=part, rows=served)
                cache.put_rows(local, part)
            index = torch.tensor(served, device=out.device)
            self._logits[index, lo - start : hi - start] = out.to(self._logits.dtype)
            if sub is None:
                for g in served:
                    self._uncached[g] = False
        return self._logits[torch.tensor(batch, device=self._logits.device)]


def register_cache_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Make `cls` a cache policy that configs name by `cls.name`; it is built by
    `cls.from_config(model, config)`."""
    return CACHE_POLICIES.register(cls)


def cache_policy(model, config) -> CachePolicy:
    """The policy a config names, with its refresh rule (batch-invariant forwards with
    `config.deterministic`)."""
    policy = CACHE_POLICIES[config.cache].from_config(model, config)
    policy.batch_invariant = config.deterministic
    policy.graphs = config.cuda_graphs
    return policy
