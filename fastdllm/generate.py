"""The generation loop: block-wise masked diffusion decoding, one loop for every strategy.

The answer region (gen_length positions after the prompt) starts as all [MASK] and is decoded in
blocks of `block_length`, left to right. Inside a block, each step asks the *cache policy*
(`cache_policies.py`) for the block's logits and the *unmasking policy* (`unmasking.py`) which
masked positions to reveal, until the block has no masks left. Then the next block starts (and a
caching policy refreshes its cache). Positions after the current block are never revealed.

Beyond the reference implementations:
- batches of prompts of different lengths (left padding) decode as each row alone: every row
  follows its own schedule, threshold and random stream (a row whose block is done draws nothing
  while other rows finish theirs). Rows of equal length decode bit-identically in float32 whatever
  else is in the batch. Padding changes how attention's sums are split and rounded (a padded row's
  logits move by ~1e-5 in float32, ~1e-2 in bfloat16), so a near-tied token can then differ;
- stop at EOS: once a completed block holds a stop token (EOS or end-of-turn), later blocks cannot
  change anything before it, so the row stops and the rest is filled with EOS; finished rows leave
  the batch;
- `on_step` sees the canvas after every step, and `stream_blocks` yields each block once final.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .cache_policies import CachePolicy, NoCache, SequenceView, cache_policy
from .config import ConfigError, GenerationConfig  # noqa: F401 - re-exported: their old home
from .models.transformer import positions_from_mask
from .unmasking import UnmaskingStrategy

@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, gen_length) generated ids (EOS-filled after a stop)
    nfe: int  # forward passes of the batch
    nfe_per_row: list[int]  # forward passes each row needed (what it would cost alone)
    tokens_per_step: list[list[int]]  # per row: tokens revealed at each of its steps
    unmask_step: torch.Tensor  # (B, gen_length): the row's step at which each position was revealed
    num_tokens: list[int]  # per row: generated tokens up to (not including) the first stop token
    wall_time: float
    forward_time: float  # seconds inside the model's forward passes
    config: GenerationConfig = field(repr=False, default=None)
    # Work, per row, hardware-independent: query positions processed by all of the row's forwards,
    # and query x key positions attended (the attention's cost).
    forward_positions: list[int] = field(default_factory=list)
    attended_positions: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return sum(self.num_tokens) / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def positions_per_token(self) -> float:
        """Query positions computed per generated token (tokens up to the first stop, as
        tokens/s counts them): ~1 for autoregressive decoding after the prompt."""
        return sum(self.forward_positions) / max(1, sum(self.num_tokens))

    @property
    def attended_per_token(self) -> float:
        """Query x key positions attended per generated token."""
        return sum(self.attended_positions) / max(1, sum(self.num_tokens))


@dataclass
class StepEvent:
    """Given to `on_step` after every step, and yielded by `iter_generate`."""

    kind: str  # "step" or "block" (a block became final) or "done"
    canvas: torch.Tensor  # (B, gen_length) current answer region, mask id where still masked
    block: int  # index of the current block
    rows: list[int]  # batch rows that took part in this step
    finished: list[bool] | None = None  # per row: stopped at a stop token
    chosen: torch.Tensor | None = field(default=None, repr=False)  # (len(rows), block_length)
    block_length: int = 0

    @property
    def revealed(self) -> torch.Tensor | None:
        """(B, gen_length) bool: positions revealed by this step (built on demand: the loop
        itself never needs it)."""
        if self.chosen is None:
            return None
        out = torch.zeros(self.canvas.shape, dtype=torch.bool, device=self.canvas.device)
        offset = self.block * self.block_length
        out[self.rows, offset : offset + self.chosen.shape[1]] = self.chosen
        return out


# ---- input preparation -------------------------------------------------------------------------
def prepare_inputs(model, input_ids, attention_mask, config: GenerationConfig):
    """Left-pad a list of prompts (or check a padded tensor); returns ids (B, P) and mask (B, P)."""
    pad_id = model.args.eos_token_id
    vocab = model.args.vocab_size
    if input_ids is None or isinstance(input_ids, (str, bytes)) or (
            isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], str)):
        raise ValueError("input_ids: generate() takes token ids (a list of ints, a list of lists, or a tensor); "
                         "for text use fastdllm.generate_text(model, tokenizer, text)")
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
        rows = [input_ids] if not isinstance(input_ids[0], (list, tuple, torch.Tensor)) else \
            [list(r.tolist() if isinstance(r, torch.Tensor) else r) for r in input_ids]
        for r in rows:
            for t in r:
                if not isinstance(t, int) or isinstance(t, bool):
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


def _generators(config: GenerationConfig, batch: int, row_seeds, device) -> list[torch.Generator]:
    if row_seeds is not None:
        if len(row_seeds) != batch:
            raise ValueError(f"row_seeds: need one seed per row ({batch}), got {len(row_seeds)}")
        seeds = list(row_seeds)
    else:
        base = config.seed if config.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        seeds = [base + i for i in range(batch)]
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


# ---- the loop ----------------------------------------------------------------------------------
def iter_generate(
    model,
    input_ids,
    config: GenerationConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    row_seeds: Sequence[int] | None = None,
    stats: dict | None = None,
    cache: CachePolicy | None = None,
    strategy: UnmaskingStrategy | None = None,
) -> Iterator[StepEvent]:
    """The one decoding loop, as a generator of events. `generate` runs it to the end.

    `cache` (a CachePolicy) and `strategy` (an UnmaskingStrategy) override the policies that
    `config.cache` and the config's unmasking fields name: a new policy plugs in here."""
    config = config or GenerationConfig()
    prompt, prompt_mask = prepare_inputs(model, input_ids, attention_mask, config)
    bsz, plen = prompt.shape
    gen_len, blk = config.gen_length, config.block_length
    length = plen + gen_len
    mask_id = model.mask_token_id
    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    x = torch.cat([prompt, torch.full((bsz, gen_len), mask_id, dtype=torch.long, device=device)], dim=1)
    full_mask = torch.cat([prompt_mask, torch.ones((bsz, gen_len), dtype=torch.bool, device=device)], dim=1)
    positions = positions_from_mask(full_mask, bsz, length, device)
    key_mask = None if bool(full_mask.all()) else full_mask[:, None, None, :]

    policy = cache if cache is not None else cache_policy(model, config)
    if strategy is None:
        cached = not isinstance(policy, NoCache)
        family = getattr(getattr(model, "family", None), "MODEL_TYPE", None)
        strategy = UnmaskingStrategy.from_config(config, family, cached)
    rule = strategy.new_rule()
    generators = _generators(config, bsz, row_seeds, device) if strategy.draws_randomness else None
    stop_ids = torch.tensor(sorted(set(model.stop_token_ids)), device=device)

    unmask_step = torch.full((bsz, gen_len), -1, dtype=torch.long, device=device)
    row_nfe = torch.zeros(bsz, dtype=torch.long, device=device)  # steps each row took part in
    row_queries, row_attended = [0] * bsz, [0] * bsz  # work each row took part in
    row_extra = [0] * bsz  # forwards beyond one per step (an adaptive refresh's full forward)
    # (rows, tokens revealed per row, row had masks, query and key positions of the step's forward):
    # per-row lists and work are built at the end, so the step itself does no host-side bookkeeping.
    step_log: list[tuple] = []
    finished = [False] * bsz
    nfe, forward_time = 0, 0.0
    stats = {} if stats is None else stats

    for b, steps in enumerate(config.steps_per_block()):
        rows = [r for r in range(bsz) if not finished[r]]
        if not rows:
            break
        start, end = plen + b * blk, plen + (b + 1) * blk
        all_rows = len(rows) == bsz
        idx = None if all_rows else torch.tensor(rows, device=device)
        # Finished rows leave the batch: decode a compact copy and write it back after the block.
        xa = x if all_rows else x[idx]
        # A suffix window: forwards see the sequence only up to `cut` (the masked tail after it
        # is not part of any forward until the window reaches it).
        cut = length if config.suffix_window is None else min(length, end + config.suffix_window)
        pos = positions if all_rows else positions[idx]
        km = key_mask if (all_rows or key_mask is None) else key_mask[idx]
        seq = SequenceView(xa[:, :cut], pos[:, :cut], None if km is None else km[..., :cut], block=b,
                           block_length=blk, rows=tuple(rows), capacity=length)
        block = xa[:, start:end]  # a view: writes go straight into xa
        masked = block == mask_id
        rule.begin_block(masked, steps, generators, rows)
        step = 0
        while True:
            masked = block == mask_id
            has_mask = masked.any(-1)
            if not bool(has_mask.any()):
                break
            sync()
            t0 = time.perf_counter()
            logits = policy.block_logits(seq, start, end, step)
            sync()
            forward_time += time.perf_counter() - t0
            nfe += 1
            stats["nfe"] = nfe
            queries, keys = policy.last_work
            extra, policy.extra_work = getattr(policy, "extra_work", None), None
            if extra is not None:  # a further forward for some rows (the adaptive refresh)
                batch_rows, q, k = extra
                nfe += 1
                for i in batch_rows:
                    row_queries[rows[i]] += q
                    row_attended[rows[i]] += q * k
                    row_extra[rows[i]] += 1
            # Rows whose block is already done draw no randomness: each row's stream must advance
            # exactly as when it is decoded alone, whatever the other rows still need.
            drawing = rows
            if generators is not None and not bool(has_mask.all()):
                drawing = [r if m else None for r, m in zip(rows, has_mask.tolist())]
            tokens, conf = strategy.propose(logits, generators, drawing)
            chosen = rule.select(conf, masked, step, generators, drawing) & masked
            block[chosen] = tokens[chosen]
            # Record, vectorised: the step index of each revealed position, per row.
            region = unmask_step[:, start - plen : end - plen]
            if all_rows:
                region.copy_(torch.where(chosen, row_nfe[:, None], region))
                row_nfe += has_mask
            else:
                region[idx] = torch.where(chosen, row_nfe[idx, None], region[idx])
                row_nfe[idx] += has_mask
            step_log.append((rows, chosen.sum(-1), has_mask, queries, keys))
            step += 1
            if not all_rows:
                x[idx, start:end] = block
            yield StepEvent("step", x[:, plen:], b, rows, chosen=chosen, block_length=blk)
        if not all_rows:
            x[idx] = xa
        if config.stop_at_eos:
            hit = torch.isin(x[rows, start:end], stop_ids).any(-1).tolist()
            for i, r in enumerate(rows):
                if hit[i]:
                    finished[r] = True
                    x[r, end:] = model.args.eos_token_id
        yield StepEvent("block", x[:, plen:], b, rows, finished=list(finished))

    tokens_per_step: list[list[int]] = [[] for _ in range(bsz)]
    for rows_in_step, counts, live, queries, keys in step_log:
        for r, c, alive in zip(rows_in_step, counts.tolist(), live.tolist()):
            if alive:  # a row is charged a forward only when it needed it: what it costs alone
                tokens_per_step[r].append(c)
                row_queries[r] += queries
                row_attended[r] += queries * keys
    stats.update(nfe=nfe, row_nfe=[n + e for n, e in zip(row_nfe.tolist(), row_extra)],
                 tokens_per_step=tokens_per_step, unmask_step=unmask_step, forward_time=forward_time,
                 finished=finished, forward_positions=row_queries, attended_positions=row_attended)
    yield StepEvent("done", x[:, plen:], config.num_blocks - 1, [], finished=list(finished))


