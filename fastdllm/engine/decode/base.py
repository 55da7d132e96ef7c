"""The Decoder protocol: what the loop asks of a decoder, and all it asks.

A decoder is built once per decision key (`Decoder.from_config(config, model, cache)`), and every
step `decide(logits, view)` returns its complete `Decision` for its rows: what they reveal and
edit, whether each row's block is done, which positions its own stop rule fills with EOS, and what
conditions each row's next forward. The loop applies decisions and never asks a decoder's type.
Besides `decide`, a decoder declares a few facts the loop plans with (class attributes below) and
may shape a block when it opens (`open_block`: a canvas of noise). Decoders register by the
selection rule that names them (`register_decoder`); a config whose rule no decoder claims decodes
with the masked decoder (`strategy.UnmaskingStrategy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decision import Decision
from .rules import BlockClock


@dataclass
class DecodeView:
    """What a decoder reads of its rows at one step: the current block's tokens (B, T) and where
    each row stands in it (`clock`); with multi-block decoding the blocks after it (`later`);
    `steps_of` (B, W) the step that revealed each position of the window (-1: masked, a prompt or
    a fixed token); `editable` (B, T) the positions an editing rule may rewrite; per row its
    generator (None: the decoder draws nothing), grammar ({row: constraint}), carried state and
    config; and the model's mask, EOS and stop tokens."""

    block: torch.Tensor
    clock: BlockClock
    mask_id: int
    generators: list | None = None
    later: torch.Tensor | None = None
    editable: torch.Tensor | None = None
    steps_of: torch.Tensor | None = None
    constraints: dict = field(default_factory=dict)
    carry: list | None = None
    configs: list | None = None
    eos_id: int | None = None
    stop_ids: torch.Tensor | None = None

    def take(self, members: list[int]) -> DecodeView:
        """The view of rows `members` alone, in that order."""
        idx = torch.tensor(members, device=self.block.device)
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        row = {i: j for j, i in enumerate(members)}
        return DecodeView(
            self.block[idx],
            self.clock.take(members),
            self.mask_id,
            None if self.generators is None else [self.generators[i] for i in members],
            pick(self.later),
            pick(self.editable),
            pick(self.steps_of),
            {row[i]: c for i, c in self.constraints.items() if i in row},
            None if self.carry is None else [self.carry[i] for i in members],
            None if self.configs is None else [self.configs[i] for i in members],
            self.eos_id,
            self.stop_ids,
        )


class Decoder:
    """One decoding policy. Subclasses set the facts below and implement `decide`."""

    # whether rows need their own random streams (each row then gets a generator)
    draws_randomness = False
    # how many blocks a step decodes: the current one and `depth - 1` after it
    depth = 1
    # whether it may rewrite revealed tokens (the loop then tells it which are `editable`)
    edits = False
    # whether a later block that a step revealed whole is final (nothing edits it afterwards), so
    # that the row moves past it
    later_blocks_final = True
    # whether a block's first position is revealed at its block-start step (no later step of the
    # block reads its logit: the cache policy opens its windows at the block)
    reveals_first_at_block_start = False
    # tokens its reference places after the answer and any suffix, which every forward sees
    closing_tokens: tuple[int, ...] = ()
    # whether the step that ends a row's block computed the final K/V of that block and of the
    # later blocks it made final (a causal verification), so that no forward computes them again
    commits_blocks = False

    @classmethod
    def from_config(cls, config, model=None, cache=None) -> Decoder:
        """The decoder for `config` on `model` (None: LLaDA's rules) with the cache policy `cache`."""
        raise NotImplementedError

    def decide(self, logits: torch.Tensor, view: DecodeView) -> Decision:
        """The step's complete decision for every row of `view`, from `logits` (B, W, V) of its
        window (the current block and, with `depth` > 1, the blocks after it)."""
        raise NotImplementedError

    def canvas(self, carry, step: int) -> int | None:
        """How a row's next forward attends, where the decoder chooses it (a model that computes a
        window's columns before its block causally and a span from the block on bidirectionally:
        Nemotron-Labs-Diffusion): that span's length, 0 for a window causal throughout; None: the
        model's own rule. `carry` is the row's carried state, `step` its steps in the block."""
        return None

    def adapter(self, config, carry, step: int, block: int) -> str | None:
        """The LoRA adapter a row's next forward decodes with (None: the base): its config's,
        unless the decoder's passes differ (LinearSpec's drafts). `block` is the row's block."""
        return config.adapter

    def open_block(self, tokens: torch.Tensor, generator) -> torch.Tensor:
        """A row's block as it opens (its masks, or where the decoder has no mask token, the canvas
        it starts from, drawn from the row's generator)."""
        return tokens


DECODERS: dict[str, type[Decoder]] = {}


def register_decoder(*rule_names: str):
    """Make the decorated class the decoder of configs whose selection rule is one of `rule_names`."""

    def register(cls: type[Decoder]) -> type[Decoder]:
        for name in rule_names:
            DECODERS[name] = cls
        return cls

    return register
