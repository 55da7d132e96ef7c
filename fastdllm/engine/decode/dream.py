"""Dream's decoding: its proposal (its `alg` scores, top-p / top-k) and its timestep schedule."""

from __future__ import annotations

import torch

from ..registry import SELECTION_RULES
from .proposals import Proposal
from .rules import BlockClock, SelectionRule, _top_k_mask
from .sampling import NEG_INF, draw_uniform, filter_top_p_top_k, sample_each


def _propose_dream(logits, config, generators, draws, score):
    if score == "unfiltered_entropy":  # dParallel's Dream: the entropy of the raw logits, log(p + 1e-8)
        p = logits.softmax(-1)
        raw = (p * torch.log(p + 1e-8)).sum(-1)
    if config.temperature > 0:
        logits = logits / config.temperature
    logits = filter_top_p_top_k(logits, config.top_p, config.top_k)
    probs = logits.softmax(-1)
    if config.temperature > 0:
        tokens = sample_each(probs, generators, draws)
        conf = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    else:
        conf, tokens = probs.max(-1)
    if score == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif score == "entropy":
        conf = (probs * torch.log(probs + 1e-10)).sum(-1)
    elif score == "unfiltered_entropy":
        conf = raw
    return tokens, conf


class DreamProposal(Proposal):
    """Dream's proposal; `score` is what the confidence is: "probability", "margin" or "entropy"."""

    def __init__(self, config, score: str):
        super().__init__(config)
        self.score = score

    def __call__(self, logits, generators, draws, clock=None):
        return _propose_dream(logits, self.config, generators, draws, self.score)


@SELECTION_RULES.register
class DreamSchedule(SelectionRule):
    name = "dream_schedule"
    uses_steps = True

    def __init__(self, alg: str, eps: float, alg_temp: float | None):
        self.alg, self.eps, self.alg_temp = alg, eps, alg_temp

    @classmethod
    def from_config(cls, config):
        return cls(config.alg or "maskgit_plus", config.eps, config.alg_temp)

    @staticmethod
    def draws_randomness(config) -> bool:
        return config.alg == "origin" or bool(config.alg_temp)

    def _times(self, clock: BlockClock) -> tuple[list[bool], torch.Tensor, torch.Tensor]:
        """Per row: whether this is its last step, and its t and s (Dream's timesteps
        linspace(1, eps, steps + 1) at its step and the next; 1 on a last step)."""
        steps, step, dev = clock.steps, clock.step, clock.opened.device
        last = [k >= n - 1 for k, n in zip(step, steps)]
        tables = {n: torch.linspace(1, self.eps, n + 1, device=dev) for n in set(steps)}
        one = torch.ones((), device=dev)
        t = torch.stack([one if e else tables[n][k] for e, k, n in zip(last, step, steps)])
        s = torch.stack([one if e else tables[n][k + 1] for e, k, n in zip(last, step, steps)])
        return last, t, s

    def select(self, conf, masked, clock, generators, draws):
        last, t, s = self._times(clock)
        last_t = torch.tensor(last, device=masked.device)
        if self.alg == "origin":
            drawing = [None if e else r for e, r in zip(last, draws)]
            u = draw_uniform(masked.shape[1:], generators, drawing, torch.float32, masked.device)
            return masked & ((u < (1 - s / t)[:, None]) | last_t[:, None])
        n_masked = masked.sum(-1)
        k = torch.where(last_t, n_masked, (n_masked.float() * (1 - s / t)).long())
        conf = conf.masked_fill(~masked, NEG_INF)
        if not self.alg_temp:
            return _top_k_mask(conf, k) & masked
        chosen = torch.zeros_like(masked)
        weights = (conf / self.alg_temp).softmax(-1)
        for i, r in enumerate(draws):
            if k[i] > 0 and r is not None:
                picked = torch.multinomial(weights[i], int(k[i]), replacement=False, generator=generators[r])
                chosen[i, picked] = True
        return chosen & masked
