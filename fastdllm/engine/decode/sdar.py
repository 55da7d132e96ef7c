"""SDAR's decoding: its proposal and its per-step quota of reveals."""

from __future__ import annotations

import torch

from ..registry import PROPOSALS, SELECTION_RULES
from .proposals import Proposal
from .rules import SelectionRule, _top_k_mask, linear_schedule_at
from .sampling import NEG_INF, filter_top_p_top_k, sample_each


@PROPOSALS.register
class SDARProposal(Proposal):
    """SDAR's sampling: logits / temperature; the token sampled from them after top-k / top-p
    filtering (greedy at temperature 0), its confidence read from the unfiltered softmax."""

    name = "sdar"

    def __call__(self, logits, generators, draws, clock=None):
        c = self.config
        if c.temperature > 0:
            logits = logits / c.temperature
        probs = logits.softmax(-1)
        if c.temperature > 0:
            tokens = sample_each(filter_top_p_top_k(logits, c.top_p, c.top_k).softmax(-1), generators, draws)
        else:
            tokens = probs.argmax(-1)
        return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@SELECTION_RULES.register
class Quota(SelectionRule):
    """SDAR's `block_diffusion_generate` ("low_confidence_dynamic"; "static" without a threshold):
    step i of a block has a quota k_i, the *block length* (not its masks) split evenly over the
    block's steps, the remainder to the first ones. With a threshold, every masked position whose
    confidence is strictly above it is revealed if there are at least k_i of them; otherwise (and
    without a threshold) the k_i most confident (fewer if fewer are masked). The confidence is
    the probability of the proposed token before top-k / top-p filtering (`SDARProposal`, SDAR's
    family proposal)."""

    name = "quota"
    uses_steps = True

    def __init__(self, threshold: float | None):
        self.threshold = threshold

    @classmethod
    def from_config(cls, config):
        return cls(config.threshold)

    def select(self, conf, masked, clock, generators, draws):
        length = torch.full_like(clock.step_t, masked.shape[-1])
        k = torch.minimum(linear_schedule_at(length, clock, masked), masked.sum(-1))
        conf = conf.masked_fill(~masked, NEG_INF)
        chosen = _top_k_mask(conf, k)
        if self.threshold is not None:
            high = masked & (conf > self.threshold)
            chosen = torch.where((high.sum(-1) >= k).unsqueeze(-1), high, chosen)
        return chosen & masked
