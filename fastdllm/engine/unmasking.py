"""Unmasking policies: given the current block's logits, which masked positions become tokens.

An `UnmaskingStrategy` is one policy, built once from a config (`UnmaskingStrategy.from_config`)
and passed to the loop. Two separate choices make it, each an object:

1. **Proposal and confidence** (a `Proposal`: `LLaDAProposal` or `DreamProposal`): the token
   proposed for each masked position and a confidence score.
   - LLaDA (`alg=None`): argmax of the logits, with Gumbel-max noise in float64 when
     temperature > 0; confidence = softmax probability of the proposed token
     (`remasking='low_confidence'`) or uniform noise (`remasking='random'`).
   - Dream (`alg` = 'origin' | 'maskgit_plus' | 'topk_margin' | 'entropy'): tokens sampled from
     softmax(logits / temperature) (argmax at temperature 0, after optional top-p / top-k);
     confidence = that token's probability (maskgit_plus, and origin when combined with a
     threshold), top-1 minus top-2 probability (topk_margin), or negative entropy (entropy).
     With a threshold or factor rule the confidence is always the token's probability, whatever
     `alg` says: those rules are defined on probabilities, as in Fast-dLLM's Dream code.
2. **How many / which** (a `SelectionRule`, registered by name in `registry.SELECTION_RULES`; which one a
   config means is `config.selection_rule_name`, the one statement of the precedence
   unmasking > factor > threshold > schedule; a new rule is one class and
   `register_selection_rule`):
   - `Threshold` (Fast-dLLM): every masked position with confidence >= threshold, and always at
     least the most confident one.
   - `Factor` (Fast-dLLM, Theorem 1): sort confidences c_1 >= c_2 >= ...; take the top n for the
     largest n such that c_m >= 1 - factor / (m + 1) for every m <= n, i.e. (m + 1)(1 - c_m) <=
     factor; always at least one. *Deliberate difference*: the reference code also takes every
     token when the first failing rank is the last one (an off-by-one in its loop); we take
     exactly the ranks that pass, as the paper's rule says.
   - `LinearSchedule` (LLaDA): step i of a block unmasks the k_i most confident positions, the
     block's masks split evenly over its steps, the remainder going to the first steps.
   - `Quota` (SDAR): step i's quota is the block length split over the block's steps; every
     masked position strictly above the threshold if they fill the quota, else the quota's
     top-k; with SDAR's models, confidences from the unfiltered probabilities (`SDARProposal`).
   - `DreamSchedule` (Dream): timesteps linspace(1, eps, steps + 1); step i unmasks
     int(n_masked * (1 - s / t)) positions (all of them at the last step), by top-k confidence or,
     with `alg_temp` > 0, sampled from softmax(confidence / alg_temp). With alg='origin' each
     masked position is instead revealed independently with probability 1 - s / t.
     *Deliberate difference*: Dream averages the mask count over the batch; we count per row, so
     that a row decodes the same in a batch as alone.

Ties in confidence are broken towards the leftmost position. LLaDA's confidence (the proposed
token's softmax probability) is computed in float64, as the reference does: it decides a top-k
ranking, and confident positions that tie in float32 (0.99999237 for several at once) are
ordered by their float64 values, as there. It is the reference's own expression (softmax in
float64, gathered at the token), not the equal-in-exact-arithmetic exp(logit - logsumexp): the two
round near-certain probabilities differently (1 - 2e-16 against 1.0) and so rank them differently.
Dream's confidences are float32, as in Dream's code.
Randomness comes from one generator per row, drawn only for rows that still have masks in the
block, so batched and single runs consume identical random streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from .. import config as config_names
from .registry import PROPOSALS, SELECTION_RULES

NEG_INF = float("-inf")


# ---- proposals ---------------------------------------------------------------------------------
def _draw_uniform(shape, generators, draws, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Uniform draws, row i from generators[draws[i]]. A row drawing None takes no part in this
    draw (its rule reveals by another way at this step): it draws nothing and gets 0.5, so that its
    stream advances exactly as when it is decoded alone."""
    out = torch.full((len(draws),) + tuple(shape), 0.5, dtype=dtype, device=device)
    for i, r in enumerate(draws):
        if r is not None:
            out[i] = torch.rand(shape, generator=generators[r], dtype=dtype, device=device)
    return out


