"""The decoding loop: a batch of rows, each on its own clock.

Every row's answer region (its `gen_length` positions after its prompt) starts as all [MASK] and is
decoded in blocks of `block_length`, left to right. A step is one forward of every row in the batch
(`step`): the *cache policy* (`cache_policies.py`) gives each row's current block its logits, the
*unmasking strategy* (`unmasking.py`) decides what each row reveals (`UnmaskingStrategy.decide`),
and the loop writes it. A row's block ends at the step that reveals its last mask; at the next
step the row starts its next block (and a caching policy refreshes its cache), whatever the other
rows are doing. A row that stops (a stop token in a finished block, or its last block) leaves the
batch at once, and a row that `add` queues joins at the next step. So every row in a forward needs
it: no row waits in the batch for another row's block to end. Positions after the current block
are never revealed (but with multi-block decoding, the blocks right after it).

The layout: the rows sit in one (B, L) tensor so that every row's current block occupies the same
columns [start, start + block_length): a row's prompt and finished blocks lie to the left of it
(left-padded), its masked rest to the right (right-padded when rows have less of their answers left
than others). When rows leave, join or move to their next block, the layout is rebuilt (`_relayout`)
and each row's cached K/V move with it. Padding is masked out of attention and RoPE positions
count only real tokens, so a row sees what it would see alone.

Rows may join when their configs differ at most in the answer's length and its steps (`join_key`):
each row follows its own schedule, threshold and random stream (a row draws only at its own
steps), and its own refresh decisions (a row at its block's first step gets its block-start
forward while the others take their cached steps, each group in a forward of its own). Rows of
equal layout decode bit-identically in float32 whatever else is in the batch. Padding and batch
size change how the forwards' sums are split and rounded (a padded row's logits move by ~1e-5 in
float32, up to ~1 in bfloat16), so a near-tied token can then differ; with `deterministic=True`
every row decodes bit-identically to alone (`models.invariance`).

A block ends at the step that reveals its last mask. *Deliberate difference*: Fast-dLLM's cached
loops (prefix and DualCache) always run at least one cached forward after the block-start forward,
so when that forward already completes the block they spend one more that reveals nothing; we do
not, so our NFE there is theirs less one per such block, with the same tokens
(`tests/test_reference.py` runs the reference's own code to check both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from ..config import GenerationConfig, is_int
from ..models.transformer import positions_from_mask
from .cache_policies import SequenceView
from .policies import PolicySource, resolve
from .unmasking import BlockClock


def join_key(config: GenerationConfig):
    """What must be equal for rows to decode in one batch: the config but the answer's length and
    its steps (every row follows its own step schedule)."""
    return config.replace(gen_length=config.block_length, steps=None)


@dataclass(eq=False)
class Row:
    """One prompt being decoded, with what it cost (as decoded alone)."""

    prompt: torch.Tensor  # (P,) token ids before its decoding region
    config: GenerationConfig  # its region's length (gen_length) and steps; the decoding fields are the batch's
    generator: torch.Generator | None
    tag: object = None  # the caller's handle (the server's job)
    block: int = 0  # the block it decodes now (or next, once it left)
    step: int = 0  # the steps it took in that block
    # blocks before the current one that became final without a forward of their own since its
    # last block-start forward (multi-block decoding revealed them whole): a refresh recomputes them
    unrefreshed: int = 0
    finished: bool = False  # stopped at a stop token
    answer: torch.Tensor | None = None  # (gen_length,) once it left the batch (EOS-filled after a stop)
    unmask_step: torch.Tensor | None = None  # (gen_length,) the row's step revealing each position
    nfe: int = 0  # forwards it took part in
    tokens_per_step: list[int] = field(default_factory=list)  # positions revealed (edits not counted)
    forward_positions: int = 0  # query positions of those forwards
    attended_positions: int = 0  # query x key positions
    # A block-causal model's blocks lie at fixed positions (p // block_size), so a prompt that ends
    # inside one shares it with the answer's first tokens: those prompt tokens (`lead_tokens`) open
    # the row's decoding region, already revealed, and the region is one block longer than the
    # answer (`asked` tokens), as the references decode to the end of the block holding the last one.
    asked: int = 0
    lead_tokens: torch.Tensor | None = None
    # A grammar its answer must follow (`constraints.GrammarConstraint`): it amends every step's
    # choice so the answer is revealed left to right, each token checked.
    constraint: object = None

    @property
    def lead(self) -> int:
        return 0 if self.lead_tokens is None else len(self.lead_tokens)

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def prompt_positions(self) -> int:
        """Its prompt's length: the work of one prefill (an autoregressive model's share of the prompt)."""
        return len(self.prompt) + self.lead

    def answer_span(self, block: int, block_length: int) -> tuple[int, int, int, int]:
        """Where block `block` of the region lies in the answer: (answer from, to, block from, to),
        clipped to the answer's `asked` positions."""
        lo, hi = block * block_length - self.lead, (block + 1) * block_length - self.lead
        a_lo, a_hi = max(0, lo), min(self.asked, hi)
        return a_lo, max(a_lo, a_hi), a_lo - lo, max(a_lo, a_hi) - lo

    @property
    def done(self) -> bool:
        return self.answer is not None


