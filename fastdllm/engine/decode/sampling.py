"""The draws every row makes from its own generator, and the top-k / top-p filter."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def draw_uniform(shape, generators, draws, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Uniform draws, row i from generators[draws[i]]. A row drawing None takes no part in this
    draw (its rule reveals by another way at this step): it draws nothing and gets 0.5, so that its
    stream advances exactly as when it is decoded alone."""
    out = torch.full((len(draws),) + tuple(shape), 0.5, dtype=dtype, device=device)
    for i, r in enumerate(draws):
        if r is not None:
            out[i] = torch.rand(shape, generator=generators[r], dtype=dtype, device=device)
    return out


def filter_top_p_top_k(logits, top_p, top_k):
    """Logits with the tokens outside top-k and outside the top-p nucleus set to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), NEG_INF)
    return logits


def sample_each(probs, generators, draws) -> torch.Tensor:
    """A token per position from `probs` (B, T, V), each row with its own generator; a row without
    one (None: nothing to reveal, it draws nothing) takes the argmax."""
    return torch.stack(
        [
            probs[i].argmax(-1)
            if r is None
            else torch.multinomial(probs[i].float(), 1, generator=generators[r]).squeeze(-1)
            for i, r in enumerate(draws)
        ]
    )