def _propose_llada(logits, config, generators, draws, score="probability"):
    if config.temperature > 0:
        # Gumbel-max in float64 (LLaDA's add_gumbel_noise): argmax of exp(l) / (-log u)^temperature.
        l64 = logits.double()
        noise = _draw_uniform(logits.shape[1:], generators, draws, torch.float64, logits.device)
        tokens = (l64.exp() / (-torch.log(noise)) ** config.temperature).argmax(-1)
    else:
        tokens = logits.argmax(-1)
    if config.remasking == "random":
        conf = _draw_uniform(logits.shape[1:2], generators, draws, torch.float32, logits.device)
    elif score == "entropy":  # dParallel's and d3LLM's LLaDA form: float64, log(p + 1e-12)
        p = F.softmax(logits.double(), -1)
        conf = (p * torch.log(p + 1e-12)).sum(-1)  # the negative entropy: higher is surer
    else:  # the reference's float64 softmax, in its form: its rounding ranks near-certain positions
        conf = F.softmax(logits.double(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, conf


def _filter_top_p_top_k(logits, top_p, top_k):
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


def _sample_each(probs, generators, draws) -> torch.Tensor:
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


def _propose_dream(logits, config, generators, draws, score):
    if score == "unfiltered_entropy":  # dParallel's Dream: the entropy of the raw logits, log(p + 1e-8)
        p = logits.softmax(-1)
        raw = (p * torch.log(p + 1e-8)).sum(-1)
    if config.temperature > 0:
        logits = logits / config.temperature
    logits = _filter_top_p_top_k(logits, config.top_p, config.top_k)
    probs = logits.softmax(-1)
    if config.temperature > 0:
        tokens = _sample_each(probs, generators, draws)
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


# ---- selection rules ---------------------------------------------------------------------------
def _ranks(conf: torch.Tensor) -> torch.Tensor:
    """Rank of each position by descending confidence (0 = most confident), leftmost first on ties."""
    order = conf.argsort(dim=-1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(
        -1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order)
    )


def token_logprobs(logits: torch.Tensor, configs) -> torch.Tensor:
    """(B, T, V) float32 log-probabilities a row's sampling draws from, for logits (B, T, V) and
    each row's config: at temperature > 0 of softmax(logits / temperature) after its top-k / top-p
    filtering (a filtered token: -inf), at temperature 0 of the logits as they are (as vLLM reports
    processed log-probabilities); with `logprobs_mode="raw"`, the logits' own log-softmax."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        raw = c.logprobs_mode == "raw"
        groups.setdefault((0.0, None, None) if raw else (c.temperature, c.top_p, c.top_k), []).append(i)
    for (temperature, top_p, top_k), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        part = logits.index_select(0, idx).float()
        if temperature > 0:
            part = _filter_top_p_top_k(part / temperature, top_p, top_k)
        out[idx] = part.log_softmax(-1)
    return out


def _top_k_mask(conf: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, the k[row] most confident positions (leftmost first on ties). Ranked whatever k
    is, so that no host read of k decides the path."""
    return _ranks(conf) < k.unsqueeze(-1)


def _and_the_most_confident(chosen: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """`chosen` and, in each row with a mask, its most confident masked position (`conf` -inf off
    the masks; argmax returns the first maximum: leftmost on ties)."""
    best = conf.argmax(-1, keepdim=True)
    return chosen | (torch.zeros_like(masked).scatter_(-1, best, True) & masked.any(-1, keepdim=True))


class BlockClock:
    """Where each row stands in its own block: `step` the steps it has taken in it and `steps`
    the steps its schedule gives the block (host lists: the loop knows them without reading the
    device), and `opened` (B,) its masks when the block began. Rows advance on their own, so
    these differ from row to row; a rule reads them instead of keeping state of its own.
    `starts` and `extents` (host lists, where the loop gives them): the block's first column in
    the row's sequence, and the sequence's length (prompt, region and suffix), for a reference
    that draws or ranks over the whole sequence (RND1's)."""

    def __init__(
        self,
        step: list[int],
        steps: list[int],
        opened: torch.Tensor,
        starts: list[int] | None = None,
        extents: list[int] | None = None,
    ):
        self.step, self.steps, self.opened = list(step), list(steps), opened
        self.starts, self.extents = starts, extents

    @cached_property
    def step_t(self) -> torch.Tensor:
        """`step` as a (B,) tensor (made only for the rules that read it)."""
        return torch.tensor(self.step, dtype=torch.long, device=self.opened.device)

    @cached_property
    def steps_t(self) -> torch.Tensor:
        return torch.tensor(self.steps, dtype=torch.long, device=self.opened.device)

    @classmethod
    def uniform(cls, masked: torch.Tensor, steps: int, step: int = 0, opened: torch.Tensor | None = None) -> BlockClock:
        """Every row at `step` of a block of `steps` steps that opened with the masks `opened`
        (default: those of `masked`)."""
        bsz = masked.shape[0]
        return cls([step] * bsz, [steps] * bsz, masked.sum(-1) if opened is None else opened)

    def take(self, indices: list[int]) -> BlockClock:
        idx = torch.tensor(indices, device=self.opened.device)
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]  # noqa: E731
        return BlockClock(pick(self.step), pick(self.steps), self.opened[idx], pick(self.starts), pick(self.extents))


def linear_schedule_at(counts_of: torch.Tensor, clock: BlockClock, masked: torch.Tensor) -> torch.Tensor:
    """LLaDA's get_num_transfer_tokens read at each row's step: `counts_of` (B,) positions split
    over the row's steps, base = count // steps and the remainder to the first steps; every masked
    position once its schedule is spent."""
    steps = clock.steps_t.clamp_min(1)
    k = counts_of // steps + (clock.step_t < counts_of % steps).long()
    return torch.where(clock.step_t < clock.steps_t, k, masked.sum(-1))


class SelectionRule:
    """Decides which masked positions of a block to reveal at one step, for each row at its own
    point of its own block (`BlockClock`). `uses_steps`: whether it follows the config's step
    schedule (rules that do not ignore `steps`); `draws_randomness`: whether it needs each row's
    generator."""

    name = ""
    uses_steps = False

    @classmethod
    def from_config(cls, config) -> SelectionRule:
        return cls()

    @staticmethod
    def draws_randomness(config) -> bool:
        return False

    def select(self, conf, masked, clock: BlockClock, generators, draws) -> torch.Tensor:
        """(B, T) True where a row reveals; `conf` and `masked` (B, T) the block's confidences and
        masks; `draws[i]` the index in `generators` of row i's random stream (None: it draws
        nothing)."""
        raise NotImplementedError


@SELECTION_RULES.register
class Threshold(SelectionRule):
    name = "threshold"

    def __init__(self, threshold: float):
        self.threshold = threshold

    @classmethod
    def from_config(cls, config):
        if config.threshold is None:
            raise ValueError("threshold: the threshold rule needs a threshold")
        return cls(config.threshold)

    def select(self, conf, masked, clock, generators, draws):
        conf = conf.masked_fill(~masked, NEG_INF)
        return _and_the_most_confident(masked & (conf >= self.threshold), conf, masked)


@SELECTION_RULES.register
class EntropyThreshold(SelectionRule):
    """dParallel's rule (`get_transfer_index_entropy`; Dream's `alg="entropy_threshold"`): every
    masked position whose entropy is at most `threshold` (in nats), and always the one of lowest
    entropy. It reads the negative entropy as its confidence (`score`: the proposal computes it:
    LLaDA's form in float64 with log(p + 1e-12); Dream's, from the unfiltered logits in float32
    with log(p + 1e-8), strictly below the threshold). Ties go to the leftmost position, where the
    reference's `topk` leaves them to the device."""

    name = "entropy"
    score = "entropy"

    def __init__(self, threshold: float, strict: bool = False):
        self.threshold, self.strict = threshold, strict

    @classmethod
    def from_config(cls, config):
        if config.threshold is None:
            raise ValueError("threshold: the entropy rule needs a threshold (an entropy, in nats)")
        return cls(config.threshold, strict=config.alg is not None)

    def select(self, conf, masked, clock, generators, draws):
        conf = conf.masked_fill(~masked, NEG_INF)
        chosen = masked & ((conf > -self.threshold) if self.strict else (conf >= -self.threshold))
        return _and_the_most_confident(chosen, conf, masked)


@SELECTION_RULES.register
class LeftToRight(SelectionRule):
    """DMax's rule (dInfer's `get_transfer_index_uniform`): the block's masked positions, left to
    right, up to the first whose confidence is below `threshold`; when the leftmost is already
    below it, the leftmost alone. The confidence is the proposed token's probability in DMax's
    float32 form, exp(logit - logsumexp) (`score`, `DMaxProposal`)."""

    name = "left_to_right"
    score = "logsumexp"

    def __init__(self, threshold: float):
        self.threshold = threshold

    @classmethod
    def from_config(cls, config):
        if config.threshold is None:
            raise ValueError("threshold: the left-to-right rule needs a threshold")
        return cls(config.threshold)

    def select(self, conf, masked, clock, generators, draws):
        low = masked & (conf < self.threshold)
        candidates = masked & (low.long().cumsum(-1) == 0)
        first = masked & (masked.long().cumsum(-1) == 1)
        return torch.where(candidates.any(-1, keepdim=True), candidates, first)


@SELECTION_RULES.register
class Factor(SelectionRule):
    name = "factor"

    def __init__(self, factor: float):
        self.factor = factor

    @classmethod
    def from_config(cls, config):
        if config.factor is None:
            raise ValueError("factor: the factor rule needs a factor")
        return cls(config.factor)

    def select(self, conf, masked, clock, generators, draws):
        conf = conf.masked_fill(~masked, NEG_INF)
        sorted_conf = conf.sort(dim=-1, descending=True, stable=True).values
        rank = torch.arange(1, conf.shape[-1] + 1, device=conf.device, dtype=conf.dtype)  # m = 1, 2, ...
        passes = sorted_conf >= 1 - self.factor / (rank + 1)
        passes[..., 0] = True  # always at least one
        count = passes.long().cumprod(-1).sum(-1)
        count = torch.minimum(count, masked.sum(-1))
        return _top_k_mask(conf, count) & masked


@SELECTION_RULES.register
class LinearSchedule(SelectionRule):
    name = "linear"
    uses_steps = True

    def select(self, conf, masked, clock, generators, draws):
        k = linear_schedule_at(clock.opened, clock, masked)  # the masks at the block's start, split
        return _top_k_mask(conf.masked_fill(~masked, NEG_INF), k) & masked


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
            u = _draw_uniform(masked.shape[1:], generators, drawing, torch.float32, masked.device)
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


@SELECTION_RULES.register
class Quota(SelectionRule):
    """SDAR's `block_diffusion_generate` ("low_confidence_dynamic"; "static" without a threshold):
    step i of a block has a quota k_i, the *block length* (not its masks) split evenly over the
    block's steps, the remainder to the first ones. With a threshold, every masked position whose
    confidence is strictly above it is revealed if there are at least k_i of them; otherwise (and
    without a threshold) the k_i most confident (fewer if fewer are masked). The confidence is
    the probability of the proposed token before top-k / top-p filtering (`SDARProposal`, SDAR's
    family proposal)."""

    name = "quota"
    uses_steps = True

    def __init__(self, threshold: float | None):
        self.threshold = threshold

    @classmethod
    def from_config(cls, config):
        return cls(config.threshold)

    def select(self, conf, masked, clock, generators, draws):
        length = torch.full_like(clock.step_t, masked.shape[-1])
        k = torch.minimum(linear_schedule_at(length, clock, masked), masked.sum(-1))
        conf = conf.masked_fill(~masked, NEG_INF)
        chosen = _top_k_mask(conf, k)
        if self.threshold is not None:
            high = masked & (conf > self.threshold)
            chosen = torch.where((high.sum(-1) >= k).unsqueeze(-1), high, chosen)
        return chosen & masked


class FirstPositionAtBlockStart(SelectionRule):
    """The block-start step reveals exactly the block's first position, whatever the rule; the
    rule decides the steps after it (a schedule counts the block-start step as its step 0).
    Fast-dLLM's Dream with a block cache does this; so does Fast-dLLM v2 always: its first token
    of a block is the argmax of the previous block's last logit, read by the forward that commits
    that block. A row whose block opens with prompt tokens (`decoder.Row.lead`) has no such
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


class SubBlocks(SelectionRule):
    """Fast-dLLM v2's small blocks: a block's positions are revealed sub-block by sub-block, left
    to right; the inner rule chooses among the masked positions of the first sub-block that still
    has any (its "always the most confident one" then applies within that sub-block)."""

    def __init__(self, inner: SelectionRule, size: int):
        self.inner, self.size = inner, size

    def select(self, conf, masked, clock, generators, draws):
        bsz, length = masked.shape
        sub = masked.view(bsz, length // self.size, self.size).any(-1)  # (B, sub-blocks) with masks
        current = sub.long().argmax(-1, keepdim=True)  # the first such sub-block
        index = torch.arange(length, device=masked.device) // self.size
        here = masked & (index[None, :] == current)
        return self.inner.select(conf, here, clock, generators, draws) & here


def register_selection_rule(cls: type[SelectionRule]) -> type[SelectionRule]:
    """Make `cls` a selection rule that configs name by `cls.name` (`unmasking=...`); usable as a
    class decorator."""
    return SELECTION_RULES.register(cls)


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
            tokens = _sample_each(_filter_top_p_top_k(logits, c.top_p, c.top_k).softmax(-1), generators, draws)
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
            noise = _draw_uniform(logits.shape[1:], generators, draws, torch.float64, logits.device)
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
            probs = _filter_top_p_top_k(logits / c.temperature, c.top_p, None).softmax(-1)
            tokens = _sample_each(probs, generators, draws)
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
            probs = _filter_top_p_top_k(logits, c.top_p, c.top_k).softmax(-1)
            tokens = _sample_each(probs, generators, draws)
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


class Editing:
    """LLaDA2.1's token-to-token editing. In every step, besides revealing masked positions, an
    already revealed position of the current block (never a prompt token) takes the step's
    proposed token when that token differs from the one there and its confidence is strictly
    above `threshold`. A block then ends not at its last mask but at the first step after it that
    edits nothing, or after `max_post_steps` such steps (each row on its own). Its quality mode is
    threshold 0.7 with editing 0.5, its speed mode threshold 0.5 with editing 0.0 (any change is
    taken: the edits repair what the low threshold got wrong)."""

    def __init__(
        self,
        threshold: float,
        max_post_steps: int,
        stop_confidence: float | None = None,
        soft_embeddings: bool = False,
    ):
        self.threshold, self.max_post_steps = threshold, max_post_steps
        self.stop_confidence, self.soft_embeddings = stop_confidence, soft_embeddings

    @classmethod
    def from_config(cls, config) -> Editing | None:
        if config.editing_threshold is None:
            return None
        return cls(config.editing_threshold, config.max_post_steps, config.stop_confidence, config.soft_embeddings)

    @property
    def needs_top(self) -> bool:
        """Whether a step's decision carries each position's most probable token and its probability."""
        return self.stop_confidence is not None or self.soft_embeddings

    def confident_stop(self, block, revealed, top_prob, changed, steps, mask_id) -> torch.Tensor:
        """DMax's end of a block, (B,): no mask left, and every position masked at the block's start
        (revealed in it, `revealed`, or still masked) has its most probable token at least
        `stop_confidence` likely, or the step changed nothing, or the block took its length in
        steps. *Deliberate difference*: DMax also ends a block that still has masks when they are
        all that likely (at temperature > 0 a sampled token may be less likely than the threshold);
        here a block ends only without masks, as every block in this loop does."""
        masked = block == mask_id
        active = revealed | masked
        sure = ((top_prob >= self.stop_confidence) | ~active).all(-1)
        return ~masked.any(-1) & (sure | ~changed | (steps >= block.shape[1]))

    def select(self, tokens, conf, current, editable) -> torch.Tensor:
        """(B, T) True where the proposal rewrites a revealed token."""
        return editable & (tokens != current) & (conf > self.threshold)

    def block_done(self, block, decision, editable, clock, carry, mask_id) -> tuple[torch.Tensor, list]:
        """(B,) whether each row's block is over after this step, and per row what the next step of
        its block reads (`Decision.carry`: its steps after the last mask and whether it goes on). A
        block ends at its first step after the last mask that edits nothing, or after
        `max_post_steps` such steps; with DMax's rule (`stop_confidence`), `confident_stop`."""
        after = torch.where(decision.chosen, decision.tokens, torch.where(decision.edited, decision.tokens, block))
        had_mask, has_mask = (block == mask_id).any(-1), (after == mask_id).any(-1)
        edited = decision.edited.any(-1)
        if self.stop_confidence is not None:
            revealed = editable | decision.chosen  # in this block, not a prompt or fixed token
            changed = decision.chosen.any(-1) | edited
            steps = torch.tensor([k + 1 for k in clock.step], device=block.device)
            done = self.confident_stop(after, revealed, decision.top_prob, changed, steps, mask_id)
            return done, [None] * block.shape[0]
        opened = [c is None for c in carry] if carry is not None else [True] * block.shape[0]
        post = torch.stack(
            [(~had_mask[i]).long() if o else carry[i][0] for i, o in enumerate(opened)]
        )  # a block that opens with no mask is already past it
        alive = torch.stack(
            [torch.ones((), dtype=torch.bool, device=block.device) if o else carry[i][1] for i, o in enumerate(opened)]
        )
        alive = alive & (had_mask | edited)
        post = post + (~has_mask & alive)
        alive = alive & (has_mask | (post <= self.max_post_steps))
        return ~alive, [(post[i], alive[i]) for i in range(block.shape[0])]


class Lookahead:
    """Multi-block decoding, after D2F's pipelined block decoding: the blocks after the current one
    (up to `depth` blocks in all) are decoded in the same forwards while the current one is being
    finished, which the loop's selection rule alone decides. Each step, for block j after the
    current one, read before the step reveals anything:
    - it takes part once the block before it has at least `add` of its positions revealed (and
      that block takes part), as D2F adds a block;
    - it reveals every masked position whose confidence is strictly above `threshold` (D2F's
      skip_threshold), stricter than the current block's rule;
    - once the block before it has at least `activate` revealed (D2F's "complete" state), it also
      reveals its single most confident masked position when none is above the threshold.
    *Deliberate difference*: D2F keeps decoding any number of blocks, each until it is done, and
    commits the finished prefix to its cache when its blocks end; here the current block is the
    loop's and decides when the window moves on (then the exact cache commit runs as for one
    block), and at most `depth` blocks take part."""

    # The early stop a row with `eos_early_stop` takes (`BlockDecoder.step`): LLaDA2.0's (a block
    # whose revealed stop token has no mask before it ends the row), unless the decoder whose
    # multi-block decoding this is fills its window after the first EOS (d3LLM's `handle_early_stop`).
    fills_after_eos = False

    def __init__(self, depth: int, add: float, activate: float, threshold: float):
        self.depth, self.add, self.activate, self.threshold = depth, add, activate, threshold

    @classmethod
    def from_config(cls, config, d3llm_code: str = "llada") -> Lookahead | None:
        """`d3llm_code`: which of d3LLM's codes the model family follows (`DecodingRules`)."""
        if config.parallel_blocks == 1:
            return None
        args = (config.parallel_blocks, config.block_add_threshold, config.decoded_token_threshold)
        if config.unmasking == "entropy":
            return EntropyLookahead(*args, config.threshold, keeps_lowest=d3llm_code == "llada")
        return cls(*args, config.lookahead_threshold)

    def select(
        self, conf: torch.Tensor, masked: torch.Tensor, current_masked: torch.Tensor, current_conf: torch.Tensor
    ) -> torch.Tensor:
        """(B, n * block_length) True where a later block reveals, for the confidences and masks
        of the n blocks after the current one and the current block's masks and confidences (B,
        block_length)."""
        bsz, blk = current_masked.shape
        n = masked.shape[1] // blk
        m, c = masked.view(bsz, n, blk), conf.view(bsz, n, blk)
        # each block's predecessor's revealed fraction: the current block's, then the later ones'
        done = 1 - torch.cat([current_masked[:, None], m[:, :-1]], 1).float().mean(-1)  # (B, n)
        active = (done >= self.add).long().cumprod(-1).bool()
        sure = m & (c > self.threshold) & active[..., None]
        best = torch.where(m, c, NEG_INF).argmax(-1, keepdim=True)
        forced = (active & (done >= self.activate) & m.any(-1) & ~sure.any(-1))[..., None] & (
            torch.arange(blk, device=m.device) == best
        )
        return (sure | forced).view(bsz, n * blk)


class EntropyLookahead(Lookahead):
    """d3LLM's multi-block decoding (`generate_multi_block`), with the entropy rule
    (`unmasking="entropy"`) deciding the current block. A later block takes part once the block
    before it has `add` of its positions revealed (d3LLM's block_add_threshold, 0.1); it reveals
    every masked position of entropy at most `threshold` (the current block's, 0.5); and the one
    position of lowest entropy among all the blocks taking part is revealed wherever it is (d3LLM
    keeps it across blocks: in a later block when no position of the current one is as sure). The
    current block's own guaranteed position is d3LLM's forced token of its first fully activated
    block (that block is always the current one: the block before it is done), so
    `decoded_token_threshold` changes nothing here. Ties go to the leftmost position.

    `keeps_lowest=False` is d3LLM's Dream code (`_sample_multi_block`), which keeps no lowest
    position across blocks: a later block reveals only below the threshold. That code compares
    strictly below the threshold where its LLaDA code (and we, in both) reveal at it too: it differs
    only for an entropy equal to the threshold to the last bit of a float64."""

    fills_after_eos = True

    def __init__(self, depth: int, add: float, activate: float, threshold: float, keeps_lowest: bool = True):
        super().__init__(depth, add, activate, threshold)
        self.keeps_lowest = keeps_lowest

    def select(self, conf, masked, current_masked, current_conf):
        bsz, blk = current_masked.shape
        n = masked.shape[1] // blk
        m = masked.view(bsz, n, blk)
        done = 1 - torch.cat([current_masked[:, None], m[:, :-1]], 1).float().mean(-1)  # (B, n)
        active = ((done >= self.add).long().cumprod(-1).bool()[..., None] & m).view(bsz, n * blk)
        sure = active & (conf >= -self.threshold)
        if not self.keeps_lowest:
            return sure
        later = torch.where(active, conf, NEG_INF)
        best = later.argmax(-1, keepdim=True)
        here = torch.where(current_masked, current_conf, NEG_INF).max(-1, keepdim=True).values
        lowest = torch.zeros_like(active).scatter_(-1, best, True) & active & (later.gather(-1, best) > here)
        return sure | lowest


@dataclass
class SoftTokens:
    """DMax's signal for a row's next forward: per position its most probable token and that
    token's probability, and which positions enter the forward as their soft embeddings (`keep`:
    those revealed in the block; the model mixes them, `Transformer.soft_input`)."""

    top_token: torch.Tensor
    top_prob: torch.Tensor
    keep: torch.Tensor

    def __getitem__(self, i) -> SoftTokens:
        return SoftTokens(self.top_token[i], self.top_prob[i], self.keep[i])

    @staticmethod
    def merged(parts: list, rows: int) -> SoftTokens:
        """One signal for the batch from the groups' ((row indices, signal), ...)."""
        first = parts[0][1]
        out = SoftTokens(*(t.new_empty((rows, *t.shape[1:])) for t in (first.top_token, first.top_prob, first.keep)))
        for idx, sig in parts:
            out.top_token[idx], out.top_prob[idx], out.keep[idx] = sig.top_token, sig.top_prob, sig.keep
        return out


@dataclass
class Decision:
    """What one step decides for every row: the tokens proposed for its current block, which of
    its masked positions they reveal (`chosen`), which revealed ones they rewrite (`edited`, None
    without editing), and for the blocks after the current one (multi-block decoding) their
    proposals and what they reveal (`ahead_tokens`, `ahead`; None with one block at a time)."""

    tokens: torch.Tensor
    chosen: torch.Tensor
    edited: torch.Tensor | None = None
    ahead_tokens: torch.Tensor | None = None
    ahead: torch.Tensor | None = None
    # each position's most probable token and its probability (DMax's stop rule and soft embeddings)
    top_token: torch.Tensor | None = None
    top_prob: torch.Tensor | None = None
    # (B,) whether each row's block is done, where the strategy decides it (a canvas with no mask)
    block_done: torch.Tensor | None = None
    # what conditions each row's next forward, as its model turns it into input vectors
    # (`soft_input`): DiffusionGemma's (B, T, V) logits (self-conditioning), DMax's `SoftTokens`;
    # None: nothing
    signal: torch.Tensor | SoftTokens | None = None
    # per row, the strategy's state for the row's next step in this block (`Row.carry`)
    carry: list | None = None

    def revealed(self) -> torch.Tensor:
        """(B,) positions each row revealed (edits not counted)."""
        n = self.chosen.sum(-1)
        return n if self.ahead is None else n + self.ahead.sum(-1)


class UnmaskingStrategy:
    """One unmasking policy: a proposal (tokens and confidences), a factory of the selection
    rule (`rule`: one object, as rules keep no state), whether it draws
    randomness (then each row gets a generator), its token editing (`Editing`, or None) and its
    multi-block decoding (`Lookahead`, or None: one block at a time).
    `confidence_temperature`: the confidences the rules read come from logits divided by it,
    the tokens from the logits as they are (a benchmark's calibrated view; greedy only)."""

    def __init__(
        self,
        proposal: Proposal,
        make_rule,
        draws_randomness: bool,
        editing: Editing | None = None,
        confidence_temperature: float = 1.0,
        lookahead: Lookahead | None = None,
    ):
        self.proposal, self.make_rule, self.draws_randomness = proposal, make_rule, draws_randomness
        self.editing, self.confidence_temperature = editing, confidence_temperature
        self.lookahead = lookahead
        self._rule: SelectionRule | None = None

    @property
    def fills_after_eos(self) -> bool:
        """Whether `eos_early_stop` fills the window after the first EOS (d3LLM's rule) rather than
        stopping the row at it (LLaDA2.0's): the lookahead's (`Lookahead.fills_after_eos`)."""
        return self.lookahead is not None and self.lookahead.fills_after_eos

    @classmethod
    def from_config(cls, config, rules=None) -> UnmaskingStrategy:
        """`rules`: the model family's `DecodingRules` (its own proposal, where it has one, and
        which of d3LLM's codes its multi-block decoding follows); None: LLaDA's."""
        rule = SELECTION_RULES[config_names.selection_rule_name(config)]
        proposal = proposal_for(config, rule, None if rules is None else rules.proposal)
        return cls(
            proposal,
            lambda: rule.from_config(config),
            proposal.draws_randomness() or rule.draws_randomness(config),
            Editing.from_config(config),
            config.confidence_temperature,
            Lookahead.from_config(config, "llada" if rules is None else rules.d3llm_code),
        )

    def propose(self, logits: torch.Tensor, generators, draws, clock=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, confidence), each (B, T), for logits (B, T, V). `draws[i]` names the generator
        of batch row i, or is None for a row with nothing to reveal (it draws nothing)."""
        logits = logits if self.proposal.model_dtype else logits.float()
        tokens, conf = self.proposal(logits, generators, draws, clock)
        if self.confidence_temperature != 1.0:  # greedy (checked by the config): no randomness drawn twice
            _, conf = self.proposal(logits / self.confidence_temperature, generators, draws, clock)
        return tokens, conf

    def decide(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        clock: BlockClock,
        generators,
        mask_id: int,
        later: torch.Tensor | None = None,
        editable: torch.Tensor | None = None,
        constraints: dict | None = None,
        carry: list | None = None,
    ) -> Decision:
        """One step's decision for every row: `logits` (B, W, V) of the current block (B, T) and,
        with multi-block decoding, of the blocks after it (`later`, (B, W - T) their tokens);
        `editable` (B, T) the revealed positions an editing rule may rewrite; `constraints`
        {row: grammar} the rows whose answers follow one. Every row takes part."""
        rule = self.rule
        blk = block.shape[1]
        masked = block == mask_id
        raw_logits = logits  # before the [MASK] guard: DMax's top probabilities include the mask
        drawing = None if generators is None else list(range(block.shape[0]))
        with record_function("fastdllm.propose"):
            tokens, conf = self.propose(logits, generators, drawing, clock)
        proposed_mask = tokens == mask_id
        # A model may rank [MASK] first (an untrained one does): revealing it would leave the
        # position masked for ever. Those positions get the best other token instead; the
        # references would loop or keep the mask there, and no other position changes. Greedy
        # proposals draw nothing, so the other token is proposed every step and no host read
        # decides it; sampled ones propose again only when needed, so that each row's random
        # stream advances as in the reference (one whose reference draws once per step takes the
        # best other token without drawing again: `Proposal.redraws`).
        if generators is None or bool(proposed_mask.any()):
            logits = logits.clone()
            logits[..., mask_id] = NEG_INF
            again = self.proposal.redraws and generators is not None
            others, others_conf = self.propose(logits, generators if again else None, drawing if again else None, clock)
            tokens = torch.where(proposed_mask, others, tokens)
            conf = torch.where(proposed_mask, others_conf, conf)
        constraints = constraints or {}
        ahead_tokens = ahead = None
        if later is not None:  # the blocks after the current one: what the lookahead rule reveals
            ahead_tokens = tokens[:, blk:]
            later_masked = later == mask_id
            if constraints:  # a grammar reveals left to right: its later blocks wait
                later_masked[list(constraints)] = False
            ahead = self.lookahead.select(conf[:, blk:], later_masked, masked, conf[:, :blk]) & later_masked
            logits, tokens, conf = logits[:, :blk], tokens[:, :blk], conf[:, :blk]
        with record_function("fastdllm.select"):
            chosen = rule.select(conf, masked, clock, generators, drawing) & masked
        for i, constraint in constraints.items():  # the grammar's say: left to right, each token accepted
            constraint.amend(logits[i], tokens[i], chosen[i], masked[i])
        edited = None
        if self.editing is not None:
            if constraints:  # a checked token is never rewritten
                editable = editable.clone()
                editable[list(constraints)] = False
            edited = self.editing.select(tokens, conf, block, editable)
        top_token = top_prob = None
        if self.editing is not None and self.editing.needs_top:  # DMax's _get_prob_stats, float32
            lf = raw_logits[:, :blk].float()
            top_logit, top_token = lf.max(-1)
            top_prob = (top_logit - torch.logsumexp(lf, -1)).exp()
        decision = Decision(tokens, chosen, edited, ahead_tokens, ahead, top_token, top_prob)
        if self.editing is not None and self.editing.soft_embeddings:  # every revealed position, fed back
            decision.signal = SoftTokens(top_token, top_prob, editable | chosen)
        if self.editing is not None:
            decision.block_done, decision.carry = self.editing.block_done(
                block, decision, editable, clock, carry, mask_id
            )
        return decision

    @property
    def rule(self) -> SelectionRule:
        """The selection rule (rules keep no state: one serves every generation)."""
        if self._rule is None:
            self._rule = self.make_rule()
        return self._rule

    def _with_rule(self, make_rule) -> UnmaskingStrategy:
        return UnmaskingStrategy(
            self.proposal, make_rule, self.draws_randomness, self.editing, self.confidence_temperature, self.lookahead
        )

    def new_rule(self) -> SelectionRule:
        """A fresh selection rule."""
        return self.make_rule()

    def in_sub_blocks(self, size: int) -> UnmaskingStrategy:
        """The same strategy, revealing each block sub-block by sub-block (`SubBlocks`)."""
        inner = self.make_rule
        return self._with_rule(lambda: SubBlocks(inner(), size))

    def revealing_first_at_block_start(self) -> UnmaskingStrategy:
        """The same strategy whose block-start step reveals the block's first position
        (`FirstPositionAtBlockStart`: Fast-dLLM's Dream with a block cache, Fast-dLLM v2)."""
        inner = self.make_rule
        return self._with_rule(lambda: FirstPositionAtBlockStart(inner()))
