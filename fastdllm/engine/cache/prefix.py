"""Fast-dLLM's prefix cache and DualCache: a block-start forward fills the cache, later steps
recompute the block (and, for the prefix cache, what follows it) against it."""

from __future__ import annotations

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
    ):
        super().__init__(model)
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
        return cls(model, refresh=REFRESH_RULES[config.refresh].from_config(config))

    def windows(self, seq, steps):
        return [self.step_window(seq, i) if k > 0 else self.start_window(seq, i) for i, k in enumerate(steps)]

    def start_window(self, seq, i) -> Window:
        """A block's first step: the whole row, or what its refresh rule recomputes of it."""
        if self.refresh.needs_full(seq.blocks[i]):
            return self.full_window(seq, i)
        return (i, self.refresh.first_column(seq, i), seq.end(i), seq.seen[i], seq.starts[i])

    def partial_refreshes(self, seq, steps):
        return [i for i, k in enumerate(steps) if k == 0 and not self.refresh.needs_full(seq.blocks[i])]

    def step_window(self, seq, i) -> Window:
        """A step after the block's first: the block and the blocks after it in the logits
        (DualCache), or everything from the block on (prefix cache), against the cached rest. With
        shifted logits the window starts one column earlier (the block's first token's logit), unless
        the block-start step revealed that token (`shift`)."""
        start = seq.starts[i]
        lo = max(0, start - self.shift)
        hi = start + seq.widths[i] if self.reuse_suffix else seq.end(i)
        return (i, lo, hi, seq.seen[i], start)


@CACHE_POLICIES.register
class DualCache(PrefixCache):
    name = "dual"
    reuse_suffix = True
