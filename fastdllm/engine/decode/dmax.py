"""DMax's decoding (its vendored dInfer): its proposal and its left-to-right rule."""

from __future__ import annotations

import torch

from ..registry import SELECTION_RULES
from .proposals import Proposal
from .rules import OneParameterRule
from .sampling import draw_uniform


class DMaxProposal(Proposal):
    """DMax's (dInfer's `get_transfer_index_uniform` with `_get_prob_stats`): the argmax at
    temperature 0, else LLaDA's Gumbel-max in float64; its probability as exp(logit - logsumexp)
    of the float32 logits."""

    def __call__(self, logits, generators, draws, clock=None):
        c = self.config
        if c.temperature > 0:
            noise = draw_uniform(logits.shape[1:], generators, draws, torch.float64, logits.device)
            tokens = (logits.double().exp() / (-torch.log(noise)) ** c.temperature).argmax(-1)
        else:
            tokens = logits.argmax(-1)
        lf = logits.float()
        conf = (lf.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lf, -1)).exp()
        return tokens, conf


@SELECTION_RULES.register
class LeftToRight(OneParameterRule):
    """DMax's rule (dInfer's `get_transfer_index_uniform`): the block's masked positions, left to
    right, up to the first whose confidence is below `threshold`; when the leftmost is already
    below it, the leftmost alone. The confidence is the proposed token's probability in DMax's
    float32 form, exp(logit - logsumexp) (`score`, `DMaxProposal`)."""

    name = "left_to_right"
    score = "logsumexp"

    def select(self, conf, masked, clock, generators, draws):
        low = masked & (conf < self.threshold)
        candidates = masked & (low.long().cumsum(-1) == 0)
        first = masked & (masked.long().cumsum(-1) == 1)
        return torch.where(candidates.any(-1, keepdim=True), candidates, first)
