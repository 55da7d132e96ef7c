"""Fast-dLLM v2's block cache: DualCache with sub-blocks."""

from __future__ import annotations

import torch

from ..registry import CACHE_POLICIES, REFRESH_RULES
from .prefix import DualCache


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
    partial_logits = True
    mixes_block_lengths = False  # a step's sub-blocks are found for every row at once

    def __init__(self, model, sub_block_length: int, **kwargs):
        super().__init__(model, **kwargs)
        self.sub_block_length = sub_block_length
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
        )

    def relayout(self, sources):
        self._uncached = [False if j is None else self._uncached[j] for j in sources]

    def windows(self, seq, steps):
        """The block-start rows' windows as DualCache's; the others' whole block or current
        sub-block (whose logits start at its own column: the rest of the row's block keeps those
        of its last forward)."""
        bsz, blk = len(steps), seq.block_lengths[0]  # one length: `mixes_block_lengths`
        if len(self._uncached) != bsz:  # rows laid out without `relayout` (a first batch)
            self._uncached = [False] * bsz
        size, shift, mask_id = self.sub_block_length, int(self.model.args.shifted_logits), self.model.mask_token_id
        starting = [i for i, k in enumerate(steps) if k == 0]
        opens = []
        if starting:
            firsts = seq.x[starting, [seq.starts[i] for i in starting]]
            opens = [bool(o) for o in (firsts == mask_id).tolist()]
        windows = []
        if len(starting) < bsz:
            idx = torch.tensor(seq.starts, device=seq.x.device)[:, None] + torch.arange(blk, device=seq.x.device)
            masked = seq.x.gather(1, idx) == mask_id
            opening = masked.view(bsz, -1, size).any(-1).long().argmax(-1) * size  # (B,) the current sub-block
            opens_masked = masked.gather(1, opening[:, None]).squeeze(1)
            flags = torch.stack([opening, opens_masked, masked.any(-1)]).tolist()
        for i in range(bsz):
            start = seq.starts[i]
            if steps[i] == 0:
                windows.append(self.start_window(seq, i))
                continue
            o, m, live = flags[0][i], flags[1][i], flags[2][i]
            if not live:  # a row whose block is done needs no logits
                continue
            if m or self._uncached[i]:
                windows.append((i, max(0, start - shift), start + blk, seq.seen[i], start))
                self._uncached[i] = False
            else:
                sub = start + o
                windows.append((i, sub, sub + size, seq.seen[i], sub + shift))
        for i, o in zip(starting, opens):
            self._uncached[i] = o and self._first_at_start
        return windows
