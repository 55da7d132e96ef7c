"""Generation over one batch of prompts: `generate`, `iter_generate`, `stream_blocks`.

The loop itself (block-wise masked diffusion decoding, one loop for every strategy) is
`decoder.BlockDecoder`; these functions drive it for a batch whose rows all start together (the
server's scheduler drives it with rows that join later).

Beyond the reference implementations:
- batches of prompts of different lengths decode as each row alone, packed without padding: every
  row follows its own clock, schedule, threshold and random stream (see `decoder`);
- stop at EOS: once a completed block holds a stop token (EOS or end-of-turn), later blocks cannot
  change anything before it, so the row stops and the rest is filled with EOS; finished rows leave
  the batch;
- `on_step` sees the canvas after every step, and `stream_blocks` yields each block once final.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig, is_int
from .decoder import BlockDecoder
from .kv.runner import KVRunner
from .policies import PolicySource


@dataclass
class RunStats:
    """What one run of the loop cost, per row (as each would alone), carried by its "done" event."""

    nfe: int  # forward passes of the batch
    nfe_per_row: list[int]  # forward passes each row needed (what it would cost alone)
    tokens_per_step: list[list[int]]  # per row: tokens revealed at each of its steps
    unmask_step: torch.Tensor  # (B, gen_length) the row's step revealing each position
    forward_time: float  # seconds inside the model's forward passes
    finished: list[bool]  # per row: stopped at a stop token
    # Work, per row, hardware-independent: query positions processed by all of the row's forwards,
    # and query x key positions attended (the attention's cost).
    forward_positions: list[int]
    attended_positions: list[int]
    prompt_positions: list[int]  # per row: its prompt's positions that its prefill computed
    kv_cache_bytes: int  # the most KV cache memory the run held at once (0 without a cache)
    # What the batch's forwards computed: rows summed over them (against sum(nfe_per_row), what
    # the rows needed), and query positions (against sum(forward_positions)).
    row_forwards: int = 0
    computed_positions: int = 0
    # Per row, what each of its speculative verifications accepted (LinearSpec's acceptance
    # lengths); empty lists for other decoders.
    acceptances: list[list[int]] | None = None
    # With `config.logprobs`: per row, per answer position, the log-probability of its token in the
    # forward that wrote it (None: a fixed token or padding after a stop), and the `logprobs` most
    # likely tokens there as (id, log-probability) pairs, most likely first (None where no forward
    # wrote the position). None without.
    logprobs: list[list[float | None]] | None = None
    top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None


@dataclass
class GenerationOutput:
    """The generated ids and what the run cost: `stats` (a `RunStats`) and its fields read here
    directly (`out.nfe`, `out.nfe_per_row`, `out.forward_positions`, ...)."""

    sequences: torch.Tensor  # (B, gen_length) generated ids (EOS-filled after a stop)
    stats: RunStats = field(repr=False)
    unmask_step: torch.Tensor  # (B, gen_length) as `stats.unmask_step`, cut as `sequences` is
    num_tokens: list[int]  # per row: generated tokens up to (not including) the first stop token
    wall_time: float
    config: GenerationConfig = field(repr=False, default=None)

    def __getattr__(self, name: str):
        # the run's statistics, as attributes of the output (dataclass fields are found first)
        if name != "stats" and name in RunStats.__dataclass_fields__:
            return getattr(self.stats, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def tokens_per_second(self) -> float:
        return sum(self.num_tokens) / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def positions_per_token(self) -> float:
        """Query positions computed per generated token (tokens up to the first stop, as
        tokens/s counts them): ~1 for autoregressive decoding after the prompt."""
        return sum(self.stats.forward_positions) / max(1, sum(self.num_tokens))

    @property
    def decode_positions_per_token(self) -> float:
        """Query positions per generated token beyond one prefill of each prompt: 1 is the
        autoregressive limit (a prompt's positions once, then one per token)."""
        extra = sum(self.stats.forward_positions) - sum(self.stats.prompt_positions)
        return extra / max(1, sum(self.num_tokens))

    @property
    def attended_per_token(self) -> float:
        """Query x key positions attended per generated token."""
        return sum(self.stats.attended_positions) / max(1, sum(self.num_tokens))


@dataclass
class StepEvent:
    """Given to `on_step` after every step, and yielded by `iter_generate`. Rows advance on their
    own clocks: `blocks[j]` is the block of row `rows[j]` at this step. A "block" event names the
    rows whose block `block` became final at that step."""

    kind: str  # "step" or "block" (a block became final) or "done"
    canvas: torch.Tensor  # (B, gen_length) current answer region, mask id where still masked
    block: int  # index of the current block (of the first row in `rows`)
    rows: list[int]  # batch rows that took part in this step (that finished `block`, on "block")
    finished: list[bool] | None = None  # per row: stopped at a stop token
    chosen: torch.Tensor | None = field(default=None, repr=False)  # (len(rows), block_length)
    block_length: int = 0
    nfe: int = 0  # the batch's forwards so far
    stats: RunStats | None = field(default=None, repr=False)  # on "done": what the run cost, per row
    blocks: list[int] | None = None  # per row of `rows`: its block at this step (None: every one at `block`)
    leads: list[int] | None = None  # per row of `rows`: prompt tokens that open its first block (block-causal)

    @property
    def revealed(self) -> torch.Tensor | None:
        """(B, gen_length) bool: positions revealed by this step (built on demand: the loop
        itself never needs it)."""
        if self.chosen is None:
            return None
        out = torch.zeros(self.canvas.shape, dtype=torch.bool, device=self.canvas.device)
        blocks = self.blocks or [self.block] * len(self.rows)
        leads = self.leads or [0] * len(self.rows)
        width = self.canvas.shape[1]
        for j, (row, b, lead) in enumerate(zip(self.rows, blocks, leads)):
            lo, hi = b * self.block_length - lead, (b + 1) * self.block_length - lead
            a_lo, a_hi = max(0, lo), min(width, hi)
            if a_hi > a_lo:
                out[row, a_lo:a_hi] = self.chosen[j, a_lo - lo : a_hi - lo]
        return out


# ---- the loop, driven for one batch -------------------------------------------------------------
def iter_generate(
    model,
    input_ids,
    config: GenerationConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    row_seeds: Sequence[int] | None = None,
    policies: PolicySource = None,
    constraints: Sequence | None = None,
    kv: KVRunner | None = None,
    images: Sequence | None = None,
) -> Iterator[StepEvent]:
    """The decoding loop (`decoder.BlockDecoder`) over one batch, as a generator of events.
    `generate` runs it to the end.

    `policies` (a `policies.Policies` bundle, or a callable (model, config) -> Policies) replaces
    the policies that the config names: a new policy plugs in here. `kv`: the `kv.KVRunner` whose
    pages and prefix store the rows use (default: the model's, shared by calls that bring none).
    `images`: per prompt, the images its placeholders stand for (`generate`'s)."""
    config = config or GenerationConfig.for_model(model, checkpoint_defaults=False)
    decoder = BlockDecoder(model, config, policies=policies, kv=kv)
    rows = decoder.add(input_ids, attention_mask, row_seeds, constraints=constraints, images=images)
    blk = config.block_length
    slot = {id(r): i for i, r in enumerate(rows)}
    # The answers as the caller sees them: (B, gen_length), the mask id where still masked.
    canvas = torch.full((len(rows), config.gen_length), model.mask_token_id, dtype=torch.long, device=model.device)
    for i, r in enumerate(rows):  # fixed tokens are there from the start
        for pos, t in r.fixed:
            canvas[i, pos] = t

    while True:
        step = decoder.step()
        if step is None:
            break
        if not step.rows:  # a forward of prompts being prefilled, no row decoding yet
            continue
        live = [slot[id(r)] for r in step.rows]
        # every row's current block on the canvas, in one write
        places = answer_places([(i, r, b) for i, (r, b) in enumerate(zip(step.rows, step.blocks))])
        if places[0]:
            at = torch.tensor([[live[i] for i in places[0]], *places], device=canvas.device)
            canvas[at[0], at[2]] = step.tokens[at[1], at[3]]
        for r in decoder.left:
            canvas[slot[id(r)]] = r.answer
        yield StepEvent(
            "step",
            canvas,
            step.blocks[0],
            live,
            chosen=step.chosen if step.edited is None else step.chosen | step.edited,
            block_length=blk,
            nfe=decoder.nfe,
            blocks=step.blocks,
            leads=[r.lead for r in step.rows],
        )
        by_block: dict[int, list] = {}
        for r, b, _ in decoder.last_blocks:
            by_block.setdefault(b, []).append(slot[id(r)])
        # the blocks that became final (also one revealed whole while it was a later one), in one write
        final = [(slot[id(r)], r, b, tokens) for r, b, tokens in decoder.last_blocks if not r.done]
        places = answer_places([(k, r, b) for k, (_, r, b, _) in enumerate(final)])
        if places[0]:
            tokens = [t for *_, block_tokens in final for t in block_tokens]
            at = torch.tensor([[final[k][0] for k in places[0]], places[1], tokens], device=canvas.device)
            canvas[at[0], at[1]] = at[2]
        for b in sorted(by_block):
            yield StepEvent("block", canvas, b, by_block[b], finished=[r.finished for r in rows], nfe=decoder.nfe)

    finished = [r.finished for r in rows]
    yield StepEvent(
        "done", canvas, config.num_blocks - 1, [], finished=finished, nfe=decoder.nfe, stats=run_stats(decoder, rows)
    )


def answer_places(entries) -> tuple[list[int], list[int], list[int]]:
    """Per answer position that block `b` of row `r` holds, for each (key, r, b) entry: its key,
    its column in the answer and its column in the block (`Row.answer_span`)."""
    keys, answer_columns, block_columns = [], [], []
    for key, r, b in entries:
        a_lo, a_hi, b_lo, _ = r.answer_span(b)
        keys += [key] * (a_hi - a_lo)
        answer_columns += range(a_lo, a_hi)
        block_columns += range(b_lo, b_lo + a_hi - a_lo)
    return keys, answer_columns, block_columns


def run_stats(decoder: BlockDecoder, rows) -> RunStats:
    """What a decode of `rows` cost, per row, once they are all done."""
    return RunStats(
        nfe=decoder.nfe,
        nfe_per_row=[r.nfe for r in rows],
        tokens_per_step=[r.tokens_per_step for r in rows],
        unmask_step=torch.stack([r.unmask_step for r in rows]),
        forward_time=decoder.forward_time,
        finished=[r.finished for r in rows],
        forward_positions=[r.forward_positions for r in rows],
        attended_positions=[r.attended_positions for r in rows],
        prompt_positions=[r.prompt_positions for r in rows],
        kv_cache_bytes=decoder.pages.peak_bytes,
        row_forwards=decoder.row_forwards,
        acceptances=[r.acceptances for r in rows],
        computed_positions=decoder.computed_positions,
        **answer_logprobs(rows),
    )


def answer_logprobs(rows) -> dict:
    """`RunStats.logprobs` and `top_logprobs`: each row's final blocks' (`Row.block_logprobs`) at
    their answer positions (empty where no row reports them)."""
    if all(r.config.logprobs is None for r in rows):
        return {}
    logprobs, tops = [], []
    for r in rows:
        if r.config.logprobs is None:
            logprobs.append(None)
            tops.append(None)
            continue
        entries = [None] * r.asked
        for b, block in r.block_logprobs.items():
            a_lo, a_hi, _, _ = r.answer_span(b)
            entries[a_lo:a_hi] = block
        logprobs.append([None if e is None else e[0] for e in entries])
        tops.append([None if e is None else e[1] for e in entries])
    return {"logprobs": logprobs, "top_logprobs": tops}


def count_until_stop(seq: torch.Tensor, stop_ids: Sequence[int], start: int = 0) -> list[int]:
    """Per row: tokens before the first stop token at or after `start` (all of them when there is
    none; `start`: the end of the fixed tokens, before which stop tokens pad the fill)."""
    is_stop = torch.isin(seq, torch.tensor(list(stop_ids), device=seq.device))
    is_stop[:, :start] = False
    first = torch.where(is_stop.any(-1), is_stop.long().argmax(-1), torch.full_like(seq[:, 0], seq.shape[1]))
    return first.tolist()


def generate(
    model,
    input_ids,
    config: GenerationConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
    row_seeds: Sequence[int] | None = None,
    policies: PolicySource = None,
    num_return_sequences: int = 1,
    constraints: Sequence | None = None,
    kv: KVRunner | None = None,
    images: Sequence | None = None,
    **options,
) -> GenerationOutput:
    """Generate `config.gen_length` tokens after each prompt.

    input_ids: a (B, P) tensor (left-padded, with `attention_mask`), or a list of token-id lists
    of any lengths (padded here). `row_seeds` gives each row its own random stream (else
    `config.seed` + row). `policies` plugs in policy objects (see `iter_generate`).
    `options`: decoding fields that change `config` (`gen_length=128`), transformers' keywords
    included (`max_new_tokens=64` also cuts the sequences to 64 tokens; `do_sample`;
    `GenerationConfig.with_options`). `constraints`: per row, None or a `constraints.GrammarConstraint`
    its answer must follow (JSON, a schema, a regex). `num_return_sequences`: each prompt decoded that many times,
    its copies next to each other, each with its own random stream (as transformers orders them).
    `kv`: the `kv.KVRunner` that holds the K/V (see `iter_generate`). `images`: per prompt, the
    images its placeholders stand for (a model with a vision tower, `Transformer.place_images`: a
    `PIL.Image`, a path, bytes or a data URL each), e.g. `[[photo], []]`.
    Returns the generated ids and the statistics of the run.
    """
    cut = options.get("max_new_tokens")
    if config is None:
        config = GenerationConfig.for_call(model, lambda c: c.with_options(**options) if options else c)
    elif options:
        config = config.with_options(**options)
    if not is_int(num_return_sequences) or num_return_sequences < 1:
        raise ValueError(f"num_return_sequences: must be a positive integer (got {num_return_sequences!r})")
    if num_return_sequences > 1:
        k = num_return_sequences
        if constraints is not None:
            raise ValueError(
                "constraints: give one per row instead of num_return_sequences (a constraint holds its row's state)"
            )
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.repeat_interleave(k, 0)
            attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(k, 0)
        else:
            input_ids = [list(ids) for ids in input_ids for _ in range(k)]
        if images is not None:
            images = [imgs for imgs in images for _ in range(k)]
        if row_seeds is not None:
            row_seeds = [s * k + j for s in row_seeds for j in range(k)]
    t0 = time.perf_counter()
    last = None
    with torch.inference_mode():
        events = iter_generate(model, input_ids, config, attention_mask, row_seeds, policies, constraints, kv, images)
        for event in events:
            if on_step is not None and event.kind != "done":
                on_step(event)
            last = event
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    sequences, stats = last.canvas.clone(), last.stats
    unmask_step = stats.unmask_step
    if cut is not None:
        sequences, unmask_step = sequences[:, :cut].clone(), unmask_step[:, :cut]
        if stats.logprobs is not None:
            stats.logprobs = [None if lp is None else lp[:cut] for lp in stats.logprobs]
            stats.top_logprobs = [None if t is None else t[:cut] for t in stats.top_logprobs]
    return GenerationOutput(
        sequences=sequences,
        stats=stats,
        unmask_step=unmask_step,
        num_tokens=count_until_stop(sequences, model.stop_token_ids, config.fixed_end),
        wall_time=wall,
        config=config,
    )


def warm_up(model, config: GenerationConfig) -> float:
    """With `config.compile`, compile before anything is timed or served: one row alone and two of
    different lengths (padding), over two blocks (full forwards and windows over the cache).
    Returns the seconds it took (0 without compile)."""
    if not config.compile:
        return 0.0
    t0 = time.perf_counter()
    pad = model.args.eos_token_id
    cfg = config.replace(gen_length=2 * config.block_length, steps=None, stop_at_eos=False, seed=0)
    for ids in ([[pad] * 3], [[pad] * 3, [pad] * 5]):
        generate(model, ids, cfg)
    return time.perf_counter() - t0


def stream_blocks(
    model,
    input_ids,
    config: GenerationConfig | None = None,
    attention_mask=None,
    row_seeds=None,
    policies: PolicySource = None,
    kv: KVRunner | None = None,
    images: Sequence | None = None,
) -> Iterator[tuple[int, list[list[int]], list[bool]]]:
    """Yield (block index, per-row token ids of that block, per-row finished) as soon as each
    block is final: inside a block tokens settle out of order, so a block is the unit a server
    can stream. Rows that already finished get an empty list. `policies`, `kv`, `images`: as for
    `iter_generate` (whose events also count the forwards so far)."""
    config = config or GenerationConfig.for_model(model, checkpoint_defaults=False)
    blk = config.block_length
    with torch.inference_mode():
        events = iter_generate(
            model, input_ids, config, attention_mask, row_seeds, policies=policies, kv=kv, images=images
        )
        for event in events:
            if event.kind != "block":
                continue
            b = event.block
            part = event.canvas[:, b * blk : (b + 1) * blk].tolist()
            yield b, [part[r] if r in event.rows else [] for r in range(len(part))], event.finished
