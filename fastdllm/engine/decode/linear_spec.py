"""LinearSpec self-speculation (Nemotron-Labs-Diffusion's `linear_spec_generate`): the same weights
draft bidirectionally and verify causally.

A row's current block is one position, its next token: predicted by the last causal pass, not yet
in the cache. A cycle is two forwards over the `window_size` positions from it (its draft block):

1. **draft**: the block bidirectionally against the cache (`Decoder.canvas` is `window_size`),
   every masked position of it revealed at once; with a `threshold`, only those at least that
   likely (always the most likely one), drafting again until none is masked;
2. **verify**: the same block causally (`canvas` 0), which writes its K/V; the longest run of
   drafts that the causal pass predicts as well is accepted, with the causal pass's own next
   token after it (a correction, or where every draft held, one more). The accepted positions are
   final; the drafts after them are masked again, and the correction is the next cycle's first
   token.

In the loop this is multi-block decoding with blocks of one position: the block and the
`window_size` after it (the last read only by the verification's final prediction). A row's first
step is its prompt's causal pass, which predicts its first token. The answer may not end on a
cycle: the reference keeps every token its last cycle accepted (up to `window_size - 1` past
`max_new_tokens`); we keep `gen_length` tokens, the same ones. A verification's acceptance length
(`Decision.accepted`, reported per request) counts the tokens the answer keeps: up to a stop token
and the answer's end (the reference's last verification may accept drafts past both).

Greedy by default; at a temperature every draft and every verification draws each of its
`window_size` positions from softmax(logits / temperature), as the reference draws them. Where a
draw is [MASK] we take the most likely other token (the reference writes the mask back). We stop at
the model's stop tokens (the reference at `eos_token_id`).
"""

from __future__ import annotations

import torch

from ..registry import SELECTION_RULES
from .base import Decoder, DecodeView, register_decoder
from .decision import Decision
from .rules import SelectionRule

VERIFY, DRAFT = "verify", "draft"


@SELECTION_RULES.register
class DraftRule(SelectionRule):
    """What a draft reveals: every masked position, or with a threshold those at least that likely
    (always the most likely one, the first of equals)."""

    name = "linear_spec"

    def __init__(self, threshold: float | None):
        self.threshold = threshold or 0.0

    @classmethod
    def from_config(cls, config) -> DraftRule:
        return cls(config.threshold)

    def select(self, conf, masked, clock, generators, draws):
        if self.threshold <= 0:
            return masked
        sure = masked & (conf >= self.threshold)
        best = torch.zeros_like(masked).scatter_(-1, conf.masked_fill(~masked, -1.0).argmax(-1, keepdim=True), True)
        return torch.where(sure.any(-1, keepdim=True), sure, best & masked)


