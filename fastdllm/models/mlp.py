"""The dense SwiGLU MLP (gate, up, down), as every family's layers and shared experts use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden_dim: int | None = None):
        super().__init__()
        hidden_dim = hidden_dim or args.hidden_dim
        self.w1 = nn.Linear(args.dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
