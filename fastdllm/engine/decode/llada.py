"""LLaDA's decoding: its proposal (Gumbel-max in float64, float64 confidences) and its linear
schedule of reveals per step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import SELECTION_RULES
from .proposals import Proposal
from .rules import SelectionRule, _top_k_mask, linear_schedule_at
from .sampling import NEG_INF, draw_uniform


# ---- proposals ---------------------------------------------------------------------------------
def _propose_llada(logits, config, generators, draws, score="probability"):
    if config.temperature > 0:
        # Gumbel-max in float64 (LLaDA's add_gumbel_noise): argmax of exp(l) / (-log u)^temperature.
        l64 = logits.double()
        noise = draw_uniform(logits.shape[1:], generators, draws, torch.float64, logits.device)
        tokens = (l64.exp() / (-torch.log(noise)) ** config.temperature).argmax(-1)
    else:
        tokens = logits.argmax(-1)
    if config.remasking == "random":
        conf = draw_uniform(logits.shape[1:2], generators, draws, torch.float32, logits.device)
    elif score == "entropy":  # dParallel's and d3LLM's LLaDA form: float64, log(p + 1e-12)
        p = F.softmax(logits.double(), -1)
        conf = (p * torch.log(p + 1e-12)).sum(-1)  # the negative entropy: higher is surer
    else:  # the reference's float64 softmax, in its form: its rounding ranks near-certain positions
        conf = F.softmax(logits.double(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, conf


class LLaDAProposal(Proposal):
    """LLaDA's proposal; `score`: "probability" (the token's) or "entropy" (the negative entropy)."""

    def __init__(self, config, score: str = "probability"):
        super().__init__(config)
        self.score = score

    def draws_randomness(self) -> bool:
        return self.config.temperature > 0 or self.config.remasking == "random"

    def __call__(self, logits, generators, draws, clock=None):
        return _propose_llada(logits, self.config, generators, draws, self.score)


@SELECTION_RULES.register
class LinearSchedule(SelectionRule):
    name = "linear"
    uses_steps = True

    def select(self, conf, masked, clock, generators, draws):
        k = linear_schedule_at(clock.opened, clock, masked)  # the masks at the block's start, split
        return _top_k_mask(conf.masked_fill(~masked, NEG_INF), k) & masked
