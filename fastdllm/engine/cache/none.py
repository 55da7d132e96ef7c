"""No cache: every step recomputes every row whole (LLaDA's baseline)."""

from __future__ import annotations

from ..registry import CACHE_POLICIES
from .base import CachePolicy


@CACHE_POLICIES.register
class NoCache(CachePolicy):
    name = "none"
    refreshes_at_block_start = False
    holds_cache = False  # every key a row reads is one its own window writes

    def windows(self, seq, steps):
        return [self.full_window(seq, i) for i in range(len(steps))]
