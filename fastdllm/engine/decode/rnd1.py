"""RND1's decoding (`rnd/sampling.py`'s `diffusion_sample`): its proposal and its selection rule,
registered by name (`registry.PROPOSALS`, `registry.SELECTION_RULES`: "rnd1"), and the token its
reference closes the answer with."""

from __future__ import annotations

import torch

from ..registry import PROPOSALS, SELECTION_RULES
from .proposals import Proposal
from .rules import SelectionRule
from .sampling import NEG_INF


def closing_tokens(model) -> tuple[int, ...]:
    """The token a family's reference places after the answer and any suffix (RND1's pad:
    `DecodingRules.closing_token`), which every forward sees as it sees a suffix; () for a family
    without one."""
    rule = model.family.rules.closing_token
    if rule is None:
        return ()
    key, default = rule
    token = model.config.get(key)
    token = default if token is None else token
    if not 0 <= token < model.args.vocab_size:
        raise ValueError(f"{key}: {token} is not a token of this model (vocabulary of {model.args.vocab_size})")
    return (token,)


def _rnd1_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """RND1's top-k filter: exactly the k largest (by `topk`) kept, the rest -inf."""
    values, indices = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return torch.full_like(logits, NEG_INF).scatter_(-1, indices, values)


def _rnd1_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """RND1's nucleus filter: a token goes once the probability before it (sorted, descending)
    exceeds p; the most likely always stays."""
    sorted_logits, order = logits.sort(descending=True, dim=-1)
    drop = sorted_logits.softmax(-1).cumsum(-1) > p
    drop[..., 0] = False
    drop[..., 1:] = drop[..., :-1].clone()
    return logits.masked_fill(drop.scatter(-1, order, drop), NEG_INF)


@PROPOSALS.register
class RND1Proposal(Proposal):
    """RND1's `forward_scores`, in the model's dtype as there: the logits divided by the temperature
    (at least 1e-8: temperature 0 is its greedy mode), top-k then top-p filtered, their
    log-softmax; the token its argmax when greedy, else drawn as `Categorical(logits=...).sample()`
    draws it; the confidence the negative entropy -sum p log p (`RND1Schedule` ranks by it).

    The reference samples every position of its sequence at once, prompt and suffix included, from
    one random stream: one `multinomial` whose exponential draws cover (sequence, vocabulary). We
    draw that same tensor from the row's generator and read the rows of the block's positions (the
    logit before each, the logits being shifted), so that a row's tokens are the reference's under
    the same seed. *Deliberate difference*: where the draw picks [MASK], the reference reveals it
    as a token (and the answer keeps it); we take the most likely other token, drawing nothing
    more, so the row's stream stays the reference's."""

    name = "rnd1"

    model_dtype = True
    redraws = False

    def __call__(self, logits, generators, draws, clock=None):
        c = self.config
        scaled = logits / max(c.temperature, 1e-8)
        if c.top_k is not None and c.top_k > 0:
            scaled = _rnd1_top_k(scaled, c.top_k)
        if c.top_p is not None and 0 < c.top_p < 1:
            scaled = _rnd1_top_p(scaled, c.top_p)
        logp = scaled.log_softmax(-1)
        tokens = logp.argmax(-1)
        if c.temperature > 0 and draws is not None:  # without draws: the most likely token
            if clock is None or clock.starts is None:
                raise ValueError("temperature: RND1's sampling draws over each row's whole sequence (the loop's)")
            for i, r in enumerate(draws):
                if r is None:
                    continue
                normalized = logp[i] - logp[i].logsumexp(-1, keepdim=True)  # as Categorical keeps them
                probs = normalized.softmax(-1)
                q = torch.empty((clock.extents[i], logp.shape[-1]), dtype=probs.dtype, device=probs.device)
                q.exponential_(1, generator=generators[r])
                first = clock.starts[i] - 1  # the logit that predicts the block's first position
                tokens[i] = (probs / q[first : first + logp.shape[1]]).argmax(-1)
        p = logp.exp()
        return tokens, (p * logp).sum(-1)


@SELECTION_RULES.register
class RND1Schedule(SelectionRule):
    """RND1's (`rnd/sampling.py`, `diffusion_sample`): after step i of a block's N steps, the
    floor(n (N - 1 - i) / N) masked positions of highest entropy stay masked, n being the block's
    masks when it began, and every other masked position is revealed (all of them at the last
    step). The count is the reference's own float32 product, truncated; the positions kept are
    its `topk` over the whole sequence's entropies (every position not masked at -max), so that
    ties (every entropy is 0 when greedy: the reference divides by a temperature of 1e-8) fall as
    they fall there. The entropy is the proposal's (`RND1Proposal`, the negative of its
    confidence)."""

    name = "rnd1"
    proposal = "rnd1"
    uses_steps = True

    def select(self, conf, masked, clock, generators, draws):
        if clock.starts is None or clock.extents is None:
            raise ValueError("unmasking: the rnd1 rule ranks over each row's whole sequence (the decoding loop's)")
        chosen = masked.clone()
        lowest = -torch.finfo(conf.dtype).max
        for i, (step, steps) in enumerate(zip(clock.step, clock.steps)):
            if step >= steps - 1:
                continue
            kept = int((clock.opened[i : i + 1] * ((steps - 1 - step) / steps)).long())
            if kept <= 0:
                continue
            scores = torch.full((1, clock.extents[i]), lowest, dtype=conf.dtype, device=conf.device)
            start = clock.starts[i]
            scores[0, start : start + conf.shape[1]] = (-conf[i]).masked_fill(~masked[i], lowest)
            keep = scores.topk(kept, dim=-1, largest=True).indices[0, :kept] - start
            chosen[i, keep] = False
        return chosen & masked
