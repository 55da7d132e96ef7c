"""LLaDA2's decoding: its proposal, LLaDA2.0's early stop and LLaDA2.1's token editing (DMax decodes
with it too)."""

from __future__ import annotations

import torch

from ..registry import PROPOSALS
from .proposals import Proposal
from .sampling import filter_top_p_top_k, sample_each


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


def stop_at_first_stop(window, revealed, view, asking) -> torch.Tensor:
    """LLaDA2.0's `eos_early_stop`, as the positions it fills with EOS (B, W): a row whose block holds
    a revealed stop token with no masked position before it is done now; the block's masks after it
    become EOS (as everything after a stop is), so it takes no more steps. `window` is the window
    after the step's decision, `revealed` where a step revealed its token, `asking` (B,) the rows
    whose config asks for it.

    The published 2.0 generate looks for the first `eos_id` in the whole sequence, prompt included
    (a prompt holding that token ends the answer at once, before its start); here only revealed
    answer tokens count, and they are the model's stop tokens, as for `stop_at_eos`. The answer up to
    the stop is the same as without early stopping (revealed tokens are final); only the steps after
    it are saved.

    LLaDA2.1's loop (token editing on) has its own rule, which is `stop_at_eos`'s: it stops only after
    a block, once the answer so far has no mask and holds EOS, so editing may still rewrite an early
    EOS and the tokens before it. A decoder that edits therefore has no early stop of its own."""
    blk = view.block.shape[1]
    block = window[:, :blk]
    masked = block == view.mask_id
    stop = torch.isin(block, view.stop_ids) & revealed[:, :blk]
    first = stop.int().argmax(-1, keepdim=True)
    stopped = stop.any(-1) & (masked.cumsum(-1).gather(-1, first).squeeze(-1) == 0) & asking
    fill = torch.zeros_like(revealed)
    fill[:, :blk] = stopped[:, None] & masked
    return fill
