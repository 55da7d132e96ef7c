"""The decoding loop: a batch of rows, each on its own clock (docs/decoding.md walks one step).

Every row's answer region (its `gen_length` positions after its prompt) starts as all [MASK] and is
decoded in blocks of `block_length`, left to right. A step (`BlockDecoder.step`) plans (rows join or
leave), runs one packed forward of every row's window through the cache policy (`engine/cache/`),
and applies each row's `Decision` from its decoder (`engine/decode/`): the loop writes what a
decision says and knows no decoder. A row's block ends at the step its decision ends it; the row
then starts its next block at the next step (or leaves: a stop token, its last block), whatever
the other rows do. Rows sit in one (B, L) layout from column 0 (`layout.Layout`; a column's RoPE
position is its index), rebuilt only when rows join or leave; each row's K/V are its own pages of
the pool (`kv.rows.RowPages`). Rows whose configs differ only in fields declared per row
(`rows.shares_forwards`: block lengths too, where the model allows) share forwards, each deciding
with its own decoder, blocks and random stream; a row decodes in a batch as alone
(bit-identically with `deterministic=True`: `models.invariance`).

*Deliberate difference*: Fast-dLLM's cached loops (prefix and DualCache) always run at least one
cached forward after the block-start forward, so when that forward already completes the block
they spend one more that reveals nothing; we do not, so our NFE there is theirs less one per such
block, with the same tokens (`tests/test_reference.py` runs the reference's own code to check both).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..config import GenerationConfig
from .cache import SequenceView
from .decode import BlockClock, Decision, DecodeView
from .kv.rows import RowPages
from .kv.runner import KVRunner, runner_for
from .layout import Layout, Part, step_record
from .policies import PolicySource, brings_decoder, policies_for, resolve
from .rows import (
    ForwardClock,
    Row,
    Step,
    check_adapter,
    check_thinking_budget,
    constrain,
    decision_key,
    infill,
    place_images,
    prepare_inputs,
    prompts_of,
    row_generators,
    shares_forwards,
)


class BlockDecoder:
    """The loop. `add` rows (they join at the next step), then `step` decodes one step of every
    row in the batch; `rows` are the rows in the batch, and after a step `last_blocks` holds the
    blocks that became final in it ((row, block, tokens)) and `left` the rows that left.

    `policies` (see `fastdllm.engine.policies`; default: those the config names, `policies_for`), or
    `cache` / `strategy` alone, are the objects it decodes with: a new policy plugs in here. `kv`:
    the runner whose pool and prefix store the rows use (`kv.runner`; default: the model's,
    `runner_for`); the rows' pages are `pages`, the same for every cache policy."""

    def __init__(
        self,
        model,
        config: GenerationConfig,
        policies: PolicySource = None,
        kv: KVRunner | None = None,
    ):
        self.model, self.config = model, config
        # A strategy the caller brought serves every row, and so rows must agree on every
        # decision field; otherwise each row decides with the strategy its own config names.
        self.own_strategy = brings_decoder(policies)
        self.batch_key = decision_key(config) if self.own_strategy else None
        policies = resolve(policies, model, config)
        self.policy, self.strategy = policies.cache, policies.strategy
        self.pages = RowPages.of(kv or runner_for(model), model, config, self.policy.holds_cache)
        self.strategies = {decision_key(config): self.strategy}
        self.device = model.device
        self.mask_id = model.mask_token_id
        self.stop_ids = torch.tensor(sorted(set(model.stop_token_ids)), device=self.device)
        self.stop_set = set(model.stop_token_ids)
        self.rows: list[Row] = []
        self.joining: list[Row] = []
        # rows whose prompts are being computed in chunks before they join (`Row.prefill_chunk`)
        self.prefilling: list[Row] = []
        self.left: list[Row] = []
        self.last_blocks: list[tuple[Row, int, list[int]]] = []
        self.nfe = 0  # forwards
        # what the forwards computed: rows summed over them, and query positions
        self.row_forwards = self.computed_positions = 0
        self.forward_clock = ForwardClock(self.device)
        self.layout = Layout(model, config.block_length * self.strategy.depth)  # the rows' tensors

    # -- rows in
    def accepts(self, config: GenerationConfig) -> bool:
        """Whether rows of `config` can join this batch (`rows.shares_forwards`; with a decoder the
        caller brought, only rows that decide as the batch's)."""
        if self.own_strategy:
            return decision_key(config) == self.batch_key
        return shares_forwards(self.model, self.config, config)

    def _strategy_for(self, config: GenerationConfig):
        key = decision_key(config)
        if key not in self.strategies:
            self.strategies[key] = policies_for(self.model, config, cache=self.policy).strategy
        return self.strategies[key]

    def add(
        self,
        input_ids,
        attention_mask=None,
        row_seeds=None,
        config: GenerationConfig | None = None,
        tags=None,
        constraints=None,
        images=None,
        placed=None,
    ) -> list[Row]:
        """Rows that join at the next step (validated now: a bad prompt is refused here, alone).
        `config` may differ from the batch's in the fields declared per row (`accepts`).
        `constraints`: per row, None or the grammar its answer follows (`constraints.py`).
        `images`: per row, the images its prompt's placeholders stand for (`rows.place_images`);
        `placed`: per row, what `place_images` gave for prompts placed already."""
        config = config or self.config
        if not self.accepts(config):
            raise ValueError("config: these rows cannot join this batch (their decoding fields differ)")
        check_adapter(self.model, config)
        check_thinking_budget(self.model, config)
        if images is not None:
            if placed is not None:
                raise ValueError("images: give the images or what place_images gave, not both")
            input_ids, placed = place_images(self.model, input_ids, attention_mask, images)
            attention_mask = None
        ids, mask = prepare_inputs(self.model, input_ids, attention_mask, config)
        if placed is not None and len(placed) != ids.shape[0]:
            raise ValueError(f"placed: one entry per prompt ({ids.shape[0]}), got {len(placed)}")
        strategy = self._strategy_for(config)
        gens = (
            row_generators(config, ids.shape[0], row_seeds, self.device)
            if strategy.draws_randomness
            else [None] * ids.shape[0]
        )
        fixed, suffix = infill(self.model, config, constraints, strategy.closing_tokens)
        tags = [None] * ids.shape[0] if tags is None else list(tags)
        causal = bool(self.model.args.block_size)
        rows = [
            Row.of_prompt(prompt, config, gens[i], tags[i], causal, host)
            for i, (prompt, host) in enumerate(prompts_of(ids, mask))
        ]
        for i, r in enumerate(rows):
            r.fixed, r.suffix, r.strategy = fixed, suffix, strategy
            if placed is not None and placed[i] is not None:
                cols, vectors = placed[i]
                r.images = (cols.to(self.device), vectors.to(self.device, self.model.dtype))
        constrain(rows, constraints, config)
        self.joining.extend(rows)
        return rows

    @property
    def batch(self) -> list[Row]:
        """Every row not yet done: decoding, being prefilled, or waiting to join."""
        return self.rows + self.prefilling + self.joining

    def drop(self, rows: list[Row]) -> None:
        """Rows that stop now (their caller no longer wants them): they leave before the next step."""
        gone = set(map(id, rows))
        self.joining = [r for r in self.joining if id(r) not in gone]
        for r in self.prefilling:
            if id(r) in gone:
                self.pages.release_prefill(id(r))
        self.prefilling = [r for r in self.prefilling if id(r) not in gone]
        if any(id(r) in gone for r in self.rows):
            self._relayout([(r, i) for i, r in enumerate(self.rows) if id(r) not in gone])

    @property
    def forward_time(self) -> float:
        """Seconds inside the model's forwards so far."""
        return self.forward_clock.seconds

    @property
    def active(self) -> bool:
        return bool(self.rows or self.prefilling or self.joining)

    # -- one step
    def step(self) -> Step | None:
        """One step of every row in the batch, in three parts: plan (rows join or leave, prompts
        being prefilled take their chunk), forward (each row's window, packed, through the cache
        policy), apply (the strategy's decision written into the layout; the rows whose block it
        ended move on or leave). A forward of prefill chunks alone is a step of no rows; None when
        no row is left."""
        self.last_blocks, self.left = [], []
        chunks = self._plan()
        if not self.rows:
            return self._prefill_alone(chunks) if chunks else None
        self.pages.queue_prefill(chunks)
        view = self._view()
        with self.forward_clock, record_function("fastdllm.forward"):
            logits = self.pages.runner.logits(self.pages, view, self.policy, [r.step for r in self.rows])
        work = self._count_forwards()
        return self._apply(view, logits, work)

    def _plan(self) -> list[tuple[int, torch.Tensor, int, int]]:
        """Rows that may join now do (a long block-causal prompt starts its prefill instead), and
        the layout is rebuilt for them; returns this step's prefill chunks."""
        new = []
        if self.joining:
            waits = self.pages.waits(
                [r.prefix_tokens for r in self.joining], [r.prefix_tokens for r in self.prefilling]
            )
            new = [r for r, w in zip(self.joining, waits) if not w]
            self.joining = [r for r, w in zip(self.joining, waits) if w]
            for r in [r for r in new if self._chunk(r)]:
                r.prefilled = self.pages.start_prefill(id(r), r.prefix_tokens)
                self.prefilling.append(r)
                new.remove(r)
        ready = [r for r in self.prefilling if r.prefilled >= len(r.prompt)]
        if ready or new:
            self.prefilling = [r for r in self.prefilling if r.prefilled < len(r.prompt)]
            joined = ready + new
            self._relayout(
                [(r, i) for i, r in enumerate(self.rows)] + [(r, None) for r in joined],
                {len(self.rows) + j: id(r) for j, r in enumerate(ready)},
            )
        return self._prefill_chunks()

    def _prefill_alone(self, chunks) -> Step:
        """A forward of prefill chunks while no row decodes: a step of no rows."""
        self.pages.queue_prefill(chunks)
        with self.forward_clock, record_function("fastdllm.prefill"):
            empty = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # the chunks alone
            self.pages.runner.forward(self.pages, SequenceView(empty, (), (), (), (), ()), [])
        self._count_forwards()
        none = torch.zeros((0, self.config.block_length), dtype=torch.long, device=self.device)
        return Step([], [], none, none.bool())

    def _count_forwards(self) -> list:
        """The step's forwards counted, and the prefill chunks they computed charged to their rows;
        returns the forwards' work per row."""
        work = self.pages.take_work()
        self.nfe += len(work)
        self.computed_positions += self.pages.charge_prefill(self.prefilling)
        return work

    def _apply(self, view: SequenceView, logits: torch.Tensor, work) -> Step:
        """Each row's decision on its window (its current block, and the blocks after it),
        written without a host read, rows of one block length and width together (`Part`); then
        the rows whose block is over move on."""
        parts = [self._decided(view, logits, members) for members in self._shapes()]
        self.layout.row_nfe += 1
        for r in self.rows:
            r.step += 1
        for part in parts:
            if part.decision.signal is not None or part.decision.carry is not None:
                self._carry_on(view.starts, part)
        record = step_record(self.rows, parts, self.mask_id)
        self._after_step(parts, work)
        return record

    def _shapes(self) -> list[list[int]]:
        """The rows by block length and width (one group where every row has the same)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(self.rows):
            groups.setdefault((r.block_length, r.width), []).append(i)
        return list(groups.values())

    def _decided(self, view: SequenceView, logits: torch.Tensor, members: list[int]) -> Part:
        """The decision of rows `members` (of one block length and width), written into the layout."""
        rows, dev, layout = [self.rows[i] for i in members], self.device, self.layout
        blk, width = rows[0].block_length, rows[0].width
        at = None if len(members) == len(self.rows) else torch.tensor(members, device=dev)
        pick = (lambda t: t) if at is None else (lambda t: t[at])  # noqa: E731
        starts = [view.starts[i] for i in members]
        columns = torch.tensor(starts, device=dev)[:, None] + torch.arange(width, device=dev)
        window, steps_of = layout.window(at, columns)
        logits = pick(logits)[:, :width]
        current = window[:, :blk]  # the current block's tokens
        later = window[:, blk:] if width > blk else None
        clock = BlockClock(
            [r.step for r in rows],
            [r.config.steps_per_block()[r.block] for r in rows],
            pick(layout.opened),
            starts,
            [r.extent for r in rows],
        )
        decision = self._decide(
            logits,
            members,
            DecodeView(
                current,
                clock,
                self.mask_id,
                later=later,
                # what an editing rule may rewrite: revealed, not a prompt or fixed token
                editable=(steps_of[:, :blk] >= 0) & (current != self.mask_id) if self.strategy.edits else None,
                steps_of=steps_of,
                constraints={j: r.constraint for j, r in enumerate(rows) if r.constraint is not None},
                carry=[r.carry for r in rows],
                configs=[r.config for r in rows],
                eos_id=self.model.args.eos_token_id,
                stop_ids=self.stop_ids,
            ),
        )
        if layout.logprobs is not None:
            layout.logprobs.record(logits, columns, decision, rows, at)
        eos = self.model.args.eos_token_id
        window, steps_of = decision.applied(window, steps_of, pick(layout.row_nfe), eos, self.mask_id)
        layout.write(at, columns, window, steps_of)
        done = decision.blocks_over(window[:, :blk], self.mask_id)
        return Part(members, at, columns, window, steps_of, decision, done)

    def _chunk(self, r: Row) -> int:
        return r.prefill_chunk(self.model.causal_prompt, self.policy.keeps_prompt)

    def _prefill_chunks(self) -> list[tuple[int, torch.Tensor, int, int]]:
        """This step's chunk of every prompt being prefilled: (its row's key, tokens, from, to)."""
        out = []
        for r in self.prefilling:
            hi = min(len(r.prompt), r.prefilled + self._chunk(r))
            if hi > r.prefilled:
                out.append((id(r), r.prompt, r.prefilled, hi))
        return out

    def _decide(self, logits: torch.Tensor, members: list[int], view: DecodeView) -> Decision:
        """The decision of rows `members` (`view` theirs, in that order), by the decoder each
        decides with: rows that share one in one call."""
        rows = [self.rows[i] for i in members]
        groups: dict[int, list[int]] = {}
        for j, r in enumerate(rows):
            groups.setdefault(id(r.strategy), []).append(j)

        def decide(group: list[int], part: DecodeView, logits: torch.Tensor) -> Decision:
            strategy = rows[group[0]].strategy
            part.generators = [rows[j].generator for j in group] if strategy.draws_randomness else None
            return strategy.decide(logits, part)

        if len(groups) == 1:
            return decide(list(range(len(rows))), view, logits)
        parts = []
        for group in groups.values():
            idx = torch.tensor(group, device=self.device)
            parts.append((idx, decide(group, view.take(group), logits[idx])))
        return Decision.merged(parts, len(rows))

    def _carry_on(self, starts, part: Part) -> None:
        """What a strategy hands each row's next step in its block: its state (`Decision.carry`) and
        the signal that conditions the next forward, as the model takes it (`soft_input`: input
        vectors for the block's columns, or those of them the signal keeps), for the part's rows in
        one call (under `deterministic` a row's alone: its vectors then cannot depend on its batch).
        Handed to every row: a row whose block is over drops them as its next block begins or as it
        leaves (`_after_step`), which the step's one read tells."""
        decision, signal = part.decision, part.decision.signal
        together = None
        if signal is not None:
            blk = self.rows[part.members[0]].block_length  # a part's rows share it
            columns = torch.tensor([starts[i] for i in part.members], device=self.device)[:, None]
            columns = columns + torch.arange(blk, device=self.device)
            if not self.config.deterministic:
                together = self.model.soft_input(signal.payloads())
        for j, i in enumerate(part.members):
            r = self.rows[i]
            r.carry = None if decision.carry is None else decision.carry[j]
            if signal is None:
                continue
            vectors = self.model.soft_input(signal.payload(j)) if together is None else together[j]
            keep = signal.keep(j)
            # a column the signal does not keep: -1, a column no window computes (no boolean index:
            # a host read on a GPU)
            r.soft = (columns[j] if keep is None else torch.where(keep, columns[j], -1), vectors)

    def _after_step(self, parts: list[Part], work) -> None:
        """Charge the step to its rows, then end the blocks that are over: those rows leave or
        move to their next block (past any that the blocks before revealed whole, or as many as
        the decoder made final: `final_later`). One read from the device: the rows' windows
        (their current block and those after it), and per row whether its block is over, what it
        revealed and whether the block holds a stop token; and where a row whose block ends reports
        log-probabilities, its window's."""
        rows, width = self.rows, max(p.window.shape[1] for p in parts)
        host: list = [None] * len(rows)
        reads = [
            self.layout.host_read(p, width, self.stop_ids, self.rows[p.members[0]].strategy.later_blocks_final)
            for p in parts
        ]
        flat = torch.cat(reads).tolist()
        place: dict[int, tuple[Part, int]] = {}  # row -> its part and its place there
        for p in parts:
            for j, i in enumerate(p.members):
                host[i], place[i] = flat[len(place)], (p, j)
        for r, h in zip(rows, host):
            r.tokens_per_step.append(h[1])
            if h[4] >= 0:
                r.acceptances.append(h[4])
        for forward in work:
            self.row_forwards += len(forward)
            for i, queries, keys in forward:
                r = rows[i]
                r.nfe += 1
                r.forward_positions += queries
                r.attended_positions += queries * keys
                self.computed_positions += queries
        if not any(h[0] for h in host):
            return
        kept, began = [], []
        for i, (r, h) in enumerate(zip(rows, host)):
            if not h[0]:
                kept.append((r, i))
                continue
            blk, tokens = r.block_length, h[5:]
            r.finished, r.unrefreshed = bool(h[2]) and r.block >= r.stop_block, 0
            window_logprobs = None
            if self.layout.logprobs is not None and r.config.logprobs is not None:
                p, j = place[i]
                window_logprobs = self.layout.logprobs.window(i, p.columns[j], r.config.logprobs)
            k = 0
            while True:
                _, _, b_lo, b_hi = r.answer_span(r.block)
                self.last_blocks.append((r, r.block, tokens[k * blk + b_lo : k * blk + b_hi]))
                if window_logprobs is not None:
                    r.block_logprobs[r.block] = window_logprobs[k * blk + b_lo : k * blk + b_hi]
                r.block += 1
                k += 1
                if r.finished or r.answered or k > h[3]:
                    break
                # revealed whole while it was a later block: no forward of its own, unless the
                # decoder's step that ended the block computed it (`Decoder.commits_blocks`)
                r.unrefreshed += not r.strategy.commits_blocks
                r.finished = (
                    r.config.stop_at_eos
                    and r.block >= r.stop_block
                    and any(t in self.stop_set for t in tokens[k * blk : (k + 1) * blk])
                )
            if r.finished or r.answered:
                r.soft = r.carry = None
                self.layout.answer(i, r)
                self.left.append(r)
            else:
                r.step = 0
                kept.append((r, i))
                began.append((i, r))
                self.layout.begin(i, r)
        self.layout.count_opened(began)
        if len(kept) < len(rows):
            self._relayout(kept)

    @staticmethod
    def _adapter(r: Row) -> str | None:
        return r.strategy.adapter(r.config, r.carry, r.step, r.block)

    # -- layout
    def _view(self) -> SequenceView:
        """What the forwards see of each row: with a suffix window, its columns only up to the cut
        (the masked tail after it is not part of any forward until the window reaches it)."""
        cfg, rows = self.config, self.rows
        starts = tuple(r.block_start for r in rows)
        ends = [r.extent for r in rows]
        if cfg.suffix_window is not None:  # a row with a suffix sees it whole
            ends = [
                e if r.suffix is not None else min(e, s + r.width + cfg.suffix_window)
                for r, e, s in zip(rows, ends, starts)
            ]
        return SequenceView(
            self.layout.x,
            starts,
            tuple(ends),
            tuple(r.block for r in rows),
            tuple(r.block_length for r in rows),
            tuple(r.width for r in rows),
            tuple(int(not r.strategy.commits_blocks) + r.unrefreshed for r in rows),
            tuple(r.reused for r in rows),
            {i: e for i, r in enumerate(rows) if (e := r.input_vectors) is not None} or None,
            {i: self.model.lora.index(a) for i, r in enumerate(rows) if (a := self._adapter(r))} or None,
            {i: c for i, r in enumerate(rows) if (c := r.strategy.canvas(r.carry, r.step)) is not None} or None,
        )

    def _relayout(self, moves: list[tuple[Row, int | None]], prefilled: dict | None = None) -> None:
        """Lay the rows out again when rows join or leave: `moves` are the new layout's rows in
        order, each with its index in the old layout (None: a row that joins). A row keeps its
        columns (its prompt from column 0, then its region) and its pages of the K/V pool
        (`RowPages.relayout`); rows that move on to their next block stay where they are.
        `prefilled`: new row -> the key of the pages its prompt was prefilled into."""
        self.rows = [r for r, _ in moves]
        self.layout.rebuild(moves)
        sources = [src for _, src in moves]
        self.pages.relayout(sources, [None if src is not None else r.extent for r, src in moves], prefilled)
        self.policy.relayout(sources)
        if not moves:
            return
        joined = {i: r for i, (r, src) in enumerate(moves) if src is None}
        # a row with an adapter neither shares nor stores its prompt's K/V (the store holds the base's)
        shared = {i: r.prefix_tokens for i, r in joined.items() if r.config.adapter is None}
        reused = self.pages.reuse(len(moves), shared)
        for i, r in joined.items():
            r.reused = reused.get(i, 0)
            self.layout.begin(i, r)
        self.layout.count_opened(list(joined.items()))
