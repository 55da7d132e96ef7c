"""Fast-dLLM's prefix cache and DualCache: a block-start forward fills the cache, later steps
recompute the block (and, for the prefix cache, what follows it) against it."""

from __future__ import annotations

import torch

from ..kv.pages import FixedSlots
from ..kv.rows import Window
from ..registry import CACHE_POLICIES, REFRESH_RULES
from .base import CachePolicy
from .refresh import RefreshRule, refresh_rule


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
        self.refresh = refresh_rule(refresh, refresh_every, refresh_tol)

    @property
    def shift(self) -> int:
        """How far a step's window opens before its block: one column with shifted logits (the
        block's first token's logit), none where the block-start step revealed that token
        (`block_start_reveals_first`: Fast-dLLM's Dream): no later step reads its logit, so the
        window opens at the block and its first column's logit is its own output, as Fast-dLLM's
        Dream loops read it, and the column before the block keeps the K/V the block-start
        forward cached."""
        return int(self.model.args.shifted_logits and not self.block_start_reveals_first)

    @classmethod
    def from_config(cls, model, config) -> PrefixCache:
        return cls(model, refresh=REFRESH_RULES[config.refresh].from_config(config), compiled=config.compile)

    def windows(self, seq, steps):
        return [self.step_window(seq, i) if k > 0 else self.start_window(seq, i) for i, k in enumerate(steps)]

    def start_window(self, seq, i) -> Window:
        """A block's first step: the whole row, or what its refresh rule recomputes of it."""
        if self.refresh.needs_full(seq.blocks[i]):
            return self.full_window(seq, i)
        return (i, self.refresh.first_column(seq, i), seq.end(i), seq.seen[i], seq.starts[i])

    def block_logits(self, seq, steps):
        """The windows in one forward, and a full one for the rows refreshed in part whose
        refresh rule finds their cache stale (`RefreshRule.check`); with CUDA graphs, DualCache's
        steps after a block's first through fixed shapes."""
        n = len(steps)
        graphed = self.graphs and self.reuse_suffix and all(steps) and not self.pages.chunks
        if graphed and min(seq.starts) - self.shift > 0:
            return self._graphed_step(seq)
        windows = self.windows(seq, steps)
        partial = [i for i, k in enumerate(steps) if k == 0 and not self.refresh.needs_full(seq.blocks[i])]
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
        shifted logits the window starts one column earlier (the block's first token's logit), unless
        the block-start step revealed that token (`shift`)."""
        start = seq.starts[i]
        lo = max(0, start - self.shift)
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
        shift = self.shift
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
        logits = self.model.graphed_window_logits()(
            seq.x.gather(1, columns),
            columns,
            columns,
            key_ok,
            key_positions,
            FixedSlots(cache, cache.slot_table(capacity)),
            seq.block_length or None,
            seq.width,
        )
        if self.model.args.shifted_logits and not shift:  # the window opens at the block: its first
            logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)  # column's logit is its own output
        return logits


@CACHE_POLICIES.register
class DualCache(PrefixCache):
    name = "dual"
    reuse_suffix = True
