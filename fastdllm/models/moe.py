"""A mixture of SwiGLU experts with a router, computed without a Python loop over experts.

Routing, LLaDA2's (BailingMoeV2, DeepSeek-V3's scheme): the router's logits from float32
inputs; scores = their sigmoid; the experts are *chosen* by the scores plus a per-expert bias
(`router_bias`), within the best `active_expert_groups` of `n_expert_groups` groups (a group's
score is the sum of its two best scores), top `n_active_experts`; their *weights* are the
un-biased scores of the chosen experts, divided by their sum (`normalize_expert_weights`, with
more than one expert) and times `routed_scaling`; the weighted sum of the experts' outputs is
taken in float32 and cast back. LLaDA-MoE's (OLMoE's): logits in the model's dtype
(`router_in_float32=False`), scores = their softmax in float32, top-k of them (with the bias,
where enabled, in the weights too: `bias_in_weights`), not normalised, and the weighted sum in
the model's dtype (`combine_in_float32=False`). Then the shared experts' MLP is added.

Expert compute: the (token, expert) pairs are sorted by expert and each expert's tokens go
through one grouped matrix multiply (`torch.nn.functional.grouped_mm`, jagged groups given by
offsets computed on the device), so a forward never waits on the host for routing (no `.item()`,
`.tolist()`, `nonzero` or data-dependent shapes). Where grouped_mm cannot run (CUDA without
bfloat16, or widths whose rows are not 16-byte aligned) each pair gathers its expert's weights
and the pairs go through one batched matmul: the same arithmetic, more memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .mlp import FeedForward


def route(logits: torch.Tensor, args: ModelArgs, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen experts (N, k) and their weights (N, k, float32) from router logits (N, E) in float32."""
    scores = torch.sigmoid(logits) if args.router_score == "sigmoid" else logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()
    n, e = choice.shape
    if args.n_expert_groups > 1:
        groups = choice.view(n, args.n_expert_groups, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(args.active_expert_groups, dim=-1, sorted=False).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // args.n_expert_groups, dim=1), float("-inf"))
    chosen = choice.topk(args.n_active_experts, dim=-1).indices
    weights = (choice if args.bias_in_weights else scores).gather(1, chosen)
    if args.normalize_expert_weights and args.n_active_experts > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return chosen, weights * args.routed_scaling


def _grouped_mm_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all(w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in weights)


@torch.compiler.disable
def _grouped_mm_eager(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grouped_mm run eagerly inside a compiled function: its traced form takes bfloat16 alone,
    where the CPU's kernel also takes float32."""
    return F.grouped_mm(x, weight, offs=offsets)


def expert_linear(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor, grouped: bool | None
) -> torch.Tensor:
    """Row r of `x` (sorted by expert) times expert `experts[r]`'s weight (E, out, in), transposed.
    grouped: one grouped matmul (True), one batched matmul of gathered weights (False), or, for
    training (None: grouped_mm has no backward here), a slice per expert (a host sync per call)."""
    if grouped:
        if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
            return _grouped_mm_eager(x, weight.transpose(-2, -1), offsets)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if grouped is None:
        bounds = [0] + offsets.tolist()
        return torch.cat([x[a:b] @ weight[e].T for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    return torch.bmm(weight[experts], x.unsqueeze(-1)).squeeze(-1)


class MoEFeedForward(nn.Module):
    """The routed experts (stacked: w1, w3, w2 of shape (E, ...)) and the shared expert. Under expert
    parallelism (`models.tp`) a module holds experts [first_expert, first_expert + w1.shape[0])
    and `dispatch` may be replaced by one that sends tokens to the ranks holding their experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        e, h, d = args.n_experts, args.moe_hidden_dim, args.dim
        self.router = nn.Linear(d, e, bias=False)
        if args.router_bias:
            self.register_buffer("expert_bias", torch.zeros(e))
        self.w1 = nn.Parameter(torch.empty(e, h, d))  # gate, per expert (out, in) as nn.Linear stores it
        self.w3 = nn.Parameter(torch.empty(e, h, d))  # up
        self.w2 = nn.Parameter(torch.empty(e, d, h))  # down
        for w in (self.w1, self.w3, self.w2):
            nn.init.kaiming_uniform_(w.view(-1, w.shape[-1]), a=5**0.5)
        self.shared = FeedForward(args, args.shared_expert_hidden_dim) if args.shared_expert_hidden_dim else None
        self.first_expert = 0
        self.dispatch = self.experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat_x = x.reshape(-1, shape[-1])
        if self.args.router_in_float32:
            logits = F.linear(flat_x.float(), self.router.weight.float())
        else:
            logits = self.router(flat_x).float()
        chosen, weights = route(logits, self.args, getattr(self, "expert_bias", None))
        y = self.dispatch(flat_x, chosen, weights).view(shape)
        return y if self.shared is None else y + self.shared(x)

    def experts(self, flat_x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(N, dim): each token's chosen experts' outputs, weighted and summed; a pair whose expert
        this module does not hold adds nothing."""
        k = chosen.shape[1]
        held = self.w1.shape[0]
        pairs = chosen.reshape(-1) - self.first_expert
        everything = held == self.args.n_experts
        local = None if everything else (pairs >= 0) & (pairs < held)
        if local is not None:
            pairs = torch.where(local, pairs, held)  # sorted after every expert held here
        out = self.pair_outputs(flat_x, pairs, k)
        if local is not None:
            out = torch.where(local[:, None], out, 0)
        return self.combine(out, weights, flat_x.dtype)

    def pair_outputs(self, x: torch.Tensor, experts: torch.Tensor, per_row: int = 1) -> torch.Tensor:
        """Pair r (row r // per_row of `x`) through expert `experts[r]` of those held here; pairs
        whose expert index is past them (`w1.shape[0]`) get undefined values."""
        held = self.w1.shape[0]
        order = experts.argsort(stable=True)
        sorted_experts = experts[order]
        rows = x[order // per_row]
        counts = torch.zeros(held + 1, dtype=torch.int32, device=x.device)
        counts.index_add_(0, experts, torch.ones_like(experts, dtype=torch.int32))
        if self.training:
            self.load = counts[:held]  # for the trainer's expert-bias balancing (`train.balance_experts`)
        offsets = counts[:held].cumsum(0, dtype=torch.int32)
        grouped = None if torch.is_grad_enabled() and self.w1.requires_grad else _grouped_mm_ok(rows, self.w1, self.w2)
        clamped = sorted_experts.clamp(max=held - 1)
        h = F.silu(expert_linear(rows, self.w1, offsets, clamped, grouped)) * expert_linear(
            rows, self.w3, offsets, clamped, grouped
        )
        ys = expert_linear(h, self.w2, offsets, clamped, grouped)
        out = torch.empty_like(ys)
        out[order] = ys
        return out

    def combine(self, out: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
        """(N, dim) from the pairs' outputs (N * k, dim) and their weights (N, k)."""
        k, dim = weights.shape[1], out.shape[-1]
        if self.args.combine_in_float32:
            return (out.view(-1, k, dim).float() * weights.unsqueeze(-1)).sum(1).to(dtype)
        return (out.view(-1, k, dim) * weights.to(dtype).unsqueeze(-1)).sum(1)
