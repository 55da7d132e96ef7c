"""Proposals: the token each masked position would take and its confidence, per family (LLaDA,
Dream, SDAR, DMax, Fast-dLLM v2, LLaDA2)."""

from __future__ import annotations

import torch


# ---- proposals -----------------------------------------------------------------------------------
class Proposal:
    """The token proposed at each position and its confidence, for logits (B, T, V) in float32, or
    in the model's dtype where `model_dtype` (a reference that computes them so)."""

    model_dtype = False
    # Where a sampled token is the mask: whether the best other token is drawn again (False: the
    # most likely other token, drawing nothing, so the stream stays the reference's one draw a step).
    redraws = True

    def __init__(self, config):
        self.config = config

    def draws_randomness(self) -> bool:
        return self.config.temperature > 0

    def __call__(self, logits, generators, draws, clock=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`clock`: where each row stands (`BlockClock`), for a proposal that needs it."""
        raise NotImplementedError
