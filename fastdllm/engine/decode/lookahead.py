"""Multi-block decoding: the blocks after the current one, decoded by a lookahead rule
(Fast-dLLM-style thresholds, d3LLM's entropy form)."""

from __future__ import annotations

import torch

from .sampling import NEG_INF


class Lookahead:
    """Multi-block decoding, after D2F's pipelined block decoding: the blocks after the current one
    (up to `depth` blocks in all) are decoded in the same forwards while the current one is being
    finished, which the loop's selection rule alone decides. Each step, for block j after the
    current one, read before the step reveals anything:
    - it takes part once the block before it has at least `add` of its positions revealed (and
      that block takes part), as D2F adds a block;
    - it reveals every masked position whose confidence is strictly above `threshold` (D2F's
      skip_threshold), stricter than the current block's rule;
    - once the block before it has at least `activate` revealed (D2F's "complete" state), it also
      reveals its single most confident masked position when none is above the threshold.
    *Deliberate difference*: D2F keeps decoding any number of blocks, each until it is done, and
    commits the finished prefix to its cache when its blocks end; here the current block is the
    loop's and decides when the window moves on (then the exact cache commit runs as for one
    block), and at most `depth` blocks take part."""

    # the early stop of the decoder whose multi-block decoding this is (`Decision.fill`); None: the
    # masked decoder's own (LLaDA2.0's)
    early_stop = None

    def __init__(self, depth: int, add: float, activate: float, threshold: float):
        self.depth, self.add, self.activate, self.threshold = depth, add, activate, threshold

    def select(
        self, conf: torch.Tensor, masked: torch.Tensor, current_masked: torch.Tensor, current_conf: torch.Tensor
    ) -> torch.Tensor:
        """(B, n * block_length) True where a later block reveals, for the confidences and masks
        of the n blocks after the current one and the current block's masks and confidences (B,
        block_length)."""
        bsz, blk = current_masked.shape
        n = masked.shape[1] // blk
        m, c = masked.view(bsz, n, blk), conf.view(bsz, n, blk)
        # each block's predecessor's revealed fraction: the current block's, then the later ones'
        done = 1 - torch.cat([current_masked[:, None], m[:, :-1]], 1).float().mean(-1)  # (B, n)
        active = (done >= self.add).long().cumprod(-1).bool()
        sure = m & (c > self.threshold) & active[..., None]
        best = torch.where(m, c, NEG_INF).argmax(-1, keepdim=True)
        forced = (active & (done >= self.activate) & m.any(-1) & ~sure.any(-1))[..., None] & (
            torch.arange(blk, device=m.device) == best
        )
        return (sure | forced).view(bsz, n * blk)
