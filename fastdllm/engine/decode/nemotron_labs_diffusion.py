"""Nemotron-Labs-Diffusion's proposal (its remote code's `_get_transfer_index` and the causal pass's
next-token draw)."""

from __future__ import annotations

import torch

from ..registry import PROPOSALS
from .proposals import Proposal


@PROPOSALS.register
class NemotronLabsDiffusionProposal(Proposal):
    """A block-start step's first position is the causal pass's prediction (the argmax of its
    logit, or at temperature T a draw from softmax(logit / T)); a later step proposes LLaDA's way
    (the argmax, or at temperature T the argmax of exp(logit) / (-log u)^T with u uniform in float64,
    drawn over the whole block), with the token's softmax probability in the logits' own dtype as
    its confidence, as the reference computes it."""

    name = "nemotron_labs_diffusion"
    model_dtype = True
    redraws = False  # one draw a step, as the reference's

    def __call__(self, logits, generators, draws, clock=None):
        temperature = self.config.temperature
        tokens = logits.argmax(-1)
        if temperature > 0 and draws is not None:  # (None: the best other token than [MASK], no draw)
            tokens = tokens.clone()
            for i, r in enumerate(draws):
                if r is None:
                    continue
                if clock is not None and clock.step[i] == 0:  # the causal pass's next token
                    probs = (logits[i, 0] / temperature).softmax(-1)
                    tokens[i, 0] = torch.multinomial(probs, 1, generator=generators[r])[0]
                else:
                    u = torch.rand(logits.shape[1:], generator=generators[r], dtype=torch.float64, device=logits.device)
                    tokens[i] = (logits[i].double().exp() / (-torch.log(u)) ** temperature).argmax(-1)
        conf = logits.softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, conf
