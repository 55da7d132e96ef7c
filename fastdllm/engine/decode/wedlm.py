"""WeDLM's decoding (Tencent/WeDLM's engine: `wedlm/engine/wedlm_decoder.py` and its `Sampler`): a
sliding window over a causal model.

A row's window is the `window_size` positions from its first masked one. Every step the model
reads the window with its revealed tokens before its masks (the reference reorders them; our
attention orders them so, `ModelArgs.masks_last`: the same keys for every query), samples a token
at every masked position, and reveals the masks whose entropy plus `pos_penalty_factor` per
position after the window's first mask is under `threshold` (`WeDLMRule`; none under it, or no
threshold: the one of lowest such score). A revealed token is never changed. Once every position
before a token is revealed the token is final: the window moves past it, and the next forward,
which computes it causally against the prefix before it (tokens come first in the order), writes
its K/V for good. That is why WeDLM's prefix cache is exact.

In the loop this is multi-block decoding with blocks of one position (`block_length` 1): the current
block is the first masked position, the `window_size - 1` after it are decoded in the same forwards
(`WeDLMStrategy.depth`), and a row whose first block is revealed moves past every block revealed
after it, as the reference prunes its window. The window runs past the answer's end
(`GenerationConfig.columns_past_answer`): the reference keeps refilling it with masks up to the
last answer token, whose neighbours there are revealed and seen like any other.

*Deliberate differences*: the reference computes the prompt in a forward of its own and needs one
more forward to prune a window's last final tokens, so its forwards are ours plus two per answer.
It stops at its `stop_token_ids` (EOS added); we stop at the model's stop tokens. Where a sampled
token is [MASK] it fills the position with it; we take the most likely other token, drawing nothing
more. Each row samples from its own generator; the reference draws a batch's rows from one stream
(a row alone draws the same numbers under the same seed).

A row under a grammar (`constraints.GrammarConstraint`, which WeDLM's engine has not) reveals the
window left to right: its first mask takes the grammar's most likely token, and the run of
positions the rule chose right after it as far as the grammar accepts them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import SELECTION_RULES
from .base import Decoder, DecodeView, register_decoder
from .decision import Decision
from .rules import SelectionRule
from .sampling import NEG_INF


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """The reference's `Categorical(logits=...).entropy()`, in the logits' dtype."""
    return torch.distributions.Categorical(logits=logits).entropy()


def top_k_filtered(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """WeDLM's top-k: every logit below the k-th largest set to -inf (ties with it stay)."""
    if not k:
        return logits
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filtered(logits: torch.Tensor, p: float | None) -> torch.Tensor:
    """WeDLM's nucleus filter: sorted descending, a token goes once the probability up to the one
    before it exceeds p (the most likely always stays)."""
    if p is None or p >= 1.0:
        return logits
    ordered, order = logits.sort(descending=True, dim=-1)
    drop = F.softmax(ordered, dim=-1).cumsum(-1) > p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), NEG_INF)


def best_other_than(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Each position's most likely token other than [MASK] (our stand-in where a draw is [MASK])."""
    guarded = logits.clone()
    guarded[..., mask_id] = NEG_INF
    return guarded.argmax(-1)


def sample(logits: torch.Tensor, config, generator: torch.Generator | None) -> torch.Tensor:
    """The reference's `Sampler.sample_tokens` for the masks' logits (n, V): the argmax of their
    softmax at temperature 0; else top-k, then top-p, then the temperature, one draw per row."""
    if config.temperature == 0:
        return F.softmax(logits, dim=-1).argmax(-1)
    filtered = top_p_filtered(top_k_filtered(logits, config.top_k), config.top_p)
    probs = F.softmax(filtered / config.temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@SELECTION_RULES.register
class WeDLMRule(SelectionRule):
    """WeDLM's position selection (`Sampler.select_positions_to_fill`): each masked position's
    entropy (`conf` is its negative) plus `pos_penalty_factor` times its distance from the window's
    first mask, in float32 as there; every position under `threshold` is revealed, or where none is
    (or `threshold` is None) the lowest, the first of equals."""

    name = "wedlm"

    def __init__(self, threshold: float | None, pos_penalty_factor: float):
        self.threshold, self.factor = threshold, pos_penalty_factor

    @classmethod
    def from_config(cls, config):
        return cls(config.threshold, config.pos_penalty_factor)

    def select(self, conf, masked, clock, generators, draws):
        # every row at once, without a host read: distances from each row's first mask, in float32
        columns = torch.arange(masked.shape[1], device=masked.device, dtype=torch.float32)
        first = masked.int().argmax(-1, keepdim=True).float()
        adjusted = -conf + (columns - first) * self.factor
        adjusted = torch.where(masked, adjusted, torch.inf)
        lowest = torch.zeros_like(masked).scatter_(-1, adjusted.argmin(-1, keepdim=True), True)
        if self.threshold is None:
            return lowest & masked
        under = (adjusted < self.threshold) & masked
        return torch.where(under.any(-1, keepdim=True), under, lowest & masked)


@register_decoder(WeDLMRule.name)
class WeDLMStrategy(Decoder):
    """WeDLM's decisions for the loop: per row, its window's masks sampled and selected
    (`WeDLMRule`); the window's first position is the loop's block, the rest what it reveals ahead
    (`depth` one-position blocks decoded in each forward)."""

    def __init__(self, config):
        self.config = config
        self.rule = WeDLMRule.from_config(config)
        self.depth = config.window_size
        self.draws_randomness = config.temperature > 0

    @classmethod
    def from_config(cls, config, model=None, cache=None) -> WeDLMStrategy:
        return cls(config)

    def decide(self, logits, view: DecodeView) -> Decision:
        block, later, mask_id, generators, clock = view.block, view.later, view.mask_id, view.generators, view.clock
        window = block if later is None else torch.cat([block, later], 1)
        masked = window == mask_id
        tokens = window.clone()
        # the entropies as the reference adds its float32 penalties to them (bfloat16 ones widened)
        conf = torch.zeros(window.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=window.device)
        if self.config.temperature == 0:  # greedy: every row's window at once, nothing drawn
            drawn = sample(logits, self.config, None)
            drawn = torch.where(drawn == mask_id, best_other_than(logits, mask_id), drawn)
            tokens = torch.where(masked, drawn, window)
            conf = torch.where(masked, -entropy(logits).to(conf.dtype), conf)
        for i in range(window.shape[0] if self.config.temperature > 0 else 0):
            where = masked[i].nonzero()[:, 0]
            if not where.numel():
                continue
            rows = logits[i, where]
            drawn = sample(rows, self.config, None if generators is None else generators[i])
            tokens[i, where] = torch.where(drawn == mask_id, best_other_than(rows, mask_id), drawn)
            conf[i, where] = -entropy(rows).to(conf.dtype)
        chosen = self.rule.select(conf, masked, clock, generators, None) & masked
        for i, constraint in view.constraints.items():  # the grammar's say, over the whole window
            constraint.amend(logits[i], tokens[i], chosen[i], masked[i])
        blk = block.shape[1]
        if later is None:
            return Decision(tokens, chosen)
        return Decision(tokens[:, :blk], chosen[:, :blk], ahead_tokens=tokens[:, blk:], ahead=chosen[:, blk:])