def count_until_stop(seq: torch.Tensor, stop_ids: Sequence[int]) -> list[int]:
    """Per row: tokens before the first stop token (all of them when there is none)."""
    is_stop = torch.isin(seq, torch.tensor(list(stop_ids), device=seq.device))
    first = torch.where(is_stop.any(-1), is_stop.long().argmax(-1), torch.full_like(seq[:, 0], seq.shape[1]))
    return first.tolist()


def generate(
    model,
    input_ids,
    config: GenerationConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
    row_seeds: Sequence[int] | None = None,
    cache: CachePolicy | None = None,
    strategy: UnmaskingStrategy | None = None,
) -> GenerationOutput:
    """Generate `config.gen_length` tokens after each prompt.

    input_ids: a (B, P) tensor (left-padded, with `attention_mask`), or a list of token-id lists
    of any lengths (padded here). `row_seeds` gives each row its own random stream (else
    `config.seed` + row). `cache` and `strategy` plug in policy objects (see `iter_generate`).
    Returns the generated ids and the statistics of the run.
    """
    config = config or GenerationConfig()
    stats: dict = {}
    t0 = time.perf_counter()
    last = None
    with torch.inference_mode():
        for event in iter_generate(model, input_ids, config, attention_mask, row_seeds, stats, cache, strategy):
            if on_step is not None and event.kind != "done":
                on_step(event)
            last = event
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    sequences = last.canvas.clone()
    return GenerationOutput(
        sequences=sequences,
        nfe=stats["nfe"],
        nfe_per_row=stats["row_nfe"],
        tokens_per_step=stats["tokens_per_step"],
        unmask_step=stats["unmask_step"],
        num_tokens=count_until_stop(sequences, model.stop_token_ids),
        wall_time=wall,
        forward_time=stats["forward_time"],
        config=config,
        forward_positions=stats["forward_positions"],
        attended_positions=stats["attended_positions"],
    )


def stream_blocks(
    model, input_ids, config: GenerationConfig | None = None, attention_mask=None, row_seeds=None,
    stats: dict | None = None,
) -> Iterator[tuple[int, list[list[int]], list[bool]]]:
    """Yield (block index, per-row token ids of that block, per-row finished) as soon as each
    block is final: inside a block tokens settle out of order, so a block is the unit a server
    can stream. Rows that already finished get an empty list. `stats["nfe"]` counts the forwards
    so far (also when the caller stops early)."""
    config = config or GenerationConfig()
    blk = config.block_length
    with torch.inference_mode():
        for event in iter_generate(model, input_ids, config, attention_mask, row_seeds, stats):
            if event.kind != "block":
                continue
            b = event.block
            part = event.canvas[:, b * blk : (b + 1) * blk].tolist()
            yield b, [part[r] if r in event.rows else [] for r in range(len(part))], event.finished
