"""The loop's rows as (B, L) tensors (`Layout`), rebuilt only when rows join or leave, and what one
step's decisions read from and write into it (`Part`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode import Decision
from .logprobs import LogprobColumns
from .rows import Row, Step, carried


@dataclass
class Part:
    """Rows of a step that share a block length and width (`members`, their places in the layout;
    `at` the same as a tensor, None where they are every row), decided and written together: their
    windows' layout columns, tokens and revealing steps after the decision, the decision, and
    whether each row's block is over."""

    members: list[int]
    at: torch.Tensor | None
    columns: torch.Tensor
    window: torch.Tensor
    steps_of: torch.Tensor
    decision: Decision
    done: torch.Tensor


class Layout:
    """Every row of the batch from column 0 (its prompt, then its region and suffix; a column's
    RoPE position is its index): its tokens (`x`) and the row's step that revealed each position
    (`step_of`, -1: masked or a prompt token); per row its steps so far (`row_nfe`), the masks its
    current block began with (`opened`) and whether it stops at a stop token (`stopping`); with
    rows that report log-probabilities, theirs per column (`logprobs`). `width`: the most columns a
    step decodes from a row's block on (`Row.width`), which the layout holds past its longest row."""

    def __init__(self, model, width: int):
        self.model, self.width = model, width
        self.mask_id, self.device = model.mask_token_id, model.device
        self.x = self.step_of = self.row_nfe = self.opened = self.stopping = None
        self.logprobs: LogprobColumns | None = None

    def rebuild(self, moves: list[tuple[Row, int | None]]) -> None:
        """The layout of `moves` (the new layout's rows in order, each with its index in the old
        one, None for a row that joins): a kept row keeps its columns and counts, a row that joins
        gets its prompt, masks, fixed tokens and suffix."""
        dev = self.device
        if not moves:
            self.x = self.step_of = self.row_nfe = self.opened = self.stopping = self.logprobs = None
            return
        self.width = max(r.width for r, _ in moves)
        length = max(r.extent for r, _ in moves) + self.width
        bsz = len(moves)
        x = torch.full((bsz, length), self.model.args.eos_token_id, dtype=torch.long, device=dev)
        step_of = torch.full((bsz, length), -1, dtype=torch.long, device=dev)
        kept = [(i, src) for i, (_, src) in enumerate(moves) if src is not None]
        if kept:
            dst, src = (torch.tensor(t, device=dev) for t in zip(*kept))
            width = min(length, self.x.shape[1])
            x[dst, :width] = self.x[src, :width]
            step_of[dst, :width] = self.step_of[src, :width]
        self.logprobs = LogprobColumns.laid_out(self.logprobs, [r for r, _ in moves], length, kept, dev)
        for i, (r, src) in enumerate(moves):
            if src is None:
                p = len(r.prompt)
                x[i, :p] = r.prompt
                x[i, p : p + r.config.gen_length] = self.mask_id
                if r.lead:
                    x[i, p : p + r.lead] = r.lead_tokens
                for pos, t in r.fixed:
                    x[i, p + r.lead + pos] = t
                if r.suffix is not None:
                    x[i, p + r.config.gen_length : r.extent] = r.suffix
        sources = [src for _, src in moves]
        self.row_nfe = carried(self.row_nfe, sources, dev)
        self.opened = carried(self.opened, sources, dev)
        self.x, self.step_of = x, step_of
        self.stopping = torch.tensor([r.config.stop_at_eos for r, _ in moves], device=dev)

    # -- a step's parts
    def window(self, at: torch.Tensor | None, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and revealing steps at `columns` (B, W) of the rows `at` (None: every row)."""
        x, steps = (self.x, self.step_of) if at is None else (self.x[at], self.step_of[at])
        return x.gather(1, columns), steps.gather(1, columns)

    def write(self, at: torch.Tensor | None, columns: torch.Tensor, window, steps_of) -> None:
        if at is None:
            self.x.scatter_(1, columns, window)
            self.step_of.scatter_(1, columns, steps_of)
        else:
            self.x[at[:, None], columns] = window
            self.step_of[at[:, None], columns] = steps_of

    def host_read(self, p: Part, width: int, stop_ids: torch.Tensor, later_blocks_final: bool) -> torch.Tensor:
        """Part p's rows as the loop reads them after a step: per row whether its block is over,
        what it revealed, whether its block holds a stop token, how many later blocks are final,
        what a verification accepted, then its window (padded to `width`)."""
        blk, window, decision = p.decision.chosen.shape[1], p.window, p.decision
        revealed = decision.revealed_counts()
        hit = torch.isin(window[:, :blk], stop_ids) & (p.steps_of[:, :blk] >= 0)
        hit = hit.any(-1) & (self.stopping if p.at is None else self.stopping[p.at])
        # blocks after the current one that are whole already (multi-block decoding)
        n_later = window.shape[1] // blk - 1
        whole = torch.zeros_like(revealed)
        if n_later and later_blocks_final:
            later_masked = (window[:, blk:] == self.mask_id).view(len(p.members), n_later, blk)
            whole = (~later_masked.any(-1)).long().cumprod(-1).sum(-1)
        if decision.final_later is not None:  # the decoder's count, where it gives one
            whole = torch.where(decision.final_later >= 0, decision.final_later.to(whole.dtype), whole)
        accepted = decision.accepted if decision.accepted is not None else torch.full_like(revealed, -1)
        counts = [p.done.long(), revealed, hit.long(), whole, accepted]
        if window.shape[1] < width:
            window = torch.nn.functional.pad(window, (0, width - window.shape[1]), value=self.mask_id)
        return torch.cat([*(c[:, None] for c in counts), window], 1)

    # -- a row's blocks
    def begin(self, i: int, r: Row) -> None:
        """Row i starts a block: its masks now (a family with no mask token: its canvas, drawn now
        from the row's generator), and a thinking budget's token where it is due. `count_opened`
        then counts them."""
        r.soft = r.carry = None
        blk, start = r.block_length, r.block_start
        block = self.x[i, start : start + blk]
        opened = r.strategy.open_block(block, r.generator)
        if opened is not block:
            self.x[i, start : start + blk] = opened
        self._think_budget(i, r, start)

    def count_opened(self, began: list[tuple[int, Row]]) -> None:
        """The masks each row that just began a block ((place, row) pairs) holds in it, for them
        all at once."""
        if not began:
            return
        rows = [i for i, _ in began]
        starts, lengths = [r.block_start for _, r in began], [r.block_length for _, r in began]
        at = torch.tensor([rows, starts, lengths], device=self.device)
        span = torch.arange(max(lengths), device=self.device)
        block = self.x[at[0][:, None], at[1][:, None] + span]
        self.opened[at[0]] = ((block == self.mask_id) & (span < at[2][:, None])).sum(-1)

    def _think_budget(self, i: int, r: Row, start: int) -> None:
        """A thinking budget (`max_thinking_tokens`), as Nemotron-Labs-Diffusion's loops keep it: a
        block that opens at or past the budget, when the answer before it holds no end-of-thinking
        token, gets one at its first position from the budget's (a block of one position: its
        token, whatever decoded it, as its autoregressive mode and LinearSpec replace the next
        token; a longer block: placed before it decodes, as its diffusion mode does)."""
        budget, blk = r.config.max_thinking_tokens, r.block_length
        first = len(r.prompt) + r.lead  # the answer's first column
        if budget is None or start + blk <= first + budget or start >= first + r.asked:
            return
        end_think = self.model.end_think_token_id
        if bool((self.x[i, first:start] == end_think).any()):
            return
        self.x[i, max(start, first + budget)] = end_think

    def answer(self, i: int, r: Row) -> None:
        """Row i's answer and the step that revealed each of its positions, as it leaves (after a
        stop, EOS from its stopping block on)."""
        first, n = len(r.prompt) + r.lead, r.asked  # the row's answer starts at `first`
        r.answer = self.x[i, first : first + n].clone()
        r.unmask_step = self.step_of[i, first : first + n].clone()
        if r.finished:
            r.answer[r.block * r.block_length - r.lead :] = self.model.args.eos_token_id


def step_record(rows: list[Row], parts: list[Part], mask_id: int) -> Step:
    """A step as `Step` reports it: every row's block (and what the step revealed and rewrote there)
    in its place, a shorter block's padded."""
    if len(parts) == 1:
        p, blk = parts[0], rows[0].block_length
        return Step(list(rows), [r.block for r in rows], p.window[:, :blk], p.decision.chosen, p.decision.edited)
    longest, bsz, dev = max(r.block_length for r in rows), len(rows), parts[0].window.device
    tokens = torch.full((bsz, longest), mask_id, dtype=torch.long, device=dev)
    chosen = torch.zeros((bsz, longest), dtype=torch.bool, device=dev)
    edited = chosen.clone() if any(p.decision.edited is not None for p in parts) else None
    for p in parts:
        blk = p.decision.chosen.shape[1]
        tokens[p.at, :blk], chosen[p.at, :blk] = p.window[:, :blk], p.decision.chosen
        if p.decision.edited is not None:
            edited[p.at, :blk] = p.decision.edited
    return Step(list(rows), [r.block for r in rows], tokens, chosen, edited)
