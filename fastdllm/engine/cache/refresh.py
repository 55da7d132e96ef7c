"""Refresh rules: what a caching policy's block-start forward recomputes of a row."""

from __future__ import annotations

from ..kv.pages import PagedKVCache
from ..registry import REFRESH_RULES
from .base import SequenceView


class RefreshRule:
    """How a caching policy's block-start forward refreshes a row's cache. `needs_full(block)`:
    whether a row at `block` recomputes its whole sequence; the other rows recompute from
    `first_column` on, against their cached K/V. `check` may then ask for full forwards of some
    of those rows (their cache did not suffice)."""

    name = ""
    # Whether a block-start forward may recompute a prompt block (a full one), so that a row never
    # holds another's prompt pages by reference under it (`KVRunner.shares_prompt_pages`).
    recomputes_prompt = True
    # Whether `check` may ask for full forwards after a partial refresh (such a step is not one of
    # fixed shapes: `kv.runner.FixedForm`)
    checks = False

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
    recomputes_prompt = False  # but at a row's first block, and every `every` blocks

    def needs_full(self, block):
        return block == 0 or bool(self.every and block % self.every == 0)

    def first_column(self, seq, i):
        return max(0, seq.starts[i] - seq.refresh(i) * seq.block_lengths[i])


@REFRESH_RULES.register
class AdaptiveRefresh(VicinityRefresh):
    """The vicinity refresh, then a per-row test of whether it sufficed (see the module
    docstring): a row whose current block's last-layer keys moved by more than `tol` (relative)
    gets a full forward at once."""

    name = "adaptive"
    recomputes_prompt = True  # a row whose check fails gets a full forward
    checks = True

    def _keys(self, cache, seq, rows):
        lengths = seq.block_lengths
        return [cache.read(i, seq.starts[i], seq.starts[i] + lengths[i], layer=-1)[0].float() for i in rows]

    def probe(self, cache, seq, rows):
        return [k.clone() for k in self._keys(cache, seq, rows)]

    def check(self, cache, seq, rows, before):
        after = self._keys(cache, seq, rows)
        drift = [float((a - b).norm() / b.norm().clamp_min(1e-12)) if b.numel() else 0.0 for a, b in zip(after, before)]
        return [i for i, d in zip(rows, drift) if d > self.tol]


def register_refresh_rule(cls: type[RefreshRule]) -> type[RefreshRule]:
    """Make `cls` a refresh rule that configs name by `cls.name` (usable as a class decorator)."""
    return REFRESH_RULES.register(cls)


def refresh_rule(refresh: RefreshRule | str, every=None, tol=0.1) -> RefreshRule:
    if isinstance(refresh, RefreshRule):
        return refresh
    if refresh not in REFRESH_RULES:
        raise ValueError(f"refresh: must be one of {', '.join(REFRESH_RULES)} (got {refresh!r})")
    return REFRESH_RULES[refresh](every=every, tol=tol)
