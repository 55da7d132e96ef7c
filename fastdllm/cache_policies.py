"""Cache policies: which part of the sequence each decoding step recomputes.

Every policy answers one question for the generation loop: "give me the logits of the current
block at this step". They differ only in the window they recompute (`Transformer.logits_for`):

- `NoCache`: the whole sequence at every step (LLaDA's baseline).
- `PrefixCache`: at a block's first step a full forward fills the cache (and decodes); later steps
  recompute [block start, end of sequence) against the cached prefix (Fast-dLLM prefix cache).
- `DualCache`: the same, but later steps recompute only the block, against the cached prefix *and*
  the cached masked suffix (Fast-dLLM DualCache).

The cache is refreshed when a new block starts, i.e. when the previous one completed. How much a
block-start forward recomputes is the policy's `refresh`:
- "full" (Fast-dLLM): the whole sequence;
- "vicinity" (after dInfer's vicinity refresh): only from the just-finished block to the end
  (its tokens just became final, and the current block and what follows it see them), against
  the cached K/V of everything before it; the prompt's K/V are computed once per generation, at
  the first block. `refresh_every` N adds a full refresh every N blocks (1: every block, which is
  "full"). When rows finish and leave the batch, the cache rows of the others move with them;
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

from .cache import KVCache


@dataclass
class SequenceView:
    """What a policy needs about the rows being decoded (a batch may shrink as rows finish)."""

    x: torch.Tensor  # (B, L) token ids (L: up to the end of the suffix window)
    positions: torch.Tensor  # (B, L) RoPE positions (left padding aware)
    key_mask: torch.Tensor | None  # (B, 1, 1, L) True where attention may look, None: no padding
    block: int = 0  # index of the current block
    block_length: int = 0
    rows: tuple[int, ...] = ()  # the batch rows being decoded (finished rows leave)
    capacity: int | None = None  # the whole sequence's length (L grows with a suffix window)


class CachePolicy:
    """Answers "the block's logits at this step" by a forward over some window of the sequence.
    `forward` runs it and records the work (`last_work`: query and key positions per row), which
    the loop counts for every row in the step."""

    name = "none"

    def __init__(self, model):
        self.model = model
        self.last_work: tuple[int, int] = (0, 0)
        self.history: list[tuple[int, int, int, int, int]] | None = None  # set to [] to record windows
        # A forward some rows needed on top of the step's: (batch indices, queries, keys), or None.
        self.extra_work: tuple[list[int], int, int] | None = None

    def record(self) -> "CachePolicy":
        """Record every forward's (window start, window end, sequence length, block start, block end)
        in `history`: the schedule a benchmark can replay on another model."""
        self.history = []
        return self

    def block_logits(self, seq: SequenceView, start: int, end: int, step_in_block: int) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, seq: SequenceView, start: int, end: int, window=None, cache=None) -> torch.Tensor:
        length = seq.x.shape[1]
        ws, we = (0, length) if window is None else window
        self.last_work = (we - ws, length)  # a window's queries attend over the whole sequence
        if self.history is not None:
            self.history.append((ws, we, length, start, end))
        return self.model.logits_for(seq.x, start, end, window=window, cache=cache, positions=seq.positions,
                                     key_mask=seq.key_mask)


class NoCache(CachePolicy):
    name = "none"

    def block_logits(self, seq, start, end, step_in_block):
        return self.forward(seq, start, end)


REFRESH = ("full", "vicinity", "adaptive")


class PrefixCache(CachePolicy):
    name = "prefix"
    # Whether later steps also reuse the suffix after the block (DualCache) or recompute it.
    reuse_suffix = False

    def __init__(self, model, refresh: str = "full", refresh_every: int | None = None, refresh_tol: float = 0.1):
        super().__init__(model)
        if refresh not in REFRESH:
            raise ValueError(f"refresh: must be one of {', '.join(REFRESH)} (got {refresh!r})")
        self.refresh, self.refresh_every, self.refresh_tol = refresh, refresh_every, refresh_tol
        self.drifts: list[float] = []  # the adaptive test's measurements (diagnostics)
        self._buffer: KVCache | None = None
        self.cache: KVCache | None = None
        self._rows: tuple[int, ...] | None = None

    def _cache_for(self, batch: int, length: int, capacity: int) -> KVCache:
        # One allocation per generation; when finished rows drop out we use the leading rows.
        if self._buffer is None or self._buffer.batch < batch or self._buffer.length != capacity:
            self._buffer = self.model.new_cache(batch, capacity)
        return self._buffer.narrow(batch, length)

    def refresh_window(self, seq: SequenceView, start: int, end: int) -> tuple[int, int] | None:
        """What the block-start forward recomputes: None for the whole sequence."""
        if self.refresh == "full" or seq.block == 0 or (self.refresh_every and seq.block % self.refresh_every == 0):
            return None
        return (max(0, start - seq.block_length), seq.x.shape[1])

    def block_logits(self, seq, start, end, step_in_block):
        bsz, length = seq.x.shape
        if step_in_block == 0:
            rows = tuple(seq.rows)
            if self.refresh != "full" and self._rows is not None and rows != self._rows and self._buffer is not None:
                self._buffer.keep_rows([self._rows.index(r) for r in rows])  # finished rows left the batch
            self.cache = self._cache_for(bsz, length, seq.capacity or length)
            window = self.refresh_window(seq, start, end)
            self._rows = rows
            if window is not None and self.refresh == "adaptive":
                return self._adaptive(seq, start, end, window)
        else:
            window = (start, end if self.reuse_suffix else length)
        return self.forward(seq, start, end, window=window, cache=self.cache)


    def _adaptive(self, seq, start, end, window):
        probe = slice(start, min(end, seq.x.shape[1]))
        before = self.cache.k[-1, :, :, probe].float().clone()
        logits = self.forward(seq, start, end, window=window, cache=self.cache)
        after = self.cache.k[-1, :, :, probe].float()
        drift = ((after - before).flatten(1).norm(dim=-1) / before.flatten(1).norm(dim=-1).clamp_min(1e-12)).tolist()
        self.drifts.extend(drift)
        stale = [i for i, d in enumerate(drift) if d > self.refresh_tol]
        if stale:
            # A full forward for those rows alone, in a cache of their own, copied back: the other
            # rows keep exactly what the vicinity refresh gave them.
            idx = torch.tensor(stale, device=seq.x.device)
            sub = SequenceView(seq.x[idx], seq.positions[idx], None if seq.key_mask is None else seq.key_mask[idx])
            scratch = self.model.new_cache(len(stale), seq.x.shape[1])
            full = self.model.logits_for(sub.x, start, end, cache=scratch, positions=sub.positions,
                                         key_mask=sub.key_mask)
            self.cache.k[:, idx] = scratch.k
            self.cache.v[:, idx] = scratch.v
            logits = logits.clone()
            logits[idx] = full.to(logits.dtype)
            length = seq.x.shape[1]
            self.extra_work = (stale, length, length)
        return logits


class DualCache(PrefixCache):
    name = "dual"
    reuse_suffix = True


CACHE_POLICIES: dict[str, type[CachePolicy]] = {p.name: p for p in (NoCache, PrefixCache, DualCache)}


def cache_policy(model, config) -> CachePolicy:
    """The policy a config names, with its refresh settings."""
    cls = CACHE_POLICIES[config.cache]
    if cls is NoCache:
        return cls(model)
    return cls(model, refresh=config.refresh, refresh_every=config.refresh_every, refresh_tol=config.refresh_tol)
