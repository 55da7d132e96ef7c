"""Selection rules: how many of a block's masked positions a step reveals, and which, each as
published (Fast-dLLM's threshold and factor, LLaDA's and Dream's schedules, dParallel's
entropy, SDAR's quota, left to right), and the clock each reads."""

from __future__ import annotations

from functools import cached_property

import torch

from ..registry import SELECTION_RULES
from .sampling import NEG_INF, draw_uniform


def _ranks(conf: torch.Tensor) -> torch.Tensor:
    """Rank of each position by descending confidence (0 = most confident), leftmost first on ties."""
    order = conf.argsort(dim=-1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(
        -1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order)
    )


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
