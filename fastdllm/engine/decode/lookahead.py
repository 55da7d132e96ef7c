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

    # The early stop a row with `eos_early_stop` takes (`BlockDecoder.step`): LLaDA2.0's (a block
    # whose revealed stop token has no mask before it ends the row), unless the decoder whose
    # multi-block decoding this is fills its window after the first EOS (d3LLM's `handle_early_stop`).
    fills_after_eos = False

    def __init__(self, depth: int, add: float, activate: float, threshold: float):
        self.depth, self.add, self.activate, self.threshold = depth, add, activate, threshold

    @classmethod
    def from_config(cls, config, d3llm_code: str = "llada") -> Lookahead | None:
        """`d3llm_code`: which of d3LLM's codes the model family follows (`DecodingRules`)."""
        if config.parallel_blocks == 1:
            return None
        args = (config.parallel_blocks, config.block_add_threshold, config.decoded_token_threshold)
        if config.unmasking == "entropy":
            return EntropyLookahead(*args, config.threshold, keeps_lowest=d3llm_code == "llada")
        return cls(*args, config.lookahead_threshold)

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


class EntropyLookahead(Lookahead):
    """d3LLM's multi-block decoding (`generate_multi_block`), with the entropy rule
    (`unmasking="entropy"`) deciding the current block. A later block takes part once the block
    before it has `add` of its positions revealed (d3LLM's block_add_threshold, 0.1); it reveals
    every masked position of entropy at most `threshold` (the current block's, 0.5); and the one
    position of lowest entropy among all the blocks taking part is revealed wherever it is (d3LLM
    keeps it across blocks: in a later block when no position of the current one is as sure). The
    current block's own guaranteed position is d3LLM's forced token of its first fully activated
    block (that block is always the current one: the block before it is done), so
    `decoded_token_threshold` changes nothing here. Ties go to the leftmost position.

    `keeps_lowest=False` is d3LLM's Dream code (`_sample_multi_block`), which keeps no lowest
    position across blocks: a later block reveals only below the threshold. That code compares
    strictly below the threshold where its LLaDA code (and we, in both) reveal at it too: it differs
    only for an entropy equal to the threshold to the last bit of a float64."""

    fills_after_eos = True

    def __init__(self, depth: int, add: float, activate: float, threshold: float, keeps_lowest: bool = True):
        super().__init__(depth, add, activate, threshold)
        self.keeps_lowest = keeps_lowest

    def select(self, conf, masked, current_masked, current_conf):
        bsz, blk = current_masked.shape
        n = masked.shape[1] // blk
        m = masked.view(bsz, n, blk)
        done = 1 - torch.cat([current_masked[:, None], m[:, :-1]], 1).float().mean(-1)  # (B, n)
        active = ((done >= self.add).long().cumprod(-1).bool()[..., None] & m).view(bsz, n * blk)
        sure = active & (conf >= -self.threshold)
        if not self.keeps_lowest:
            return sure
        later = torch.where(active, conf, NEG_INF)
        best = later.argmax(-1, keepdim=True)
        here = torch.where(current_masked, current_conf, NEG_INF).max(-1, keepdim=True).values
        lowest = torch.zeros_like(active).scatter_(-1, best, True) & active & (later.gather(-1, best) > here)
        return sure | lowest
