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
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable, Iterator, Sequence

import torch

from .cache_policies import CACHE_POLICIES, SequenceView
from .models.transformer import positions_from_mask
from .unmasking import DREAM_ALGS, needs_randomness, propose, selection_rule

REMASKING = ("low_confidence", "random")


@dataclass
class GenerationConfig:
    """Decoding settings, named as in the LLaDA / Fast-dLLM / Dream reference code.

    The defaults are Fast-dLLM's full method: DualCache with threshold-0.9 parallel decoding,
    gen_length 256 in blocks of 32. The LLaDA baseline is `threshold=None, cache='none'`
    (one token per step when steps == gen_length). Parallel decoding: `threshold` (unmask all
    positions at or above it) or `factor` (Fast-dLLM's factor rule; takes precedence over
    threshold). With neither, each block follows a fixed schedule of `steps` spread over the
    blocks: LLaDA's linear schedule, or Dream's timestep schedule when `alg` is set.

    `steps` not divisible by the number of blocks: the remainder goes to the first blocks (the
    reference requires divisibility). `steps` defaults to gen_length.
    """

    gen_length: int = 256
    block_length: int = 32
    steps: int | None = None
    temperature: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = 0.9
    factor: float | None = None
    cache: str = "dual"
    alg: str | None = None
    alg_temp: float | None = None
    eps: float = 1e-3
    top_p: float | None = None
    top_k: int | None = None
    stop_at_eos: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def baseline(cls, **overrides) -> "GenerationConfig":
        """LLaDA's semi-autoregressive baseline: no cache, one token per step."""
        return cls(**{"threshold": None, "cache": "none", **overrides})

    def replace(self, **changes) -> "GenerationConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def total_steps(self) -> int:
        return self.gen_length if self.steps is None else self.steps

    def steps_per_block(self) -> list[int]:
        nb, total = self.num_blocks, self.total_steps
        return [total // nb + (1 if b < total % nb else 0) for b in range(nb)]

    def validate(self) -> None:
        """Every check in one place: a ValueError naming the parameter and what is allowed."""

        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {allowed} (got {getattr(self, name)!r})")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        need(is_int(self.gen_length) and self.gen_length > 0, "gen_length", "must be a positive integer")
        need(is_int(self.block_length) and self.block_length > 0, "block_length", "must be a positive integer")
        need(
            self.gen_length % self.block_length == 0,
            "block_length",
            f"must divide gen_length={self.gen_length}",
        )
        if self.steps is not None:
            need(is_int(self.steps), "steps", "must be an integer or None")
            need(
                self.num_blocks <= self.steps <= self.gen_length,
                "steps",
                f"must be between the number of blocks ({self.num_blocks}) and gen_length ({self.gen_length})",
            )
        need(is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        need(self.remasking in REMASKING, "remasking", f"must be one of {', '.join(REMASKING)}")
        if self.threshold is not None:
            need(is_num(self.threshold) and 0 < self.threshold <= 1, "threshold", "must be in (0, 1] or None")
        if self.factor is not None:
            need(is_num(self.factor) and self.factor > 0, "factor", "must be > 0 or None")
        need(self.cache in CACHE_POLICIES, "cache", f"must be one of {', '.join(CACHE_POLICIES)}")
        need(self.alg is None or self.alg in DREAM_ALGS, "alg", f"must be None or one of {', '.join(DREAM_ALGS)}")
        if self.alg_temp is not None:
            need(is_num(self.alg_temp) and self.alg_temp >= 0, "alg_temp", "must be >= 0 or None")
        need(is_num(self.eps) and 0 < self.eps < 1, "eps", "must be in (0, 1)")
        if self.top_p is not None:
            need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1] or None")
        if self.top_k is not None:
            need(is_int(self.top_k) and self.top_k >= 1, "top_k", "must be a positive integer or None")
        need(isinstance(self.stop_at_eos, bool), "stop_at_eos", "must be true or false")
        if self.seed is not None:
            need(is_int(self.seed), "seed", "must be an integer or None")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


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

    @property
    def tokens_per_second(self) -> float:
        return sum(self.num_tokens) / self.wall_time if self.wall_time > 0 else 0.0


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
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected (batch, length), got shape {tuple(input_ids.shape)}")
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
        rows = [list(r) for r in input_ids]
        if not rows:
            raise ValueError("input_ids: empty batch")
        if isinstance(rows[0], int):  # a single prompt given as a flat list
            rows = [rows]
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
) -> Iterator[StepEvent]:
    """The one decoding loop, as a generator of events. `generate` runs it to the end."""
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

    policy = CACHE_POLICIES[config.cache](model)
    rule = selection_rule(config)
    generators = _generators(config, bsz, row_seeds, device) if needs_randomness(config) else None
    stop_ids = torch.tensor(sorted(set(model.stop_token_ids)), device=device)

    unmask_step = torch.full((bsz, gen_len), -1, dtype=torch.long, device=device)
    row_nfe = torch.zeros(bsz, dtype=torch.long, device=device)  # steps each row took part in
    step_log: list[tuple] = []  # (rows, tokens revealed per row, row had masks): lists built at the end
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
        seq = SequenceView(
            xa,
            positions if all_rows else positions[idx],
            key_mask if (all_rows or key_mask is None) else key_mask[idx],
        )
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
            # Rows whose block is already done draw no randomness: each row's stream must advance
            # exactly as when it is decoded alone, whatever the other rows still need.
            drawing = rows
            if generators is not None and not bool(has_mask.all()):
                drawing = [r if m else None for r, m in zip(rows, has_mask.tolist())]
            tokens, conf = propose(logits, config, generators, drawing)
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
            step_log.append((rows, chosen.sum(-1), has_mask))
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
    for rows_in_step, counts, live in step_log:
        for r, c, alive in zip(rows_in_step, counts.tolist(), live.tolist()):
            if alive:
                tokens_per_step[r].append(c)
    stats.update(nfe=nfe, row_nfe=row_nfe.tolist(), tokens_per_step=tokens_per_step, unmask_step=unmask_step,
                 forward_time=forward_time, finished=finished)
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
) -> GenerationOutput:
    """Generate `config.gen_length` tokens after each prompt.

    input_ids: a (B, P) tensor (left-padded, with `attention_mask`), or a list of token-id lists
    of any lengths (padded here). `row_seeds` gives each row its own random stream (else
    `config.seed` + row). Returns the generated ids and the statistics of the run.
    """
    config = config or GenerationConfig()
    stats: dict = {}
    t0 = time.perf_counter()
    last = None
    with torch.inference_mode():
        for event in iter_generate(model, input_ids, config, attention_mask, row_seeds, stats):
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
    )


def stream_blocks(
    model, input_ids, config: GenerationConfig | None = None, attention_mask=None, row_seeds=None
) -> Iterator[tuple[int, list[list[int]], list[bool]]]:
    """Yield (block index, per-row token ids of that block, per-row finished) as soon as each
    block is final: inside a block tokens settle out of order, so a block is the unit a server
    can stream. Rows that already finished get an empty list."""
    config = config or GenerationConfig()
    blk = config.block_length
    with torch.inference_mode():
        for event in iter_generate(model, input_ids, config, attention_mask, row_seeds):
            if event.kind != "block":
                continue
            b = event.block
            part = event.canvas[:, b * blk : (b + 1) * blk].tolist()
            yield b, [part[r] if r in event.rows else [] for r in range(len(part))], event.finished
