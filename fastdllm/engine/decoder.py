"""The decoding loop: a batch of rows, each on its own clock.

Every row's answer region (its `gen_length` positions after its prompt) starts as all [MASK] and is
decoded in blocks of `block_length`, left to right. A step is one forward of every row in the batch
(`step`): the *cache policy* (`engine/cache/`) gives each row's current block its logits, the
*unmasking strategy* (`engine/decode/`) decides what each row reveals (`UnmaskingStrategy.decide`),
and the loop writes it. A row's block ends at the step that reveals its last mask; at the next
step the row starts its next block (and a caching policy refreshes its cache), whatever the other
rows are doing. A row that stops (a stop token in a finished block, or its last block) leaves the
batch at once, and a row that `add` queues joins at the next step. So every row in a forward needs
it: no row waits in the batch for another row's block to end. Positions after the current block
are never revealed (but with multi-block decoding, the blocks right after it).

The layout: the rows sit in one (B, L) tensor, each from column 0: its prompt, then its region (a
column's RoPE position is its index), padding after it. A row never moves while it decodes; its
current block starts at its own column. A step's forward packs each row's window end to end
(`Transformer.packed_logits`): the dense math sees no padding, and each row attends over its own
keys, in its own pages of the K/V pool (`kv.pages.PagedKVCache`, held for the loop by `pages`). The layout is rebuilt
only when rows join or leave (`_relayout`); a kept row keeps its pages.

Rows may join when their configs differ at most in the fields declared per row (`join_key`: the
answer's length, steps, threshold, temperature, stop rules, ...): each row follows its own
schedule, selection rule and random stream (a row draws only at its own steps), and its own
refresh decisions (a row at its block's first step gets its block-start window while the others
take their cached steps, in the same forward). Rows decode in a batch as alone: each row's keys
are its own, and only the dense math's row count changes how its sums are rounded (~1e-6 of a
logit in float32, up to ~1e-2 in bfloat16), so a near-tied token can differ; with
`deterministic=True` every row decodes bit-identically to alone (`models.invariance`).

A block ends at the step that reveals its last mask. *Deliberate difference*: Fast-dLLM's cached
loops (prefix and DualCache) always run at least one cached forward after the block-start forward,
so when that forward already completes the block they spend one more that reveals nothing; we do
not, so our NFE there is theirs less one per such block, with the same tokens
(`tests/test_reference.py` runs the reference's own code to check both).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..config import GenerationConfig
from .cache import SequenceView
from .decode import BlockClock, Decision, DecodeView, token_logprobs
from .kv.rows import RowPages, shares_prefixes
from .kv.runner import KVRunner, runner_for
from .policies import Policies, PolicySource, policies_for, resolve
from .rows import ForwardClock, Row, Step, decision_key, join_key, prepare_inputs, row_generators


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
        self.own_strategy = policies is not None and not (isinstance(policies, Policies) and policies.strategy is None)
        self.key = decision_key(config) if self.own_strategy else join_key(config)
        policies = resolve(policies, model, config)
        self.policy, self.strategy = policies.cache, policies.strategy
        holds = self.policy.holds_cache
        self.pages = RowPages(
            kv or runner_for(model),
            config.block_length,
            shares=holds and shares_prefixes(model, config),
            counted=holds,
        )
        self.policy.pages = self.pages
        self.strategies = {decision_key(config): self.strategy}
        self.device = model.device
        self.mask_id = model.mask_token_id
        self.stop_ids = torch.tensor(sorted(set(model.stop_token_ids)), device=self.device)
        self.stop_set = set(model.stop_token_ids)
        self.rows: list[Row] = []
        self.joining: list[Row] = []
        # rows whose prompts are being computed in chunks before they join (`_prefill_chunk`)
        self.prefilling: list[Row] = []
        self.left: list[Row] = []
        self.last_blocks: list[tuple[Row, int, list[int]]] = []
        self.nfe = 0  # forwards
        # what the forwards computed: rows summed over them, and query positions
        self.row_forwards = self.computed_positions = 0
        self.forward_clock = ForwardClock(self.device)
        # the columns a step decodes from each row's current block on: the block, and with
        # multi-block decoding the blocks after it
        self.width = config.block_length * self.strategy.depth
        # per row of the layout (its prompt, then its region, from column 0): tokens, and the
        # row's step that revealed each position (-1: masked or a prompt token)
        self.x = self.step_of = None
        # with rows that report log-probabilities (`config.logprobs`), per layout column: the
        # log-probability of the token a forward wrote there (NaN: none did), and the most likely
        # tokens there as (B, L, k) ids and log-probabilities
        self.logp = self.top_ids = self.top_lp = None
        self.stopping = None  # per row: whether its config stops at a stop token (stop_at_eos)
        # per row: its steps so far (the index `step_of` records) and its current block's masks
        # when it began
        self.row_nfe = self.opened = None

    # -- rows in
    def accepts(self, config: GenerationConfig) -> bool:
        """Whether rows of `config` can join this batch."""
        return (decision_key(config) if self.own_strategy else join_key(config)) == self.key

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
    ) -> list[Row]:
        """Rows that join at the next step (validated now: a bad prompt is refused here, alone).
        `config` may differ from the batch's in gen_length and steps only (see `join_key`).
        `constraints`: per row, None or the grammar its answer follows (`constraints.py`)."""
        config = config or self.config
        if not self.accepts(config):
            raise ValueError("config: these rows cannot join this batch (their decoding fields differ)")
        if config.adapter is not None:
            if config.cuda_graphs:
                raise ValueError("adapter: not with cuda_graphs (a captured step holds the base weights' graph)")
            if getattr(self.model, "lora", None) is None:
                raise ValueError(f"adapter: {config.adapter!r}: this model has no adapters loaded (--lora-modules)")
            self.model.lora.index(config.adapter)
        ids, mask = prepare_inputs(self.model, input_ids, attention_mask, config)
        strategy = self._strategy_for(config)
        gens = (
            row_generators(config, ids.shape[0], row_seeds, self.device)
            if strategy.draws_randomness
            else [None] * ids.shape[0]
        )
        fixed, suffix = self._infill(config, constraints, strategy.closing_tokens)
        tags = [None] * ids.shape[0] if tags is None else list(tags)
        rows = [self._row(ids[i][mask[i]], config, gens[i], tags[i]) for i in range(ids.shape[0])]
        for r in rows:
            r.fixed, r.suffix, r.strategy = fixed, suffix, strategy
        if constraints is not None:
            if len(constraints) != len(rows):
                raise ValueError(f"constraints: {len(constraints)} given for {len(rows)} rows")
            for r, c in zip(rows, constraints):
                if c is not None and r.lead:
                    raise ValueError("constraints: a prompt ending inside a block-causal block is not supported yet")
                if c is not None:
                    c.fit_within(config.gen_length)
                    c.keeps_masks = config.logprobs is not None  # its log-probabilities after its mask
                r.constraint = c
        self.joining.extend(rows)
        return rows

    def _infill(self, config: GenerationConfig, constraints, closing_tokens) -> tuple[tuple, torch.Tensor | None]:
        """A config's fixed tokens and suffix, checked against this model: token ids (text is
        encoded by the front ends, `text.infill.encode_infill`), not the mask token, and a suffix
        only where attention is bidirectional; then the tokens the decoder closes the answer with."""
        closing = torch.tensor(closing_tokens, dtype=torch.long, device=self.device) if closing_tokens else None
        if not config.fixed and config.suffix is None:
            return (), closing
        for name, value in [("fixed", v) for _, v in config.fixed] + [("suffix", config.suffix)]:
            if isinstance(value, str):
                raise ValueError(
                    f"{name}: give token ids to generate(); text is encoded by generate_text, the CLI "
                    "and the server (fastdllm.text.infill.encode_infill)"
                )
            if value is not None and any(not 0 <= t < self.model.args.vocab_size for t in value):
                raise ValueError(f"{name}: token ids must be in [0, {self.model.args.vocab_size})")
            if value is not None and self.mask_id in value:
                raise ValueError(f"{name}: holds the mask token (id {self.mask_id})")
        if config.suffix is not None and self.model.args.block_size:
            raise ValueError(
                f"suffix: this model's attention is block-causal (blocks of {self.model.args.block_size}): "
                "no block sees text after it, so an answer cannot lead into a suffix; fixed tokens work"
            )
        if constraints is not None and any(c is not None for c in constraints):
            raise ValueError("fixed: not with a grammar constraint, which reveals the answer left to right")
        fixed = tuple((p + k, t) for p, ids in config.fixed for k, t in enumerate(ids))
        suffix = None if config.suffix is None else torch.tensor(config.suffix, dtype=torch.long, device=self.device)
        if closing is not None:
            suffix = closing if suffix is None else torch.cat([suffix, closing])
        return fixed, suffix

    def _row(self, prompt, config, generator, tag) -> Row:
        blk = self.config.block_length
        lead = len(prompt) % blk if self.model.args.block_size else 0
        if config.columns_past_answer:  # a region past the answer, which decoding reveals and reads
            region = config.replace(gen_length=config.gen_length + config.columns_past_answer, steps=None)
            return Row(prompt, region, generator, tag, asked=config.gen_length)
        if not lead:
            return Row(prompt, config, generator, tag, asked=config.gen_length)
        region = config.replace(
            gen_length=config.gen_length + blk,
            steps=None if config.steps is None else config.steps + config.steps // config.num_blocks,
        )
        return Row(prompt[:-lead], region, generator, tag, asked=config.gen_length, lead_tokens=prompt[-lead:])

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
            logits = self.policy.block_logits(view, [r.step for r in self.rows])
        work = self._count_forwards()
        return self._apply(view, logits, work)

    def _plan(self) -> list[tuple[int, torch.Tensor, int, int]]:
        """Rows that may join now do (a long block-causal prompt starts its prefill instead), and
        the layout is rebuilt for them; returns this step's prefill chunks."""
        new = []
        if self.joining:
            new, self.joining = self._admissible(self.joining)
            for r in [r for r in new if self._prefill_chunk(r)]:
                r.prefilled = self.pages.start_prefill(id(r), r.prompt.tolist())
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
            self.policy.prefill_only()
        self._count_forwards()
        none = torch.zeros((0, self.config.block_length), dtype=torch.long, device=self.device)
        return Step([], [], none, none.bool())

    def _count_forwards(self) -> list:
        """The step's forwards counted, and the prefill chunks they computed charged to their rows;
        returns the forwards' work per row."""
        work = self.policy.take_work()
        self.nfe += len(work)
        self._charge_prefill()
        return work

    def _apply(self, view: SequenceView, logits: torch.Tensor, work) -> Step:
        """Each row's decision on its window (its current block, and the blocks after it),
        written without a host read; then the rows whose block is over move on."""
        rows, blk = self.rows, self.config.block_length
        columns = torch.tensor(view.starts, device=self.device)[:, None] + torch.arange(self.width, device=self.device)
        window, steps_of = self.x.gather(1, columns), self.step_of.gather(1, columns)
        block, region = window[:, :blk], steps_of[:, :blk]
        later = window[:, blk:] if self.width > blk else None
        clock = BlockClock(
            [r.step for r in rows],
            [r.config.steps_per_block()[r.block] for r in rows],
            self.opened,
            list(view.starts),
            [r.extent for r in rows],
        )
        decision = self._decide(
            logits,
            DecodeView(
                block,
                clock,
                self.mask_id,
                later=later,
                # what an editing rule may rewrite: revealed, not a prompt or fixed token
                editable=(region >= 0) & (block != self.mask_id) if self.strategy.edits else None,
                steps_of=steps_of,
                constraints={i: r.constraint for i, r in enumerate(rows) if r.constraint is not None},
                carry=[r.carry for r in rows],
                configs=[r.config for r in rows],
                eos_id=self.model.args.eos_token_id,
                stop_ids=self.stop_ids,
            ),
        )
        if self.logp is not None:
            self._record_logprobs(logits, columns, decision)
        if decision.edited is not None:
            block = torch.where(decision.edited, decision.tokens, block)
        block = torch.where(decision.chosen, decision.tokens, block)
        region = torch.where(decision.chosen, self.row_nfe[:, None], region)
        if later is not None:
            later = torch.where(decision.ahead, decision.ahead_tokens, later)
            later_region = torch.where(decision.ahead, self.row_nfe[:, None], steps_of[:, blk:])
            block, region = torch.cat([block, later], 1), torch.cat([region, later_region], 1)
        self.row_nfe += 1
        if decision.fill is not None:  # the decoder's early stop: EOS, revealed by no step
            block = torch.where(decision.fill, self.model.args.eos_token_id, block)
        self.x.scatter_(1, columns, block)
        self.step_of.scatter_(1, columns, region)
        for r in rows:
            r.step += 1
        done = self._block_over(block[:, :blk], decision)
        if decision.signal is not None or decision.carry is not None:
            self._carry_on(view.starts, decision, done)
        record = Step(list(rows), [r.block for r in rows], block[:, :blk], decision.chosen, decision.edited)
        self._after_step(block, region, done, decision.revealed_counts(), work, columns)
        return record

    def _prefill_chunk(self, r: Row) -> int:
        """The positions of its prompt a row computes per step before it joins (0: none; it joins
        at once and its first forward computes its whole prompt). Only where a prompt block's K/V
        depend on nothing after it (a block-causal model) and its cache keeps them (not `NoCache`),
        and only for a prompt longer than its config's `prefill_chunk` (whole blocks)."""
        chunk, blk = r.config.prefill_chunk, self.config.block_length
        if chunk is None or not self.model.args.block_size or not self.policy.keeps_prompt:
            return 0
        if r.config.adapter is not None:  # its prompt's K/V are its adapter's
            return 0
        chunk = chunk // blk * blk
        return chunk if len(r.prompt) > chunk else 0

    def _prefill_chunks(self) -> list[tuple[int, torch.Tensor, int, int]]:
        """This step's chunk of every prompt being prefilled: (its row's key, tokens, from, to)."""
        out = []
        for r in self.prefilling:
            hi = min(len(r.prompt), r.prefilled + self._prefill_chunk(r))
            if hi > r.prefilled:
                out.append((id(r), r.prompt, r.prefilled, hi))
        return out

    def _charge_prefill(self) -> None:
        """The chunks computed in this step's forwards, charged to their rows."""
        rows = {id(r): r for r in self.prefilling}
        for key, queries, keys in self.pages.prefill_work:
            r = rows[key]
            r.prefilled += queries
            r.forward_positions += queries
            r.attended_positions += queries * keys
            self.computed_positions += queries
        self.pages.prefill_work.clear()

    def _admissible(self, joining: list[Row]) -> tuple[list[Row], list[Row]]:
        """The rows that join now, and those that wait a step: a row whose prompt's first block
        missing from the prefix store is one that a row joining now (or a prompt being prefilled)
        computes waits for it to be stored, rather than compute it too (a batch of prompts sharing
        few-shot exemplars computes them once)."""
        store = self.pages.store
        if store is None:
            return joining, []
        now, later, computing = [], [], set()
        for r in self.prefilling:  # the blocks their chunks are computing
            tokens = r.prompt.tolist()
            computing.update(store.keys(tokens)[store.match(tokens) :])
        for r in joining:
            tokens = r.prompt.tolist()
            keys = store.keys(tokens)
            first = store.match(tokens)
            if first < len(keys) and keys[first] in computing:
                later.append(r)
            else:
                computing.update(keys[first:])
                now.append(r)
        return now, later

    def _decide(self, logits: torch.Tensor, view: DecodeView) -> Decision:
        """Each row's decision, by the decoder it decides with: rows that share one in one call."""
        rows = self.rows
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(id(r.strategy), []).append(i)

        def decide(members: list[int], part: DecodeView, logits: torch.Tensor) -> Decision:
            strategy = rows[members[0]].strategy
            part.generators = [rows[i].generator for i in members] if strategy.draws_randomness else None
            return strategy.decide(logits, part)

        if len(groups) == 1:
            return decide(list(range(len(rows))), view, logits)
        parts = []
        for members in groups.values():
            idx = torch.tensor(members, device=self.device)
            parts.append((idx, decide(members, view.take(members), logits[idx])))
        return Decision.merged(parts, len(rows))

    def _block_over(self, block, decision) -> torch.Tensor:
        """(B,) whether each row's block is over after this step: where the strategy decides it
        (editing, a canvas with no mask), its say; else the block has no mask left."""
        if decision.block_done is not None:
            return decision.block_done
        return ~(block == self.mask_id).any(-1)

    def _carry_on(self, starts, decision: Decision, done: torch.Tensor) -> None:
        """What a strategy hands each row's next step in its block: its state (`Decision.carry`) and
        the signal that conditions the next forward, as the model takes it (`soft_input`: input
        vectors for the block's columns, or those of them the signal keeps)."""
        blk, signal = self.config.block_length, decision.signal
        kept = None if signal is None else signal.rows_kept()  # one read for the batch
        for i, (r, over) in enumerate(zip(self.rows, done.tolist())):
            r.carry = None if over or decision.carry is None else decision.carry[i]
            if signal is None or over:
                continue
            if kept is not None and not kept[i]:
                r.soft = None
                continue
            cols = torch.arange(starts[i], starts[i] + blk, device=self.device)
            vectors, keep = self.model.soft_input(signal.payload(i)), signal.keep(i)
            r.soft = (cols, vectors) if keep is None else (cols[keep], vectors[keep])

    def _after_step(self, window, steps_of, done: torch.Tensor, revealed_counts: torch.Tensor, work, columns) -> None:
        """Charge the step to its rows, then end the blocks that are over: those rows leave or
        move to their next block (past any that the blocks before revealed whole). One read from
        the device: the rows' windows (their current block and those after it, at `columns`), and
        per row whether its block is over, what it revealed and whether the block holds a stop
        token; and where a row whose block ends reports log-probabilities, its window's."""
        blk, rows = self.config.block_length, self.rows
        hit = torch.isin(window[:, :blk], self.stop_ids) & (steps_of[:, :blk] >= 0)
        hit = hit.any(-1) & self.stopping
        # blocks after the current one that are whole already (multi-block decoding)
        n_later = self.width // blk - 1
        whole = torch.zeros_like(revealed_counts)
        if n_later and self.strategy.later_blocks_final:
            later_masked = (window[:, blk:] == self.mask_id).view(len(rows), n_later, blk)
            whole = (~later_masked.any(-1)).long().cumprod(-1).sum(-1)
        parts = [done.long()[:, None], revealed_counts[:, None], hit.long()[:, None], whole[:, None], window]
        host = torch.cat(parts, 1).tolist()
        for i, r in enumerate(rows):
            r.tokens_per_step.append(host[i][1])
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
        kept = []
        for i, (r, h) in enumerate(zip(rows, host)):
            if not h[0]:
                kept.append((r, i))
                continue
            tokens = h[4:]
            r.finished, r.unrefreshed = bool(h[2]) and r.block >= r.stop_block, 0
            window_logprobs = self._window_logprobs(columns[i], i, r)
            k = 0
            while True:
                _, _, b_lo, b_hi = r.answer_span(r.block, blk)
                self.last_blocks.append((r, r.block, tokens[k * blk + b_lo : k * blk + b_hi]))
                if window_logprobs is not None:
                    r.block_logprobs[r.block] = window_logprobs[k * blk + b_lo : k * blk + b_hi]
                r.block += 1
                k += 1
                if r.finished or r.answered or k > h[3]:
                    break
                r.unrefreshed += 1  # revealed whole while it was a later block: no forward of its own
                r.finished = (
                    r.config.stop_at_eos
                    and r.block >= r.stop_block
                    and any(t in self.stop_set for t in tokens[k * blk : (k + 1) * blk])
                )
            if r.finished or r.answered:
                self._leave(i, r)
            else:
                r.step = 0
                kept.append((r, i))
                self._begin(i, r)
        if len(kept) < len(rows):
            self._relayout(kept)

    def _window_logprobs(self, columns: torch.Tensor, i: int, r: Row) -> list | None:
        """Row i's window (its `columns`) as (log-probability, top tokens) per column, None per
        column no forward wrote; None for a row that does not report them."""
        if self.logp is None or r.config.logprobs is None:
            return None
        k = r.config.logprobs
        values = self.logp[i, columns].tolist()
        ids, lps = self.top_ids[i, columns, :k].tolist(), self.top_lp[i, columns, :k].tolist()
        return [None if v != v else (v, list(zip(d, p))) for v, d, p in zip(values, ids, lps)]

    def _begin(self, i: int, r: Row) -> None:
        """Row i starts a block: its masks now (a family with no mask token: its canvas, drawn now
        from the row's generator)."""
        r.soft = r.carry = None
        blk = self.config.block_length
        start = r.column(blk)
        self.x[i, start : start + blk] = r.strategy.open_block(self.x[i, start : start + blk], r.generator)
        masked = self.x[i, start : start + blk] == self.mask_id
        self.opened[i] = masked.sum()

    def _leave(self, i: int, r: Row) -> None:
        blk, n = self.config.block_length, r.asked
        first = len(r.prompt) + r.lead  # the row's answer starts here
        r.answer = self.x[i, first : first + n].clone()
        r.unmask_step = self.step_of[i, first : first + n].clone()
        if r.finished:
            r.answer[r.block * blk - r.lead :] = self.model.args.eos_token_id
        self.left.append(r)

    # -- layout
    def _view(self) -> SequenceView:
        """What the forwards see of each row: with a suffix window, its columns only up to the cut
        (the masked tail after it is not part of any forward until the window reaches it)."""
        cfg, rows, blk = self.config, self.rows, self.config.block_length
        starts = tuple(r.column(blk) for r in rows)
        ends = [r.extent for r in rows]
        if cfg.suffix_window is not None:  # a row with a suffix sees it whole
            ends = [
                e if r.suffix is not None else min(e, s + self.width + cfg.suffix_window)
                for r, e, s in zip(rows, ends, starts)
            ]
        return SequenceView(
            self.x,
            starts,
            tuple(ends),
            tuple(r.block for r in rows),
            blk,
            self.width,
            tuple(1 + r.unrefreshed for r in rows),
            tuple(r.reused for r in rows),
            {i: r.soft for i, r in enumerate(rows) if r.soft is not None} or None,
            {i: self.model.lora.index(r.config.adapter) for i, r in enumerate(rows) if r.config.adapter} or None,
        )

    def _relayout(self, moves: list[tuple[Row, int | None]], prefilled: dict | None = None) -> None:
        """Lay the rows out again when rows join or leave: `moves` are the new layout's rows in
        order, each with its index in the old layout (None: a row that joins). A row keeps its
        columns (its prompt from column 0, then its region) and its pages of the K/V pool
        (`RowPages.relayout`); rows that move on to their next block stay where they are.
        `prefilled`: new row -> the key of the pages its prompt was prefilled into."""
        dev = self.device
        self.rows = [r for r, _ in moves]
        if not moves:
            self.x = self.step_of = self.row_nfe = self.opened = None
            self.logp = self.top_ids = self.top_lp = None
            self.pages.relayout([])
            self.policy.relayout([])
            return
        # room after the longest row for the columns a step reads past a row's region
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
        self._lay_out_logprobs(moves, length, kept)
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
        self.row_nfe = self._carry(self.row_nfe, sources, 0)
        self.opened = self._carry(self.opened, sources, 0)
        self.pages.relayout(sources, [None if src is not None else r.extent for r, src in moves], prefilled)
        self.policy.relayout(sources)
        self.x, self.step_of = x, step_of
        self.stopping = torch.tensor([r.config.stop_at_eos for r, _ in moves], device=dev)  # per row
        joined = {i: r for i, (r, src) in enumerate(moves) if src is None}
        # a row with an adapter neither shares nor stores its prompt's K/V (the store holds the base's)
        shared = {i: r.prompt.tolist() for i, r in joined.items() if r.config.adapter is None}
        reused = self.pages.reuse(bsz, shared)
        for i, r in joined.items():
            r.reused = reused.get(i, 0)
            self._begin(i, r)

    def _lay_out_logprobs(self, moves, length: int, kept: list[tuple[int, int]]) -> None:
        """The log-probability columns for the new layout, where a row of it reports them; kept
        rows keep theirs."""
        asked = [r.config.logprobs for r, _ in moves if r.config.logprobs is not None]
        if not asked:
            self.logp = self.top_ids = self.top_lp = None
            return
        bsz, k, dev = len(moves), max(asked), self.device
        logp = torch.full((bsz, length), float("nan"), device=dev)
        top_ids = torch.zeros((bsz, length, k), dtype=torch.long, device=dev)
        top_lp = torch.full((bsz, length, k), float("nan"), device=dev)
        if kept and self.logp is not None:
            dst, src = (torch.tensor(t, device=dev) for t in zip(*kept))
            width, old_k = min(length, self.logp.shape[1]), min(k, self.top_lp.shape[-1])
            logp[dst, :width] = self.logp[src, :width]
            top_ids[dst, :width, :old_k] = self.top_ids[src, :width, :old_k]
            top_lp[dst, :width, :old_k] = self.top_lp[src, :width, :old_k]
        self.logp, self.top_ids, self.top_lp = logp, top_ids, top_lp

    def _record_logprobs(self, logits: torch.Tensor, columns: torch.Tensor, decision: Decision) -> None:
        """Where this step wrote a token (revealed, edited, or ahead in a later block), its
        log-probability and the most likely tokens in this forward (`decode.token_logprobs`)."""
        tokens, written = decision.tokens, decision.chosen
        if decision.edited is not None:
            written = written | decision.edited
        if decision.ahead is not None and self.width > self.config.block_length:
            tokens = torch.cat([tokens, decision.ahead_tokens], 1)
            written = torch.cat([written, decision.ahead], 1)
        width = written.shape[1]
        lp = token_logprobs(logits[:, :width], [r.config for r in self.rows])
        for i, r in enumerate(self.rows):  # a grammar's rows: renormalised over what it allowed
            if r.constraint is None or r.config.logprobs_mode == "raw":
                continue
            for p, allowed in r.constraint.masks.items():
                kept = torch.where(allowed, lp[i, p], float("-inf"))
                lp[i, p] = kept - kept.logsumexp(-1)
        cols = columns[:, :width]
        chosen = lp.gather(-1, tokens[..., None]).squeeze(-1)
        self.logp.scatter_(1, cols, torch.where(written, chosen, self.logp.gather(1, cols)))
        k = self.top_lp.shape[-1]
        if k:
            values, ids = lp.topk(k, -1)
            cols, keep = cols[..., None].expand(-1, -1, k), written[..., None]
            self.top_lp.scatter_(1, cols, torch.where(keep, values, self.top_lp.gather(1, cols)))
            self.top_ids.scatter_(1, cols, torch.where(keep, ids, self.top_ids.gather(1, cols)))

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
