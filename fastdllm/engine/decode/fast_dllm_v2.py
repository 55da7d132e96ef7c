"""Fast-dLLM v2's decoding: its proposal and its sub-blocks."""

from __future__ import annotations

import torch

from ..registry import PROPOSALS
from .proposals import Proposal
from .rules import SelectionRule
from .sampling import filter_top_p_top_k, sample_each


@PROPOSALS.register
class FastDLLMv2Proposal(Proposal):
    """Fast-dLLM v2's `sample_with_top_p`: greedy at temperature 0, with the softmax's probability
    as the confidence; else the token sampled from softmax(logits / temperature) after top-p
    truncation (renormalised), with its probability there as the confidence. In the model's dtype,
    as the reference computes it (bfloat16 for the released models)."""

    name = "fast_dllm_v2"

    model_dtype = True

    def __call__(self, logits, generators, draws, clock=None):
        c = self.config
        if c.temperature <= 0:
            probs = logits.softmax(-1)
            tokens = probs.argmax(-1)
        else:  # top-p truncated and renormalised: softmax over the logits that survive
            probs = filter_top_p_top_k(logits / c.temperature, c.top_p, None).softmax(-1)
            tokens = sample_each(probs, generators, draws)
        return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class SubBlocks(SelectionRule):
    """Fast-dLLM v2's small blocks: a block's positions are revealed sub-block by sub-block, left
    to right; the inner rule chooses among the masked positions of the first sub-block that still
    has any (its "always the most confident one" then applies within that sub-block)."""

    def __init__(self, inner: SelectionRule, size: int):
        self.inner, self.size = inner, size

    def select(self, conf, masked, clock, generators, draws):
        bsz, length = masked.shape
        sub = masked.view(bsz, length // self.size, self.size).any(-1)  # (B, sub-blocks) with masks
        current = sub.long().argmax(-1, keepdim=True)  # the first such sub-block
        index = torch.arange(length, device=masked.device) // self.size
        here = masked & (index[None, :] == current)
        return self.inner.select(conf, here, clock, generators, draws) & here