@dataclass
class Step:
    """What one step did: the rows that took part (all of the batch), each one's block at the
    step, the block's tokens after it (B, block_length), and what it revealed (`chosen`) and
    rewrote (`edited`, None without editing) there."""

    rows: list[Row]
    blocks: list[int]
    tokens: torch.Tensor
    chosen: torch.Tensor
    edited: torch.Tensor | None = None


def prepare_inputs(model, input_ids, attention_mask, config: GenerationConfig):
    """Left-pad a list of prompts (or check a padded tensor); returns ids (B, P) and mask (B, P)."""
    pad_id = model.args.eos_token_id
    vocab = model.args.vocab_size
    if (
        input_ids is None
        or isinstance(input_ids, (str, bytes))
        or (isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], str))
    ):
        raise ValueError(
            "input_ids: generate() takes token ids (a list of ints, a list of lists, or a tensor); "
            "for text use fastdllm.generate_text(model, tokenizer, text)"
        )
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
            raise ValueError(f"input_ids: token ids must be integers, got a {input_ids.dtype} tensor")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"input_ids: token ids must be in [0, {vocab})")
        ids = input_ids.to(model.device, torch.long)
        if attention_mask is None:
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            mask = attention_mask.to(model.device).bool()
            if mask.shape != ids.shape:
                raise ValueError("attention_mask: must have the shape of input_ids")
            if not mask[:, -1].all() or (mask[:, 1:].long() < mask[:, :-1].long()).any():
                raise ValueError("attention_mask: prompts must be left-padded (ones at the end of every row)")
    else:
        input_ids = list(input_ids)
        if not input_ids:
            raise ValueError("input_ids: empty batch")
        rows = (
            [input_ids]
            if not isinstance(input_ids[0], (list, tuple, torch.Tensor))
            else [list(r.tolist() if isinstance(r, torch.Tensor) else r) for r in input_ids]
        )
        for r in rows:
            for t in r:
                if not is_int(t):
                    raise ValueError(f"input_ids: token ids must be integers, got {t!r} ({type(t).__name__})")
                if not 0 <= t < vocab:
                    raise ValueError(f"input_ids: token id {t} is outside the vocabulary [0, {vocab})")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
                mask[i, width - len(r) :] = True
        ids, mask = ids.to(model.device), mask.to(model.device)
    if ids.shape[1] == 0 or (mask.sum(-1) == 0).any():
        raise ValueError("input_ids: empty prompt (every row needs at least one token)")
    if ((ids == model.mask_token_id) & mask).any():
        raise ValueError(f"input_ids: a prompt contains the mask token (id {model.mask_token_id})")
    if ids.shape[1] + config.gen_length > model.args.max_seq_len:
        raise ValueError(
            f"gen_length: prompt ({ids.shape[1]} tokens) + gen_length ({config.gen_length}) exceeds the "
            f"model's max_sequence_length ({model.args.max_seq_len})"
        )
    return ids, mask


def row_generators(config: GenerationConfig, batch: int, row_seeds, device) -> list[torch.Generator]:
    if row_seeds is not None:
        if len(row_seeds) != batch:
            raise ValueError(f"row_seeds: need one seed per row ({batch}), got {len(row_seeds)}")
        seeds = list(row_seeds)
    else:
        base = config.seed if config.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        seeds = [base + i for i in range(batch)]
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


