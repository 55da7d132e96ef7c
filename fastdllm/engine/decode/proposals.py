"""Proposals: the token each masked position would take and its confidence, per family (LLaDA,
Dream, SDAR, DMax, Fast-dLLM v2, LLaDA2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import PROPOSALS
from .rules import SelectionRule
from .sampling import draw_uniform, filter_top_p_top_k, sample_each


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


class LLaDAProposal(Proposal):
    """LLaDA's proposal; `score`: "probability" (the token's) or "entropy" (the negative entropy)."""

    def __init__(self, config, score: str = "probability"):
        super().__init__(config)
        self.score = score

    def draws_randomness(self) -> bool:
        return self.config.temperature > 0 or self.config.remasking == "random"

    def __call__(self, logits, generators, draws, clock=None):
        return _propose_llada(logits, self.config, generators, draws, self.score)


class DreamProposal(Proposal):
    """Dream's proposal; `score` is what the confidence is: "probability", "margin" or "entropy"."""

    def __init__(self, config, score: str):
        super().__init__(config)
        self.score = score

    def __call__(self, logits, generators, draws, clock=None):
        return _propose_dream(logits, self.config, generators, draws, self.score)


@PROPOSALS.register
class SDARProposal(Proposal):
    """SDAR's sampling: logits / temperature; the token sampled from them after top-k / top-p
    filtering (greedy at temperature 0), its confidence read from the unfiltered softmax."""

    name = "sdar"

    def __call__(self, logits, generators, draws, clock=None):
        c = self.config
        if c.temperature > 0:
            logits = logits / c.temperature
        probs = logits.softmax(-1)
        if c.temperature > 0:
            tokens = sample_each(filter_top_p_top_k(logits, c.top_p, c.top_k).softmax(-1), generators, draws)
        else:
            tokens = probs.argmax(-1)
        return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class DMaxProposal(Proposal):
    """DMax's (dInfer's `get_transfer_index_uniform` with `_get_prob_stats`): the argmax at
    temperature 0, else LLaDA's Gumbel-max in float64; its probability as exp(logit - logsumexp)
    of the float32 logits."""

    def __call__(self, logits, generators, draws, clock=None):
        c = self.config
        if c.temperature > 0:
            noise = draw_uniform(logits.shape[1:], generators, draws, torch.float64, logits.device)
            tokens = (logits.double().exp() / (-torch.log(noise)) ** c.temperature).argmax(-1)
        else:
            tokens = logits.argmax(-1)
        lf = logits.float()
        conf = (lf.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lf, -1)).exp()
        return tokens, conf


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


@PROPOSALS.register
class LLaDA2Proposal(Proposal):
    """LLaDA2's `_sample_with_temperature_topk_topp`: logits divided by the temperature (unless it
    is 0 or 1), top-k then top-p filtered, the token drawn from their softmax, its probability
    there the confidence. *Deliberate difference*: the published LLaDA2.0 sampler draws with
    `multinomial` even at temperature 0, so its "greedy" default samples from softmax(logits);
    here temperature 0 is greedy (the argmax and its softmax probability; deterministic, as
    LLaDA2.1's own sampler does it), and the published draws are temperature=1."""

    name = "llada2"

    def __call__(self, logits, generators, draws, clock=None):
        c = self.config
        if c.temperature <= 0:
            probs = logits.softmax(-1)
            tokens = probs.argmax(-1)
        else:
            if c.temperature != 1:
                logits = logits / c.temperature
            probs = filter_top_p_top_k(logits, c.top_p, c.top_k).softmax(-1)
            tokens = sample_each(probs, generators, draws)
        return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def proposal_for(config, rule: type[SelectionRule], family_proposal: str | None = None) -> Proposal:
    """LLaDA's proposal without `alg`, Dream's with it. Only Dream's own schedule reads `alg` as
    a score: the parallel rules (threshold, factor) compare probabilities (Fast-dLLM's Dream
    "confidence_threshold"); a margin or a negative entropy is on another scale (an entropy score
    is never >= 0.9, so every step would reveal one token)."""
    if getattr(rule, "score", None) == "entropy":  # dParallel's entropy, in its LLaDA or Dream form
        return LLaDAProposal(config, "entropy") if config.alg is None else DreamProposal(config, "unfiltered_entropy")
    if getattr(rule, "score", None) == "logsumexp":
        return DMaxProposal(config)
    if getattr(rule, "proposal", None) is not None:  # a rule that comes with its reference's proposal
        return PROPOSALS[rule.proposal](config)
    if family_proposal is not None:
        return PROPOSALS[family_proposal](config)
    if config.alg is None:
        return LLaDAProposal(config)
    score = "probability"
    if rule.uses_steps:
        score = {"topk_margin": "margin", "entropy": "entropy"}.get(config.alg, "probability")
    return DreamProposal(config, score)
