"""The rows the decoding loop runs (`Row`, built from a batch's prompts by `prepare_inputs`), what
one step returns (`Step`), and the keys that decide which rows may decode together (`join_key`)."""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig, is_int
from .registry import CACHE_POLICIES


@functools.lru_cache(maxsize=256)  # once per config: asked at every join
def join_key(config: GenerationConfig) -> tuple:
    """What must be equal for rows to decode in one batch: what the forwards depend on (cache
    policy, refresh rule, suffix window, ...). The fields declared per row
    (`GenerationConfig.row_fields`: the answer's length, block length, steps, threshold,
    temperature, stop rules, ...) may differ: each row decides with its own."""
    rows = set(GenerationConfig.row_fields())
    return tuple((f, getattr(config, f)) for f in GenerationConfig.field_names() if f not in rows)


def shares_forwards(model, batch: GenerationConfig, config: GenerationConfig) -> bool:
    """Whether rows of `config` may decode in one batch with rows of `batch`: equal in `join_key`,
    and in block length too unless the model and the cache policy take each row's own (a model
    whose attention does not depend on the decoding block, or whose decoder says how each window
    attends: `Transformer.mixes_block_lengths`; `CachePolicy.mixes_block_lengths`)."""
    if join_key(config) != join_key(batch):
        return False
    return config.block_length == batch.block_length or (
        model.mixes_block_lengths and CACHE_POLICIES[batch.cache].mixes_block_lengths
    )


def layout_columns(prompt_length: int, config: GenerationConfig) -> int:
    """The most columns a row of this prompt length and config takes in the loop's layout (and its
    cache): its prompt, region (one block more where a block-causal prompt ends inside a block)
    and suffix, and the columns a step reads past it."""
    suffix = len(config.suffix) if config.suffix is not None else 0  # text: about its length in tokens
    past = config.columns_past_answer
    return prompt_length + config.gen_length + past + suffix + config.block_length * (1 + config.parallel_blocks)


@functools.lru_cache(maxsize=256)
def decision_key(config: GenerationConfig) -> GenerationConfig:
    """The config but what the loop reads per row (its length and step schedule): rows equal in
    it decide with one strategy object."""
    return config.replace(gen_length=config.block_length, steps=None, fixed=(), suffix=None)


def infill(model, config: GenerationConfig, constraints, closing_tokens) -> tuple[tuple, torch.Tensor | None]:
    """A config's fixed tokens and suffix, checked against this model: token ids (text is
    encoded by the front ends, `text.infill.encode_infill`), not the mask token, and a suffix
    only where attention is bidirectional; then the tokens the decoder closes the answer with."""
    closing = torch.tensor(closing_tokens, dtype=torch.long, device=model.device) if closing_tokens else None
    if not config.fixed and config.suffix is None:
        return (), closing
    for name, value in [("fixed", v) for _, v in config.fixed] + [("suffix", config.suffix)]:
        if isinstance(value, str):
            raise ValueError(
                f"{name}: give token ids to generate(); text is encoded by generate_text, the CLI "
                "and the server (fastdllm.text.infill.encode_infill)"
            )
        if value is not None and any(not 0 <= t < model.args.vocab_size for t in value):
            raise ValueError(f"{name}: token ids must be in [0, {model.args.vocab_size})")
        if value is not None and model.mask_token_id in value:
            raise ValueError(f"{name}: holds the mask token (id {model.mask_token_id})")
    if config.suffix is not None and model.args.block_size:
        raise ValueError(
            f"suffix: this model's attention is block-causal (blocks of {model.args.block_size}): "
            "no block sees text after it, so an answer cannot lead into a suffix; fixed tokens work"
        )
    if constraints is not None and any(c is not None for c in constraints):
        raise ValueError("fixed: not with a grammar constraint, which reveals the answer left to right")
    fixed = tuple((p + k, t) for p, ids in config.fixed for k, t in enumerate(ids))
    suffix = None if config.suffix is None else torch.tensor(config.suffix, dtype=torch.long, device=model.device)
    if closing is not None:
        suffix = closing if suffix is None else torch.cat([suffix, closing])
    return fixed, suffix


