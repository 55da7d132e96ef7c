"""What every cache policy is: the windows it computes of each row (`windows`), one packed
forward of them over the rows' pages (`forward`), and the logits of every row's block from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.rows import RowPages, Window
from ..registry import CACHE_POLICIES


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
        # whether the loop's strategy reveals each block's first position at its block-start step
        # (set by the loop: `UnmaskingStrategy.reveals_first_at_block_start`)
        self.block_start_reveals_first = False

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

    def windows(self, seq: SequenceView, steps: list[int]) -> list[Window]:
        """What the policy recomputes at this step: each row's window, where row i has taken
        `steps[i]` steps in its block (0: the block begins). The one method a policy must have."""
        raise NotImplementedError

    def block_logits(self, seq: SequenceView, steps: list[int]) -> torch.Tensor:
        """Logits (B, seq.width, V) of every row's current block (and the blocks after it, up to
        the width): the policy's windows in one packed forward."""
        return self.stack(seq, self.forward(seq, self.windows(seq, steps)))

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


def register_cache_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Make `cls` a cache policy that configs name by `cls.name`; it is built by
    `cls.from_config(model, config)`."""
    return CACHE_POLICIES.register(cls)


def cache_policy(model, config) -> CachePolicy:
    """The policy a config names, with the config's engine settings (`configure`)."""
    return configure(CACHE_POLICIES[config.cache].from_config(model, config), config)


def configure(policy: CachePolicy, config) -> CachePolicy:
    """The settings a config gives every policy alike, whether it names the policy or a caller
    passed the object (`policies.Policies`): batch-invariant forwards with `config.deterministic`,
    CUDA graphs. (Pages and prefix sharing are the loop's, for every policy: `kv.rows.RowPages`.)"""
    policy.batch_invariant = config.deterministic
    policy.graphs = config.cuda_graphs
    return policy