@register_decoder("linear_spec")
class LinearSpec(Decoder):
    reveals_first_at_block_start = True
    later_blocks_final = False  # it says which are (`Decision.final_later`)
    commits_blocks = True  # a verification writes the K/V of what it accepts

    def __init__(self, config):
        self.config = config
        self.length = config.window_size
        self.depth = self.length + 1
        self.rule = DraftRule.from_config(config)
        self.draws_randomness = config.temperature > 0

    @classmethod
    def from_config(cls, config, model=None, cache=None) -> LinearSpec:
        if model is not None and not getattr(model, "two_passes", False):
            name = getattr(getattr(model, "family", None), "name", "this model")
            raise ValueError(
                f"unmasking: linear_spec drafts bidirectionally and verifies causally with the same "
                f"weights, which {name} cannot (Nemotron-Labs-Diffusion can)"
            )
        # a draft forward that recomputed committed columns would compute them with its adapter
        recomputes = config.cache == "none" or config.refresh != "vicinity" or config.refresh_every is not None
        if config.draft_adapter is not None and recomputes:
            raise ValueError(
                "draft_adapter: needs a cache that never recomputes what a verification committed "
                "(cache prefix or dual, refresh vicinity, no refresh_every)"
            )
        return cls(config)

    def canvas(self, carry, step: int) -> int:
        return 0 if carry == VERIFY else self.length

    def adapter(self, config, carry, step: int, block: int) -> str | None:
        """Drafts decode with `draft_adapter`; the prompt's pass (the first block's first step) and
        verifications with the row's own adapter, as the reference turns its LoRA off for them."""
        drafting = carry != VERIFY and (block, step) != (0, 0)
        return (config.draft_adapter or config.adapter) if drafting else config.adapter

    def _draw(self, logits: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (T,) and their probabilities for logits (T, V): the argmax and its softmax
        probability, or at a temperature one draw per position from softmax(logits / T)."""
        temperature = self.config.temperature
        if temperature > 0 and generator is not None:
            probs = (logits / temperature).softmax(-1)
            tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            probs = logits.softmax(-1)
            tokens = logits.argmax(-1)
        return tokens, probs.gather(-1, tokens[:, None])[:, 0]

    def decide(self, logits, view: DecodeView) -> Decision:
        block, later, mask_id = view.block, view.later, view.mask_id
        window = torch.cat([block, later], 1)  # (B, length + 1)
        bsz, n = window.shape
        masked = window == mask_id
        tokens = window.clone()
        chosen = torch.zeros_like(masked)
        remasked = torch.zeros_like(masked)
        done = torch.zeros(bsz, dtype=torch.bool, device=window.device)
        final = torch.zeros(bsz, dtype=torch.long, device=window.device)
        accepted = torch.full((bsz,), -1, dtype=torch.long, device=window.device)
        carry: list = [None] * bsz
        stops = set(view.stop_ids.tolist()) if view.stop_ids is not None else set()
        rows = window.tolist()
        for i in range(bsz):
            generator = None if view.generators is None else view.generators[i]
            config = view.configs[i] if view.configs else self.config
            last = view.clock.extents[i] - config.columns_past_answer - 1  # the answer's last column
            column = view.clock.starts[i]
            if rows[i][0] == mask_id:  # the prompt's causal pass: the first token
                token, _ = self._draw(logits[i, :1], generator)
                tokens[i, 0], chosen[i, 0] = token[0], True
                done[i] = (config.stop_at_eos and int(token[0]) in stops) or column >= last
                continue
            if view.carry is not None and view.carry[i] == VERIFY:
                ar, _ = self._draw(logits[i, 1:n], generator)  # ar[j]: the causal prediction of j + 1
                ar = _not_mask(ar, logits[i, 1:n], mask_id)
                drafts, predicted = rows[i][1 : n - 1], ar[: n - 2].tolist()
                a = 1
                while a < n - 1 and predicted[a - 1] == drafts[a - 1]:
                    a += 1
                tokens[i, a], chosen[i, a] = ar[a - 1], True
                remasked[i, a + 1 :] = ~masked[i, a + 1 :]
                done[i], accepted[i] = True, _kept(ar[:a].tolist(), last - column, stops if config.stop_at_eos else ())
                # the correction is final too where the answer ends with it (at or past its last
                # column) or where it is a stop token: the reference stops there
                ends = column + a >= last or (config.stop_at_eos and int(ar[a - 1]) in stops)
                final[i] = a if ends else a - 1
                continue
            draft, conf = self._draw(logits[i, : n - 1], generator)
            draft = _not_mask(draft, logits[i, : n - 1], mask_id)
            open_ = masked[i, : n - 1]
            take = self.rule.select(conf[None], open_[None], None, None, None)[0]
            tokens[i, : n - 1] = torch.where(take, draft, tokens[i, : n - 1])
            chosen[i, : n - 1] = take
            carry[i] = VERIFY if bool((open_ & ~take).sum() == 0) else DRAFT
        return Decision(
            tokens[:, :1],
            chosen[:, :1],
            ahead_tokens=tokens[:, 1:],
            ahead=chosen[:, 1:],
            block_done=done,
            carry=carry,
            remasked=remasked,
            final_later=final,
            accepted=accepted,
        )


def _kept(accepted: list[int], room: int, stops) -> int:
    """What of a verification's accepted tokens the answer keeps (its acceptance length as
    reported): up to its first stop token, and no further than the answer's last column (`room`
    positions after the verified token)."""
    kept = min(len(accepted), room)
    for j, t in enumerate(accepted[:kept]):
        if t in stops:
            return j + 1
    return kept


def _not_mask(tokens: torch.Tensor, logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """`tokens` with a drawn [MASK] replaced by the most likely other token."""
    if not bool((tokens == mask_id).any()):
        return tokens
    guarded = logits.clone()
    guarded[..., mask_id] = float("-inf")
    return torch.where(tokens == mask_id, guarded.argmax(-1), tokens)