def check_thinking_budget(model, config: GenerationConfig) -> None:
    """A thinking budget needs the model's end-of-thinking token."""
    if config.max_thinking_tokens is not None and getattr(model, "end_think_token_id", None) is None:
        raise ValueError("max_thinking_tokens: this model's tokenizer has no end-of-thinking token (</think>)")


def check_adapter(model, config: GenerationConfig) -> None:
    """The LoRA adapters a config names (`adapter`, `draft_adapter`) are ones the model has loaded,
    and not under a captured step."""
    for option in ("adapter", "draft_adapter"):
        name = getattr(config, option)
        if name is None:
            continue
        if config.cuda_graphs:
            raise ValueError(f"{option}: not with cuda_graphs (a captured step holds the base weights' graph)")
        if getattr(model, "lora", None) is None:
            raise ValueError(f"{option}: {name!r}: this model has no adapters loaded (--lora-modules)")
        if name not in model.lora.names:
            raise ValueError(f"{option}: {name!r} is not loaded (loaded: {', '.join(model.lora.names)})")


def constrain(rows: list[Row], constraints, config: GenerationConfig) -> None:
    """Give each row its grammar (`constraints`: per row, None or the grammar its answer follows)."""
    if constraints is None:
        return
    if len(constraints) != len(rows):
        raise ValueError(f"constraints: {len(constraints)} given for {len(rows)} rows")
    for r, c in zip(rows, constraints):
        if c is not None and r.lead:
            raise ValueError("constraints: a prompt ending inside a block-causal block is not supported yet")
        if c is not None:
            c.fit_within(config.gen_length)
            c.keeps_masks = config.logprobs is not None  # its log-probabilities after its mask
        r.constraint = c


def carried(values: torch.Tensor | None, sources: list[int | None], device) -> torch.Tensor:
    """Per-row counts for a new layout: a kept row's own (new row i is old row `sources[i]`), 0 for
    a row that joins."""
    out = torch.zeros((len(sources),), dtype=torch.long, device=device)
    kept = [(i, s) for i, s in enumerate(sources) if s is not None]
    if kept and values is not None:
        dst, src = (torch.tensor(t, device=device) for t in zip(*kept))
        out[dst] = values[src]
    return out


