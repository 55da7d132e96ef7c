"""Fast-dLLM's parallel decoding rules: a confidence threshold and the factor rule, and its cached
Dream loops' block start (the block's first position revealed by the block-start forward)."""

from __future__ import annotations

import torch

from ..registry import SELECTION_RULES
from .rules import OneParameterRule, SelectionRule, _and_the_most_confident, _top_k_mask
from .sampling import NEG_INF


@SELECTION_RULES.register
class Threshold(OneParameterRule):
    name = "threshold"

    def select(self, conf, masked, clock, generators, draws):
        conf = conf.masked_fill(~masked, NEG_INF)
        return _and_the_most_confident(masked & (conf >= self.threshold), conf, masked)


@SELECTION_RULES.register
class Factor(OneParameterRule):
    name = "factor"
    parameter = "factor"

    def select(self, conf, masked, clock, generators, draws):
        conf = conf.masked_fill(~masked, NEG_INF)
        sorted_conf = conf.sort(dim=-1, descending=True, stable=True).values
        rank = torch.arange(1, conf.shape[-1] + 1, device=conf.device, dtype=conf.dtype)  # m = 1, 2, ...
        passes = sorted_conf >= 1 - self.factor / (rank + 1)
        passes[..., 0] = True  # always at least one
        count = passes.long().cumprod(-1).sum(-1)
        count = torch.minimum(count, masked.sum(-1))
        return _top_k_mask(conf, count) & masked


class FirstPositionAtBlockStart(SelectionRule):
    """The block-start step reveals exactly the block's first position, whatever the rule; the
    rule decides the steps after it (a schedule counts the block-start step as its step 0).
    Fast-dLLM's Dream with a block cache does this; so does Fast-dLLM v2 always: its first token
    of a block is the argmax of the previous block's last logit, read by the forward that commits
    that block. A row whose block opens with prompt tokens (`rows.Row.lead`) has no such
    token to reveal: the rule decides its block-start step too."""

    def __init__(self, inner: SelectionRule):
        self.inner = inner

    def select(self, conf, masked, clock, generators, draws):
        first = torch.zeros_like(masked)
        first[:, 0] = True
        if not any(k == 0 for k in clock.step):
            return self.inner.select(conf, masked, clock, generators, draws)
        opens = [bool(o) and k == 0 for o, k in zip(masked[:, 0].tolist(), clock.step)]
        if all(opens):  # the inner rule is not asked (it draws nothing at this step)
            return first & masked
        if not any(opens):
            return self.inner.select(conf, masked, clock, generators, draws)
        # a row that reveals its first position draws nothing from the inner rule
        drawing = None if draws is None else [None if o else r for o, r in zip(opens, draws)]
        inner = self.inner.select(conf, masked, clock, generators, drawing)
        return torch.where(torch.tensor(opens, device=masked.device)[:, None], first, inner) & masked
