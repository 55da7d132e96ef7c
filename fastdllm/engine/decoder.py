"""The decoding loop: a batch of rows decoded block by block, which rows join and leave at block
boundaries.

Every row's answer region (its `gen_length` positions after its prompt) starts as all [MASK] and is
decoded in blocks of `block_length`, left to right. Inside a block, each step asks the *cache
policy* (`cache_policies.py`) for the block's logits and the *unmasking policy* (`unmasking.py`)
which masked positions to reveal, until the block has no masks left. Then the next block starts (and
a caching policy refreshes its cache). Positions after the current block are never revealed.

The layout: the rows sit in one (B, L) tensor so that every row's current block occupies the same
columns [start, start + block_length). A row's prompt and finished blocks lie to the left of it
(left-padded), its masked rest to the right (right-padded when rows have less of their answers left
than others). Padding is masked out of attention and RoPE positions count only real tokens, so a
row sees what it would see alone. When every row starts together the layout is the plain left-padded
batch. A row that joins later (`add` while the batch runs) is laid out at the next block boundary:
its first block lines up with the others' current ones (the running rows move right if its prompt
is longer, their cached K/V with them) and from then on it decodes in step with them. Rows that are
done (a stop token in a finished block, or their last block) leave after each block.

Rows may join when their configs differ at most in the answer's length: the decoding fields, block
length and steps per block are the batch's (`join_key`); under a step schedule whose steps per
block are not all equal (steps not a multiple of the number of blocks) rows must start together.
A row decodes in a batch as alone: its own schedule, threshold and random stream (a row whose block
is done draws nothing while others finish theirs), its own refresh decisions (a row that just joined
gets a full forward at its first block while the others refresh their vicinity). Rows of equal
layout decode bit-identically in float32 whatever else is in the batch. Padding and batch size
change how the forwards' sums are split and rounded (a padded row's logits move by ~1e-5 in
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

from ..config import SELECTION_RULES, GenerationConfig, is_int, selection_rule_name
from ..models.transformer import positions_from_mask
from .cache_policies import SequenceView
from .policies import PolicySource, resolve


def join_key(config: GenerationConfig):
    """What must be equal for rows to decode in one batch: the config but the answer's length
    (and, with a step schedule, the total steps, when every block has the same number of steps)."""
    if not SELECTION_RULES[selection_rule_name(config)].uses_steps:  # e.g. the parallel rules
        return config.replace(gen_length=config.block_length, steps=None)
    per_block = set(config.steps_per_block())
    if len(per_block) == 1:
        return config.replace(gen_length=config.block_length, steps=per_block.pop())
    return config


@dataclass(eq=False)
class Row:
    """One prompt being decoded, with what it cost (as decoded alone)."""

    prompt: torch.Tensor  # (P,) token ids before its decoding region
    config: GenerationConfig  # its region's length (gen_length) and steps; the decoding fields are the batch's
    generator: torch.Generator | None
    tag: object = None  # the caller's handle (the server's job)
    block: int = 0  # the block it decodes next
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
    """The loop. `add` rows (they join at the next block boundary), then `run_block` decodes one
    block of every row; `rows` are the rows in the batch, `left` those that left after the last
    block and `last_blocks` what each row of it decoded.

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
        self.rule = self.strategy.new_rule()
        self.device = model.device
        self.mask_id = model.mask_token_id
        self.stop_ids = torch.tensor(sorted(set(model.stop_token_ids)), device=self.device)
        self.rows: list[Row] = []
        self.joining: list[Row] = []
        self.left: list[Row] = []
        self.last_blocks: list[tuple[Row, int, list[int]]] = []
        self.nfe = 0
        self.forward_clock = ForwardClock(self.device)
        self.start = 0  # the column of every row's current block
        self.window_end = 0  # the end of the blocks the step decodes: the current one and those after it
        self.lookahead = self.strategy.lookahead
        # blocks that ended without a forward of their own (the blocks after the current one
        # revealed them whole): a vicinity refresh recomputes them too
        self.unrefreshed = 0
        self.x = self.valid = self.step_of = self.row_nfe = None

    # -- rows in
    def accepts(self, config: GenerationConfig) -> bool:
        """Whether rows of `config` can join this batch now."""
        if join_key(config) != self.key:
            return False
        schedule_varies = self.key == self.config and len(set(self.config.steps_per_block())) > 1
        return not (schedule_varies and any(r.block > 0 for r in self.rows))

    def add(
        self,
        input_ids,
        attention_mask=None,
        row_seeds=None,
        config: GenerationConfig | None = None,
        tags=None,
        constraints=None,
    ) -> list[Row]:
        """Rows that join at the next block boundary (validated now: a bad prompt is refused here,
        alone). `config` may differ from the batch's in gen_length only (see `join_key`).
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
        """Rows that stop now (their caller no longer wants them): they leave before the next block."""
        gone = set(map(id, rows))
        self.joining = [r for r in self.joining if id(r) not in gone]
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) < len(self.rows):
            self._keep(keep)

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

    # -- layout
    def _admit(self) -> None:
        new, self.joining = self.joining, []
        blk, old = self.config.block_length, self.rows
        old_start = self.start if old else 0
        start = max([old_start] + [len(r.prompt) for r in new])
        shift = start - old_start
        remaining = [r.config.gen_length - r.block * blk for r in old] + [r.config.gen_length for r in new]
        bsz, length = len(old) + len(new), start + max(remaining)
        x = torch.full((bsz, length), self.model.args.eos_token_id, dtype=torch.long, device=self.device)
        valid = torch.zeros((bsz, length), dtype=torch.bool, device=self.device)
        step_of = torch.full((bsz, length), -1, dtype=torch.long, device=self.device)
        if old:
            width = self.x.shape[1]
            x[: len(old), shift : shift + width] = self.x
            valid[: len(old), shift : shift + width] = self.valid
            step_of[: len(old), shift : shift + width] = self.step_of
        for j, r in enumerate(new):
            i, p = len(old) + j, len(r.prompt)
            x[i, start - p : start] = r.prompt
            x[i, start : start + r.config.gen_length] = self.mask_id
            if r.lead:
                x[i, start : start + r.lead] = r.lead_tokens
            valid[i, start - p : start + r.config.gen_length] = True
        self.row_nfe = (
            torch.cat([self.row_nfe, torch.zeros(len(new), dtype=torch.long, device=self.device)])
            if old
            else torch.zeros(bsz, dtype=torch.long, device=self.device)
        )
        self.policy.relayout(list(range(len(old))) + [None] * len(new), shift, length)
        self.rows, self.start = old + new, start
        self._set(x, valid, step_of)

    def _set(self, x, valid, step_of) -> None:
        self.x, self.valid, self.step_of = x, valid, step_of
        self.positions = positions_from_mask(valid, *valid.shape, self.device)
        self.key_mask = None if bool(valid.all()) else valid[:, None, None, :]
        self.generators = [r.generator for r in self.rows]

    def _keep(self, keep: list[int]) -> None:
        """Rows `keep` stay; the layout loses the columns no remaining row needs (padding of every
        one of them on the left, and on the right)."""
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.x = self.valid = self.step_of = self.row_nfe = None
            return
        blk = self.config.block_length
        length = self.start + max(r.config.gen_length - r.block * blk for r in self.rows)
        idx = torch.tensor(keep, device=self.device)
        valid = self.valid[idx, :length]
        first = int(valid.any(0).long().argmax())  # columns every remaining row pads on the left
        self.row_nfe = self.row_nfe[idx]
        self.policy.relayout(keep, -first, length - first)
        self.start -= first
        self._set(self.x[idx, first:length], valid[:, first:], self.step_of[idx, first:length])

    # -- one block: start it, step until it has no masks, finish it
    def run_block(self):
        """Decode the current block of every row (rows that joined are laid out first), yielding
        the step's `chosen` (B, block_length) after every step. After it: `last_blocks`, `left`."""
        seq, block = self._start_block()
        # (tokens revealed per row, row took part, the step's forwards): charged to the rows at the
        # block's end, so a step does no host-side bookkeeping.
        log: list[tuple] = []
        editing = self.strategy.editing
        if editing is not None:  # a row's block ends at its first post-mask step that edits nothing
            post = torch.zeros(block.shape[0], dtype=torch.long, device=self.device)
            alive = torch.ones(block.shape[0], dtype=torch.bool, device=self.device)
        while True:
            masked = block == self.mask_id
            has_mask = masked.any(-1)
            if editing is None:
                live = has_mask
            else:
                post += ~has_mask & alive
                alive &= has_mask | (post <= editing.max_post_steps)
                live = alive.clone()
            if not bool(live.any()):
                break
            chosen, edited, work, revealed = self._step(seq, block, masked, live, len(log))
            log.append((revealed, live, work))
            if self.config.eos_early_stop and editing is None:
                self._stop_early(block)
            if edited is None:
                yield chosen
            else:
                alive &= has_mask | edited.any(-1)
                yield chosen | edited
        # a block revealed whole while it was a later one takes no step (and no forward)
        self.unrefreshed = 0 if log else self.unrefreshed + 1
        self._finish_block(block, log)

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

    def _start_block(self) -> tuple[SequenceView, torch.Tensor]:
        """Lay out the rows that joined, and set up the block: the view the forwards see and the
        block itself (a view into the layout); the selection rule starts the block."""
        if self.joining:
            self._admit()
        cfg, blk, rows = self.config, self.config.block_length, self.rows
        length = self.x.shape[1]
        end = self.start + blk
        depth = 1 if self.lookahead is None else self.lookahead.depth
        self.window_end = min(length, self.start + depth * blk)
        blocks = tuple(r.block for r in rows)
        # A suffix window: forwards see the sequence only up to `cut` (the masked tail after it
        # is not part of any forward until the window reaches it).
        cut = length if cfg.suffix_window is None else min(length, self.window_end + cfg.suffix_window)
        km = self.key_mask
        seq = SequenceView(
            self.x[:, :cut],
            self.positions[:, :cut],
            None if km is None else km[..., :cut],
            block=blocks[0],
            block_length=blk,
            capacity=length,
            row_blocks=blocks,
            refresh_blocks=1 + self.unrefreshed,
        )
        block = self.x[:, self.start : end]  # a view: writes go straight into the layout
        steps = rows[0].config.steps_per_block()[blocks[0]]
        self._drawing = self.generators if self.strategy.draws_randomness else None
        self.rule.begin_block(block == self.mask_id, steps, self._drawing, list(range(len(rows))))
        return seq, block

    def _step(self, seq, block, masked, live, step: int):
        """One step: the block's logits from the cache policy, proposals and the selection rule's
        choice (and the editing rule's, where there is one), written into the block. `live`: the
        rows taking part. With multi-block decoding the forwards also give the logits of the blocks
        after the current one, up to `window_end`, and the lookahead rule reveals some of theirs.
        Returns (chosen, edited (None without editing), the forwards' work, the positions each
        row revealed)."""
        blk = self.config.block_length
        start, end = self.start, self.start + blk
        with self.forward_clock, record_function("fastdllm.forward"):
            logits = self.policy.block_logits(seq, start, self.window_end, step)
        work = self.policy.take_work()
        self.nfe += len(work)
        # Rows whose block is already done draw no randomness: each row's stream must advance
        # exactly as when it is decoded alone, whatever the other rows still need.
        generators, everyone = self._drawing, list(range(block.shape[0]))
        drawing = everyone
        if generators is not None and not bool(live.all()):
            drawing = [i if m else None for i, m in zip(everyone, live.tolist())]
        with record_function("fastdllm.propose"):
            tokens, conf = self.strategy.propose(logits, generators, drawing)
        proposed_mask = tokens == self.mask_id
        # A model may rank [MASK] first (an untrained one does): revealing it would leave the
        # position masked for ever. Those positions get the best other token instead; the
        # references would loop or keep the mask there, and no other position changes. Greedy
        # proposals draw nothing, so the other token is proposed every step and no host read
        # decides it; sampled ones propose again only when needed, so that each row's random
        # stream advances as in the reference.
        if generators is None or bool(proposed_mask.any()):
            logits = logits.clone()
            logits[..., self.mask_id] = float("-inf")
            others, others_conf = self.strategy.propose(logits, generators, drawing)
            tokens = torch.where(proposed_mask, others, tokens)
            conf = torch.where(proposed_mask, others_conf, conf)
        constrained = [i for i, r in enumerate(self.rows) if r.constraint is not None]
        ahead = None
        if self.window_end > end:  # the blocks after the current one: their tokens split off
            ahead = self._lookahead(tokens[:, blk:], conf[:, blk:], masked, live, constrained)
            logits, tokens, conf = logits[:, :blk], tokens[:, :blk], conf[:, :blk]
        with record_function("fastdllm.select"):
            chosen = self.rule.select(conf, masked, step, generators, drawing) & masked
        if constrained:  # the grammar's say: left to right, every revealed token accepted
            for i in constrained:
                if bool(live[i]):
                    self.rows[i].constraint.amend(logits[i], tokens[i], chosen[i], masked[i])
        region = self.step_of[:, start:end]  # the row's step index of each revealed position
        edited = None
        if self.strategy.editing is not None:  # revealed earlier by decoding: not masked, not a prompt token
            editable = (region >= 0) & ~masked & live[:, None]
            if constrained:  # a checked token is never rewritten
                editable[constrained] = False
            edited = self.strategy.editing.select(tokens, conf, block, editable)
            block.copy_(torch.where(edited, tokens, block))
        block.copy_(torch.where(chosen, tokens, block))  # not block[chosen] = ...: no host read
        region.copy_(torch.where(chosen, self.row_nfe[:, None], region))
        self.row_nfe += live
        revealed = chosen.sum(-1) if ahead is None else chosen.sum(-1) + ahead.sum(-1)
        return chosen, edited, work, revealed

    def _lookahead(self, tokens, conf, current_masked, live, constrained: list[int]) -> torch.Tensor:
        """The blocks after the current one: what the lookahead rule reveals of them, written into
        the layout; (B, positions) True where revealed. A row whose answer follows a grammar
        reveals only left to right, so its later blocks wait for the current one."""
        end = self.start + self.config.block_length
        later = self.x[:, end : self.window_end]
        masked = (later == self.mask_id) & live[:, None]
        if constrained:
            masked[constrained] = False
        chosen = self.lookahead.select(conf, masked, current_masked) & masked
        later.copy_(torch.where(chosen, tokens, later))
        region = self.step_of[:, end : self.window_end]
        region.copy_(torch.where(chosen, self.row_nfe[:, None], region))
        return chosen

    def _finish_block(self, block, log: list[tuple]) -> None:
        """Rows that hit a stop token or their last block leave; the others move to the next block."""
        bsz, end = block.shape[0], self.start + self.config.block_length
        revealed = self.step_of[:, self.start : end] >= 0  # not a prompt token that opens the region
        hit = torch.isin(block, self.stop_ids) & revealed
        hit = hit.any(-1) if self.config.stop_at_eos else torch.zeros_like(hit[:, 0])
        # the block's tokens, its rows' stops and the block's step log: one read from the device
        done, hit, counts, live = self._read_block(block, hit, log)
        self._charge(log, counts, live)
        self.last_blocks, self.left, keep = [], [], []
        for i, r in enumerate(self.rows):
            _, _, b_lo, b_hi = r.answer_span(r.block, self.config.block_length)
            self.last_blocks.append((r, r.block, done[i][b_lo:b_hi]))
            r.block += 1
            r.finished = hit[i]
            if hit[i] or r.block == r.num_blocks:
                self._leave(i, r)
            else:
                keep.append(i)
        self.start = end
        if len(keep) < bsz:
            self._keep(keep)

    @staticmethod
    def _read_block(block: torch.Tensor, hit: torch.Tensor, log: list[tuple]) -> tuple[list, list, list, list]:
        """Per row: the block's tokens, whether it hit a stop, and per step of the log the tokens
        it revealed and whether it took part; read from the device in one transfer."""
        parts = [block, hit[:, None].long()]
        if log:
            parts += [torch.stack([c for c, _, _ in log], 1).long(), torch.stack([h for _, h, _ in log], 1).long()]
        rows = torch.cat(parts, 1).tolist()
        blk, steps = block.shape[1], len(log)
        counts = [r[blk + 1 : blk + 1 + steps] for r in rows]
        live = [r[blk + 1 + steps :] for r in rows]
        return [r[:blk] for r in rows], [bool(r[blk]) for r in rows], counts, live

    def _charge(self, log, counts: list[list[int]], live: list[list[int]]) -> None:
        """Per row: the tokens of each step it took part in and the work of every forward that
        served it while it had masks (what it costs alone). counts[i][s], live[i][s]: row i at step s."""
        for s, (_, _, work) in enumerate(log):
            for i, r in enumerate(self.rows):
                if live[i][s]:
                    r.tokens_per_step.append(counts[i][s])
            for served, queries, keys in work:
                for i in range(len(self.rows)) if served is None else served:
                    if live[i][s]:
                        r = self.rows[i]
                        r.nfe += 1
                        r.forward_positions += queries
                        r.attended_positions += queries * keys

    def _leave(self, i: int, r: Row) -> None:
        blk, n = self.config.block_length, r.asked
        first = self.start - (r.block - 1) * blk + r.lead  # the row's answer starts here
        r.answer = self.x[i, first : first + n].clone()
        r.unmask_step = self.step_of[i, first : first + n].clone()
        if r.finished:
            r.answer[r.block * blk - r.lead :] = self.model.args.eos_token_id
        self.left.append(r)
