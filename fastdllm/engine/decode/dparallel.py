"""dParallel's entropy threshold (and d3LLM's, which shares it), d3LLM's lookahead over the blocks
after the current one and its early stop."""

from __future__ import annotations

import torch

from ..registry import SELECTION_RULES
from .lookahead import Lookahead
from .rules import SelectionRule, _and_the_most_confident
from .sampling import NEG_INF


@SELECTION_RULES.register
class EntropyThreshold(SelectionRule):
    """dParallel's rule (`get_transfer_index_entropy`; Dream's `alg="entropy_threshold"`): every
    masked position whose entropy is at most `threshold` (in nats), and always the one of lowest
    entropy. It reads the negative entropy as its confidence (`score`: the proposal computes it:
    LLaDA's form in float64 with log(p + 1e-12); Dream's, from the unfiltered logits in float32
    with log(p + 1e-8), strictly below the threshold). Ties go to the leftmost position, where the
    reference's `topk` leaves them to the device."""

    name = "entropy"
    score = "entropy"

    def __init__(self, threshold: float, strict: bool = False):
        self.threshold, self.strict = threshold, strict

    @classmethod
    def from_config(cls, config):  # the config has checked that it has a threshold (`config.rules`)
        return cls(config.threshold, strict=config.alg is not None)

    def select(self, conf, masked, clock, generators, draws):
        conf = conf.masked_fill(~masked, NEG_INF)
        chosen = masked & ((conf > -self.threshold) if self.strict else (conf >= -self.threshold))
        return _and_the_most_confident(chosen, conf, masked)


def fill_after_eos(window, revealed, view, asking) -> torch.Tensor:
    """d3LLM's early stop (`handle_early_stop`), as the positions it fills with EOS (B, W): once a
    row has revealed its EOS, every position of its window after the first one becomes EOS, revealed
    or masked; the masks before it are still decoded, and the row stops with the block that holds
    it (as `stop_at_eos`). Blocks past the window are never decoded: the row has stopped before they
    would be. Arguments as `llada2.stop_at_first_stop`'s."""
    hit = (window == view.eos_id) & revealed
    return ((hit.long().cumsum(-1) - hit.long()) > 0) & asking[:, None]  # strictly after the first


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

    early_stop = staticmethod(fill_after_eos)

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
