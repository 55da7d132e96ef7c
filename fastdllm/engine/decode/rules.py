"""Selection rules: how many of a block's masked positions a step reveals, and which, each as
published (Fast-dLLM's threshold and factor, LLaDA's and Dream's schedules, dParallel's
entropy, SDAR's quota, left to right), and the clock each reads."""

from __future__ import annotations

from functools import cached_property

import torch

from ..registry import SELECTION_RULES


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


class OneParameterRule(SelectionRule):
    """A rule read from one config field (`parameter`), which it needs: the threshold rules, the
    factor rule."""

    parameter = "threshold"

    def __init__(self, value: float):
        setattr(self, self.parameter, value)

    @classmethod
    def from_config(cls, config) -> SelectionRule:
        value = getattr(config, cls.parameter)
        if value is None:
            raise ValueError(f"{cls.parameter}: unmasking={cls.name} needs a {cls.parameter}")
        return cls(value)


def register_selection_rule(cls: type[SelectionRule]) -> type[SelectionRule]:
    """Make `cls` a selection rule that configs name by `cls.name` (`unmasking=...`); usable as a
    class decorator."""
    return SELECTION_RULES.register(cls)