@dataclass(eq=False)
class Row:
    """One prompt being decoded, with what it cost (as decoded alone)."""

    prompt: torch.Tensor  # (P,) token ids before its decoding region
    config: GenerationConfig  # its own: the batch's but in the fields declared per row (`join_key`)
    generator: torch.Generator | None
    tag: object = None  # the caller's handle (the server's job)
    block: int = 0  # the block it decodes now (or next, once it left)
    step: int = 0  # the steps it took in that block
    # blocks before the current one that became final without a forward of their own since its
    # last block-start forward (multi-block decoding revealed them whole): a refresh recomputes them
    unrefreshed: int = 0
    reused: int = 0  # its prompt's leading columns whose K/V it had before its first forward
    prefilled: int = 0  # while it waits to join: its prompt's columns computed so far (chunked prefill)
    finished: bool = False  # stopped at a stop token
    answer: torch.Tensor | None = None  # (gen_length,) once it left the batch (EOS-filled after a stop)
    unmask_step: torch.Tensor | None = None  # (gen_length,) the row's step revealing each position
    nfe: int = 0  # forwards it took part in
    tokens_per_step: list[int] = field(default_factory=list)  # positions revealed (edits not counted)
    acceptances: list[int] = field(default_factory=list)  # per speculative verification, what it accepted
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
    strategy: object = None  # the unmasking strategy it decides with (`decode.UnmaskingStrategy`)
    # Infilling: tokens fixed at answer positions ((position, id) pairs), laid out before the first
    # step and never masked (their step is -1, as a prompt token's: no rule reveals or edits them),
    # and the suffix after the region, which every forward of a bidirectional model sees.
    fixed: tuple = ()
    suffix: torch.Tensor | None = None
    # what its strategy's signal makes its next forward's input at some columns (DMax's soft
    # embeddings, DiffusionGemma's self-conditioning): (columns, vectors)
    soft: tuple | None = None
    # its prompt's images: (columns, soft tokens) that replace those columns' token embeddings in
    # every forward that computes them (`place_images`)
    images: tuple | None = None
    # with `config.logprobs`, per block that became final: per answer position of it, (its token's
    # log-probability in the forward that wrote it, the most likely tokens there as (id,
    # log-probability) pairs), None where no forward chose the token (fixed, or padding after a stop)
    block_logprobs: dict = field(default_factory=dict)
    carry: object = None  # its strategy's state for its next step in this block (`Decision.carry`)
    # its prompt as host ids (read from the device once, when it was added: `of_prompt`), and as
    # the prefix store keys it (`prefix_tokens`, made on first use)
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    store_keys: list[int] | None = field(default=None, repr=False)

    @classmethod
    def of_prompt(cls, prompt, config: GenerationConfig, generator, tag, block_causal: bool, ids: list[int]) -> Row:
        """A row for `prompt` (`ids`: the same as host ids): with a
        block-causal model, a prompt that ends inside a block leads into one more block of region
        (`lead_tokens`); a config that reads past the answer (`columns_past_answer`) gets that
        region too."""
        blk = config.block_length
        lead = len(prompt) % blk if block_causal else 0
        if config.columns_past_answer:  # a region past the answer, which decoding reveals and reads
            region = config.replace(gen_length=config.gen_length + config.columns_past_answer, steps=None)
            return cls(prompt, region, generator, tag, asked=config.gen_length, prompt_ids=ids)
        if not lead:
            return cls(prompt, config, generator, tag, asked=config.gen_length, prompt_ids=ids)
        region = config.replace(
            gen_length=config.gen_length + blk,
            steps=None if config.steps is None else config.steps + config.steps // config.num_blocks,
        )
        return cls(
            prompt[:-lead],
            region,
            generator,
            tag,
            asked=config.gen_length,
            lead_tokens=prompt[-lead:],
            prompt_ids=ids[:-lead],
        )

    def prefill_chunk(self, causal_prompt: bool, cache_keeps_prompt: bool) -> int:
        """The positions of its prompt the row computes per step before it joins (0: none; it joins
        at once and its first forward computes its whole prompt). Only where a prompt block's K/V
        depend on nothing after it (a block-causal model) and its cache keeps them (not `NoCache`),
        not with an adapter (its prompt's K/V are its adapter's) nor images (an image's tokens may
        see each other both ways), and only for a prompt longer than its config's `prefill_chunk`
        (whole blocks)."""
        chunk, blk = self.config.prefill_chunk, self.config.block_length
        if chunk is None or not causal_prompt or not cache_keeps_prompt or self.config.adapter is not None:
            return 0
        if self.images is not None:
            return 0
        chunk = chunk // blk * blk
        return chunk if len(self.prompt) > chunk else 0

    @property
    def input_vectors(self) -> tuple | None:
        """What replaces some of its columns' input this step: its images' soft tokens and its
        strategy's signal, (columns, vectors) together."""
        if self.images is None or self.soft is None:
            return self.images if self.soft is None else self.soft
        cols, vectors = self.images
        return torch.cat([cols, self.soft[0]]), torch.cat([vectors, self.soft[1].to(vectors.dtype)])

    @property
    def prefix_tokens(self) -> list[int]:
        """Its prompt as the prefix store keys it (`prefix_tokens`)."""
        if self.store_keys is None:
            self.store_keys = prefix_tokens(self.prompt_ids, self.images)
        return self.store_keys

    @property
    def stop_block(self) -> int:
        """The first of its region's blocks whose stop tokens end the row: the block of its last
        fixed token (a stop token before it pads the fill; the fixed tokens stay)."""
        return max(((self.lead + p) // self.config.block_length for p, _ in self.fixed), default=0)

    @property
    def extent(self) -> int:
        """Its columns in the layout: prompt, region and suffix."""
        return len(self.prompt) + self.config.gen_length + (0 if self.suffix is None else len(self.suffix))

    @property
    def lead(self) -> int:
        return 0 if self.lead_tokens is None else len(self.lead_tokens)

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def block_length(self) -> int:
        return self.config.block_length

    @property
    def block_start(self) -> int:
        """Where its current block starts in the layout (its prompt fills the columns before its region)."""
        return len(self.prompt) + self.block * self.config.block_length

    @property
    def width(self) -> int:
        """The columns a step decodes from its current block on: the block, and with multi-block
        decoding the blocks after it (its decoder's `depth`)."""
        return self.config.block_length * self.strategy.depth

    @property
    def prompt_positions(self) -> int:
        """Its prompt's length less what the prefix store gave it: the work of one prefill (an
        autoregressive model's share of the prompt, with the same prefix cache)."""
        return len(self.prompt) + self.lead - self.reused

    def answer_span(self, block: int) -> tuple[int, int, int, int]:
        """Where block `block` of the region lies in the answer: (answer from, to, block from, to),
        clipped to the answer's `asked` positions."""
        blk = self.config.block_length
        lo, hi = block * blk - self.lead, (block + 1) * blk - self.lead
        a_lo, a_hi = max(0, lo), min(self.asked, hi)
        return a_lo, max(a_lo, a_hi), a_lo - lo, max(a_lo, a_hi) - lo

    @property
    def answered(self) -> bool:
        """Whether the blocks before its current one hold its whole answer (its region may run
        past it: `lead_tokens`, `GenerationConfig.columns_past_answer`)."""
        return self.block * self.config.block_length >= self.lead + self.asked

    @property
    def done(self) -> bool:
        return self.answer is not None


@dataclass
class Step:
    """What one step did: the rows that took part (all of the batch), each one's block at the
    step, the block's tokens after it (B, T: a row's in its first `block_length` columns, T the
    longest block's), and what it revealed (`chosen`) and rewrote (`edited`, None without editing)
    there."""

    rows: list[Row]
    blocks: list[int]
    tokens: torch.Tensor
    chosen: torch.Tensor
    edited: torch.Tensor | None = None


def prefix_tokens(ids: list[int], images: tuple | None) -> list[int]:
    """A prompt as the prefix store keys it: its tokens, each image's columns replaced by keys of
    the image's soft tokens (negative: no token's), so that prompts share K/V only where their
    images are the same."""
    if images is None:
        return ids
    out = list(ids)
    columns, vectors = images
    for c, v in zip(columns.tolist(), vectors.detach().float().cpu().numpy()):  # one copy to the host
        out[c] = -1 - int.from_bytes(hashlib.blake2b(v.tobytes(), digest_size=7).digest(), "little")
    return out


def place_images(model, input_ids, attention_mask, images) -> tuple[list[list[int]], list]:
    """Each prompt's images placed (`Transformer.place_images`): per row its ids and (columns, soft
    tokens), or None for a row without images. `images`: per row a list of images (`PIL.Image`,
    path, bytes or data URL)."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        rows = [r[m].tolist() for r, m in zip(ids, mask)]
    else:
        rows = list(input_ids)
        rows = [list(r) for r in rows] if rows and isinstance(rows[0], (list, tuple)) else [rows]
    if len(images) != len(rows):
        raise ValueError(f"images: one list of images per prompt ({len(rows)}), got {len(images)}")
    placed = [model.place_images(r, list(imgs or ())) for r, imgs in zip(rows, images)]
    return [p for p, _ in placed], [e for _, e in placed]


def prompts_of(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[torch.Tensor, list[int]]]:
    """Each row's prompt from a padded batch (`prepare_inputs`): its tokens where `mask` is set, as
    a tensor (a view of `ids` where they are one run, as padding on one side leaves them) and as
    host ids, read from the device once for the batch."""
    host, flags = ids.tolist(), mask.tolist()
    out = []
    for i, (row, kept) in enumerate(zip(host, flags)):
        cols = [j for j, m in enumerate(kept) if m]
        run = cols[-1] - cols[0] + 1 == len(cols)
        out.append((ids[i, cols[0] : cols[-1] + 1] if run else ids[i][mask[i]], [row[j] for j in cols]))
    return out


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
    family = getattr(model, "family", None)
    masked = family is None or not family.rules.noise_canvas  # with no mask token, any token may be in a prompt
    if masked and ((ids == model.mask_token_id) & mask).any():
        raise ValueError(f"input_ids: a prompt contains the mask token (id {model.mask_token_id})")
    suffix = 0 if config.suffix is None else len(config.suffix)
    suffix += int(family is not None and family.rules.closing_token is not None) + config.columns_past_answer
    if ids.shape[1] + config.gen_length + suffix > model.args.max_seq_len:
        raise ValueError(
            f"gen_length: prompt ({ids.shape[1]} tokens) + gen_length ({config.gen_length})"
            + (f" + suffix ({suffix})" if suffix else "")
            + f" exceeds the model's max_sequence_length ({model.args.max_seq_len})"
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
