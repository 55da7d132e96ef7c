"""What every cache policy is: the windows it computes of each row (`windows`), and what it declares
about them; the runner computes them (`kv.runner.KVRunner.logits`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.rows import Window
from ..registry import CACHE_POLICIES


@dataclass
class SequenceView:
    """What a policy needs about the rows being decoded: the layout `x` (B, L), where row i holds
    its prompt and answer region from column 0 on (a column's RoPE position is its index), and
    per row its current block's first column (`starts`), how far its forwards see (`seen`: its
    keys are the columns [0, seen), a suffix window's cut), its block's index and how many blocks
    before it became final since its last block-start forward (`refreshes`: more than one when
    multi-block decoding revealed a block whole before it was current). Each row decodes in blocks
    of its own length (`block_lengths`), and its logits cover its `widths` columns from its start:
    its block, and with multi-block decoding those after it."""

    x: torch.Tensor
    starts: tuple[int, ...]
    seen: tuple[int, ...]
    blocks: tuple[int, ...]
    block_lengths: tuple[int, ...]
    widths: tuple[int, ...]
    refreshes: tuple[int, ...] = ()
    # per row: its prompt's leading columns whose K/V the prefix store gave it when it joined
    # (its first full forward starts after them)
    reused: tuple[int, ...] = ()
    # per row: input vectors that replace some columns' token embeddings in every forward of this
    # step ({row: (columns, vectors)}; DMax's soft embeddings, `Transformer.packed_logits`)
    embeds: dict | None = None
    # per row that decodes with a LoRA adapter, its index (`Transformer.lora`); other rows: the base
    adapters: dict | None = None
    # per row whose decoder chooses how its window attends, the length of the window's bidirectional
    # span from its block on (0: causal throughout; `Decoder.canvas`); other rows: the model's rule
    canvas: dict | None = None

    @property
    def width(self) -> int:
        """The widest row's logits: every row's are laid out (B, width, V) from its start (a
        narrower row's past its own width: nothing reads them)."""
        return max(self.widths, default=0)

    @property
    def block_size(self) -> int | dict[int, int] | None:
        """The rows' block length for the forward's masks: one for all, or per row where they
        differ (`Transformer.packed_logits`'s `block_size`)."""
        lengths = set(self.block_lengths)
        if len(lengths) > 1:
            return dict(enumerate(self.block_lengths))
        return next(iter(lengths), 0) or None

    def refresh(self, i: int) -> int:
        return self.refreshes[i] if self.refreshes else 1

    def end(self, i: int) -> int:
        """The last column (exclusive) a forward of row i must compute: what it sees, and at least
        its logits' columns (past its region: padding, whose logits nothing reads)."""
        return max(self.seen[i], self.starts[i] + self.widths[i])


class CachePolicy:
    """Which window of each row a step computes (`windows`), and nothing else: the forward of those
    windows, packed, graphed or not, with the re-forward a refresh rule's check asks for, is the
    runner's (`kv.runner.KVRunner.logits`), the same for every policy."""

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
    # Whether a step's windows may cover only part of a row's block (or no window for a row whose
    # block needs no logits): the rest of the row's logits are those of its last forward.
    partial_logits = False
    # Whether rows decoding in blocks of different lengths may share its steps (each row's windows
    # from its own block length).
    mixes_block_lengths = True
    # How its block-start windows refresh a row's cache (`refresh.RefreshRule`), whose check the
    # runner applies to the rows refreshed in part (`partial_refreshes`); None: no such rule.
    refresh = None

    def __init__(self, model):
        self.model = model
        # whether the decoder reveals each block's first position at its block-start step (set by
        # `policies.policies_for` from the decoder: `Decoder.reveals_first_at_block_start`)
        self.block_start_reveals_first = False

    @classmethod
    def from_config(cls, model, config) -> CachePolicy:
        return cls(model)

    def windows(self, seq: SequenceView, steps: list[int]) -> list[Window]:
        """What the policy recomputes at this step: each row's window, where row i has taken
        `steps[i]` steps in its block (0: the block begins). The one method a policy must have."""
        raise NotImplementedError

    def partial_refreshes(self, seq: SequenceView, steps: list[int]) -> list[int]:
        """The rows whose window this step refreshes their cache in part (the refresh rule's check
        may then ask for a full forward of them)."""
        return []

    def relayout(self, sources: list[int | None]) -> None:
        """The loop laid its rows out again: new row i is old row `sources[i]` (None: a row that
        just joined). A policy with state per row moves it here; the rows' pages move by
        themselves (`RowPages.relayout`)."""

    def full_window(self, seq: SequenceView, i: int) -> Window:
        """The whole row; at its first block, after what the prefix store gave it (as far as the
        first logit's column allows)."""
        lo = 0
        if seq.reused and seq.blocks[i] == 0:
            lo = min(seq.reused[i], seq.starts[i] - int(self.model.args.shifted_logits))
        return (i, max(0, lo), seq.end(i), seq.seen[i], seq.starts[i])


def register_cache_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Make `cls` a cache policy that configs name by `cls.name`; it is built by
    `cls.from_config(model, config)`."""
    return CACHE_POLICIES.register(cls)


def cache_policy(model, config) -> CachePolicy:
    """The policy a config names."""
    return CACHE_POLICIES[config.cache].from_config(model, config)
