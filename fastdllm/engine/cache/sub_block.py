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
        self._places: list[tuple[int, int]] = []  # per window of the step: its row, its block column
        self._opening: list[tuple[int, bool]] = []  # block-start rows: whether their block opens masked

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

    def windows(self, seq, steps):
        """The block-start rows' windows as DualCache's; the others' whole block or current
        sub-block, each with the column of the block where its logits go (`_places`)."""
        bsz, blk = len(steps), seq.block_length
        size, shift, mask_id = self.sub_block_length, int(self.model.args.shifted_logits), self.model.mask_token_id
        starting = [i for i, k in enumerate(steps) if k == 0]
        opens = []
        if starting:
            firsts = seq.x[starting, [seq.starts[i] for i in starting]]
            opens = [bool(o) for o in (firsts == mask_id).tolist()]
        self._opening = list(zip(starting, opens))
        windows, self._places = [], []
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
                self._places.append((i, 0))
                continue
            o, m, live = flags[0][i], flags[1][i], flags[2][i]
            if not live:  # a row whose block is done needs no logits
                continue
            if m or self._uncached[i]:
                windows.append((i, max(0, start - shift), start + blk, seq.seen[i], start))
                self._places.append((i, 0))
                self._uncached[i] = False
            else:
                sub = start + o
                windows.append((i, sub, sub + size, seq.seen[i], sub + shift))
                self._places.append((i, o + shift))
        return windows

    def block_logits(self, seq, steps):
        """The windows' logits written into each row's latest logits of its block."""
        bsz, blk = len(steps), seq.block_length
        parts = self.forward(seq, self.windows(seq, steps))
        if self._logits is None or self._logits.shape[0] != bsz:
            self._logits = parts[0].new_zeros((bsz, blk, parts[0].shape[-1]))
            self._uncached = [False] * bsz
        for (i, at), out in zip(self._places, parts):
            width = min(out.shape[0], blk - at)
            self._logits[i, at : at + width] = out[:width].to(self._logits.dtype)
        for i, o in self._opening:
            self._uncached[i] = o and self._first_at_start
        return self._logits.clone()