class ForwardClock:
    """Time inside the forwards, without waiting for the device: on a GPU each forward is
    bracketed by CUDA events, read once when the total is asked for; on a CPU, the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list[tuple] = []
        self.wall = 0.0

    def __enter__(self):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append((start, torch.cuda.Event(enable_timing=True)))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.events[-1][1].record()
        else:
            self.wall += time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        if not self.events:
            return self.wall
        self.events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.events) / 1000


class BlockDecoder:
    """The loop. `add` rows (they join at the next step), then `step` decodes one step of every
    row in the batch; `rows` are the rows in the batch, and after a step `last_blocks` holds the
    blocks that became final in it ((row, block, tokens)) and `left` the rows that left.

    `policies` (see `fastdllm.engine.policies`; default: those the config names, `policies_for`), or
    `cache` / `strategy` alone, are the objects it decodes with: a new policy plugs in here."""

    def __init__(
        self,
        model,
        config: GenerationConfig,
        policies: PolicySource = None,
    ):
        self.model, self.config = model, config
        family = getattr(model, "family", None)
        if (
            model.args.block_size
            and config.block_length != model.args.block_size
            and not (family is not None and family.rules.any_decoding_block)
        ):
            raise ValueError(
                f"block_length: must be {model.args.block_size} for this model, whose attention is "
                f"block-causal in blocks of {model.args.block_size} (got {config.block_length})"
            )
        self.key = join_key(config)
        policies = resolve(policies, model, config)
        self.policy, self.strategy = policies.cache, policies.strategy
        self.device = model.device
        self.mask_id = model.mask_token_id
        self.stop_ids = torch.tensor(sorted(set(model.stop_token_ids)), device=self.device)
        self.rows: list[Row] = []
        self.joining: list[Row] = []
        self.left: list[Row] = []
        self.last_blocks: list[tuple[Row, int, list[int]]] = []
        self.nfe = 0  # forwards
        # what the forwards computed: rows summed over them, and query positions (padding included)
        self.row_forwards = self.computed_positions = 0
        self.forward_clock = ForwardClock(self.device)
        self.start = 0  # the column of every row's current block
        self.window_end = 0  # the end of the blocks a step decodes: the current one and those after it
        self.lookahead = self.strategy.lookahead
        self.editing = self.strategy.editing
        # per row of the layout: tokens, whether a column is the row's (not padding), the row's
        # step that revealed each position (-1: masked or a prompt token)
        self.x = self.valid = self.step_of = None
        # per row: its steps so far (the index `step_of` records), its current block's masks when
        # it began, and with editing the block's steps after its last mask and whether it goes on
        self.row_nfe = self.opened = self.post = self.alive = None

    # -- rows in
    def accepts(self, config: GenerationConfig) -> bool:
        """Whether rows of `config` can join this batch."""
        return join_key(config) == self.key

    def add(
        self,
        input_ids,
        attention_mask=None,
        row_seeds=None,
        config: GenerationConfig | None = None,
        tags=None,
        constraints=None,
    ) -> list[Row]:
        """Rows that join at the next step (validated now: a bad prompt is refused here, alone).
        `config` may differ from the batch's in gen_length and steps only (see `join_key`).
        `constraints`: per row, None or the grammar its answer follows (`constraints.py`)."""
        config = config or self.config
        if not self.accepts(config):
            raise ValueError("config: these rows cannot join this batch (their decoding fields differ)")
        ids, mask = prepare_inputs(self.model, input_ids, attention_mask, config)
        gens = (
            row_generators(config, ids.shape[0], row_seeds, self.device)
            if self.strategy.draws_randomness
            else [None] * ids.shape[0]
        )
        tags = [None] * ids.shape[0] if tags is None else list(tags)
        rows = [self._row(ids[i][mask[i]], config, gens[i], tags[i]) for i in range(ids.shape[0])]
        if constraints is not None:
            if len(constraints) != len(rows):
                raise ValueError(f"constraints: {len(constraints)} given for {len(rows)} rows")
            for r, c in zip(rows, constraints):
                if c is not None and r.lead:
                    raise ValueError("constraints: a prompt ending inside a block-causal block is not supported yet")
                if c is not None:
                    c.fit_within(config.gen_length)
                r.constraint = c
        self.joining.extend(rows)
        return rows

    def _row(self, prompt, config, generator, tag) -> Row:
        blk = self.config.block_length
        lead = len(prompt) % blk if self.model.args.block_size else 0
        if not lead:
            return Row(prompt, config, generator, tag, asked=config.gen_length)
        region = config.replace(
            gen_length=config.gen_length + blk,
            steps=None if config.steps is None else config.steps + config.steps // config.num_blocks,
        )
        return Row(prompt[:-lead], region, generator, tag, asked=config.gen_length, lead_tokens=prompt[-lead:])

    def drop(self, rows: list[Row]) -> None:
        """Rows that stop now (their caller no longer wants them): they leave before the next step."""
        gone = set(map(id, rows))
        self.joining = [r for r in self.joining if id(r) not in gone]
        if any(id(r) in gone for r in self.rows):
            self._relayout([(r, i, 0) for i, r in enumerate(self.rows) if id(r) not in gone])

    @property
    def forward_time(self) -> float:
        """Seconds inside the model's forwards so far."""
        return self.forward_clock.seconds

    @property
    def active(self) -> bool:
        return bool(self.rows or self.joining)

    def current_block(self) -> torch.Tensor:
        """(B, block_length) the rows' current blocks (a view)."""
        return self.x[:, self.start : self.start + self.config.block_length]

    # -- one step
    def step(self) -> Step | None:
        """One step of every row in the batch (rows that joined are laid out first): the forward,
        the strategy's decision, written into the layout; then the rows whose block it ended move
        to their next block or leave. None when no row is left."""
        self.last_blocks, self.left = [], []
        if self.joining:
            new, self.joining = self.joining, []
            self._relayout([(r, i, 0) for i, r in enumerate(self.rows)] + [(r, None, 0) for r in new])
        if not self.rows:
            return None
        rows, blk, mask_id = self.rows, self.config.block_length, self.mask_id
        start, end = self.start, self.start + blk
        block = self.x[:, start:end]  # a view: writes go straight into the layout
        with self.forward_clock, record_function("fastdllm.forward"):
            logits = self.policy.block_logits(self._view(), start, self.window_end, [r.step for r in rows])
        work = self.policy.take_work()
        self.nfe += len(work)
        region = self.step_of[:, start:end]  # the row's step index of each revealed position
        later = self.x[:, end : self.window_end] if self.window_end > end else None
        had_mask = (block == mask_id).any(-1)
        editable = None if self.editing is None else (region >= 0) & (block != mask_id)  # not a prompt token
        clock = BlockClock([r.step for r in rows], [r.config.steps_per_block()[r.block] for r in rows], self.opened)
        generators = [r.generator for r in rows] if self.strategy.draws_randomness else None
        constraints = {i: r.constraint for i, r in enumerate(rows) if r.constraint is not None}
        decision = self.strategy.decide(logits, block, clock, generators, mask_id, later, editable, constraints)
        # the decision, written without a host read (torch.where, not block[chosen] = ...)
        if decision.edited is not None:
            block.copy_(torch.where(decision.edited, decision.tokens, block))
        block.copy_(torch.where(decision.chosen, decision.tokens, block))
        region.copy_(torch.where(decision.chosen, self.row_nfe[:, None], region))
        if later is not None:
            later.copy_(torch.where(decision.ahead, decision.ahead_tokens, later))
            later_region = self.step_of[:, end : self.window_end]
            later_region.copy_(torch.where(decision.ahead, self.row_nfe[:, None], later_region))
        self.row_nfe += 1
        if self.config.eos_early_stop and self.editing is None:
            self._stop_early(block)
        for r in rows:
            r.step += 1
        done = self._block_over(block, had_mask, decision.edited)
        record = Step(list(rows), [r.block for r in rows], block.clone(), decision.chosen, decision.edited)
        self._after_step(record, done, decision.revealed(), work)
        return record

    def _block_over(self, block, had_mask, edited) -> torch.Tensor:
        """(B,) whether each row's block is over after this step: it has no mask left; with
        editing, its first step after the last mask that edits nothing, or `max_post_steps` such
        steps, ends it."""
        has_mask = (block == self.mask_id).any(-1)
        if self.editing is None:
            return ~has_mask
        self.alive &= had_mask | edited.any(-1)
        self.post += ~has_mask & self.alive
        self.alive &= has_mask | (self.post <= self.editing.max_post_steps)
        return ~self.alive

    def _after_step(self, record: Step, done: torch.Tensor, revealed: torch.Tensor, work) -> None:
        """Charge the step to its rows, then end the blocks that are over: those rows leave or
        move to their next block (past any that the blocks before revealed whole). One read from
        the device: the window's tokens, and per row whether its block is over, what it revealed
        and whether the block holds a stop token."""
        blk, rows = self.config.block_length, self.rows
        start, end = self.start, self.start + blk
        window = self.x[:, start : self.window_end]
        hit = torch.isin(window[:, :blk], self.stop_ids) & (self.step_of[:, start:end] >= 0)
        hit = hit.any(-1) if self.config.stop_at_eos else torch.zeros_like(done)
        # blocks after the current one that are whole already (multi-block decoding)
        n_later = (self.window_end - end) // blk
        whole = torch.zeros_like(revealed)
        if n_later and (self.editing is None or self.editing.max_post_steps == 0):
            later_masked = (window[:, blk : blk + n_later * blk] == self.mask_id).view(len(rows), n_later, blk)
            whole = (~later_masked.any(-1)).long().cumprod(-1).sum(-1)
        parts = [done.long()[:, None], revealed[:, None], hit.long()[:, None], whole[:, None], window]
        host = torch.cat(parts, 1).tolist()
        for i, r in enumerate(rows):
            r.tokens_per_step.append(host[i][1])
        for served, queries, keys in work:
            self.row_forwards += len(rows) if served is None else len(served)
            self.computed_positions += queries * (len(rows) if served is None else len(served))
            for i in range(len(rows)) if served is None else served:
                r = rows[i]
                r.nfe += 1
                r.forward_positions += queries
                r.attended_positions += queries * keys
        if not any(h[0] for h in host):
            return
        stops = set(self.stop_ids.tolist())
        moves = []
        for i, (r, h) in enumerate(zip(rows, host)):
            if not h[0]:
                moves.append((r, i, 0))
                continue
            tokens, first = h[4:], r.block
            r.finished, r.unrefreshed = bool(h[2]), 0
            k = 0
            while True:
                _, _, b_lo, b_hi = r.answer_span(r.block, blk)
                self.last_blocks.append((r, r.block, tokens[k * blk + b_lo : k * blk + b_hi]))
                r.block += 1
                k += 1
                if r.finished or r.block == r.num_blocks or k > h[3]:
                    break
                r.unrefreshed += 1  # revealed whole while it was a later block: no forward of its own
                r.finished = self.config.stop_at_eos and any(t in stops for t in tokens[k * blk : (k + 1) * blk])
            if r.finished or r.block == r.num_blocks:
                self._leave(i, r, start - first * blk)
            else:
                r.step = 0
                moves.append((r, i, k))
        self._relayout(moves)

    def _stop_early(self, block: torch.Tensor) -> None:
        """LLaDA2.0's `eos_early_stop`: a row whose block holds a revealed stop token with no masked
        position before it is done now; the block's masks after it become EOS (as everything after a
        stop is), so it takes no more steps.

        The published 2.0 generate looks for the first `eos_id` in the whole sequence, prompt
        included (a prompt holding that token ends the answer at once, before its start); here only
        revealed answer tokens count, and they are the model's stop tokens, as for `stop_at_eos`. The
        answer up to the stop is the same as without early stopping (revealed tokens are final); only
        the steps after it are saved.

        LLaDA2.1's loop (token editing on) has its own rule, which is `stop_at_eos`'s: it stops only
        after a block, once the answer so far has no mask and holds EOS, so editing may still
        rewrite an early EOS and the tokens before it. With editing this is therefore not called."""
        start, end = self.start, self.start + self.config.block_length
        masked = block == self.mask_id
        stop = torch.isin(block, self.stop_ids) & (self.step_of[:, start:end] >= 0)
        first = stop.int().argmax(-1, keepdim=True)
        stopped = stop.any(-1) & (masked.cumsum(-1).gather(-1, first).squeeze(-1) == 0)
        block[stopped[:, None] & masked] = self.model.args.eos_token_id

    def _leave(self, i: int, r: Row, region_start: int) -> None:
        blk, n = self.config.block_length, r.asked
        first = region_start + r.lead  # the row's answer starts here
        r.answer = self.x[i, first : first + n].clone()
        r.unmask_step = self.step_of[i, first : first + n].clone()
        if r.finished:
            r.answer[r.block * blk - r.lead :] = self.model.args.eos_token_id
        self.left.append(r)

    # -- layout
    def _view(self) -> SequenceView:
        """What the forwards see: with a suffix window, the sequence only up to `cut` (the masked
        tail after it is not part of any forward until the window reaches it)."""
        cfg, rows, length = self.config, self.rows, self.x.shape[1]
        cut = length if cfg.suffix_window is None else min(length, self.window_end + cfg.suffix_window)
        km = self.key_mask
        return SequenceView(
            self.x[:, :cut],
            self.positions[:, :cut],
            None if km is None else km[..., :cut],
            block=rows[0].block,
            block_length=cfg.block_length,
            capacity=length,
            row_blocks=tuple(r.block for r in rows),
            refresh_blocks=1 + rows[0].unrefreshed,
            row_refresh=tuple(1 + r.unrefreshed for r in rows),
        )

    def _relayout(self, moves: list[tuple[Row, int | None, int]]) -> None:
        """Lay the rows out again: `moves` are the new layout's rows in order, each with its index in
        the old layout (None: a row that joins) and the blocks it moved on since. Every row's current
        block lands at the new `start`; a row's cached K/V move with it (`CachePolicy.relayout`)."""
        blk, dev = self.config.block_length, self.device
        self.rows = [r for r, _, _ in moves]
        if not moves:
            self.x = self.valid = self.step_of = self.row_nfe = self.opened = self.post = self.alive = None
            self.policy.relayout([], [], 0)
            return
        lefts = [len(r.prompt) + r.block * blk for r, _, _ in moves]
        rights = [r.config.gen_length - r.block * blk for r, _, _ in moves]
        start = max(lefts)
        length = start + max(rights)
        bsz = len(moves)
        x = torch.full((bsz, length), self.model.args.eos_token_id, dtype=torch.long, device=dev)
        valid = torch.zeros((bsz, length), dtype=torch.bool, device=dev)
        step_of = torch.full((bsz, length), -1, dtype=torch.long, device=dev)
        shifts: list[int | None] = []
        for i, ((r, src, moved), left, right) in enumerate(zip(moves, lefts, rights)):
            lo = start - left
            if src is None:
                p = len(r.prompt)
                x[i, lo : lo + p] = r.prompt
                x[i, start : start + right] = self.mask_id
                if r.lead:
                    x[i, start : start + r.lead] = r.lead_tokens
                valid[i, lo : start + right] = True
                shifts.append(None)
                continue
            old_lo = self.start + moved * blk - left  # where its columns began in the old layout
            shift = lo - old_lo
            x[i, lo : start + right] = self.x[src, old_lo : old_lo + left + right]
            valid[i, lo : start + right] = True
            step_of[i, lo : start + right] = self.step_of[src, old_lo : old_lo + left + right]
            shifts.append(shift)
        sources = [src for _, src, _ in moves]
        self.row_nfe = self._carry(self.row_nfe, sources, 0)
        self.opened = self._carry(self.opened, sources, 0)
        if self.editing is not None:
            self.post = self._carry(self.post, sources, 0)
            self.alive = self._carry(self.alive, sources, True)
        self.policy.relayout(sources, shifts, length)
        self.start = start
        self.x, self.valid, self.step_of = x, valid, step_of
        self.positions = positions_from_mask(valid, bsz, length, dev)
        padded = any(left != start for left in lefts) or any(right != length - start for right in rights)
        self.key_mask = valid[:, None, None, :] if padded else None
        depth = 1 if self.lookahead is None else self.lookahead.depth
        self.window_end = min(length, start + depth * blk)
        # rows that begin a block: its masks now, and with editing its state
        began = [i for i, (r, src, moved) in enumerate(moves) if src is None or moved]
        if began:
            idx = torch.tensor(began, device=dev)
            masked = x[idx, start : start + blk] == self.mask_id
            self.opened[idx] = masked.sum(-1)
            if self.editing is not None:
                self.post[idx] = (~masked.any(-1)).long()
                self.alive[idx] = True

    def _carry(self, values: torch.Tensor | None, sources: list[int | None], fill) -> torch.Tensor:
        """Per-row values for the new layout: a kept row's own, `fill` for a row that joins."""
        dtype = torch.bool if isinstance(fill, bool) else torch.long
        out = torch.full((len(sources),), fill, dtype=dtype, device=self.device)
        kept = [(i, s) for i, s in enumerate(sources) if s is not None]
        if kept and values is not None:
            out[torch.tensor([i for i, _ in kept], device=self.device)] = values[
                torch.tensor([s for _, s in kept], device=self.device)
            ]
        return out
