"""d3LLM's delayed KV cache, for decoding several blocks at once."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv.rows import Window
from ..registry import CACHE_POLICIES
from .base import CachePolicy, SequenceView


@CACHE_POLICIES.register
class DelayedCache(CachePolicy):
    """d3LLM's delayed KV cache (`generate_multi_block_kv_cache`), for decoding over several blocks
    at once: a row's cache holds its committed prefix, the prompt and the blocks finished
    `cache_delay` forwards ago, in order. A forward recomputes from the end of that prefix to the end
    of the row against it, except while a finished block waits to be committed (its tokens final,
    their K/V still settling as later blocks change): then every forward is full, and so is every
    `refresh_interval`-th. The forward in which a waiting block's delay is over computes its K/V
    against the committed prefix and commits them.

    Per row, as d3LLM's loop per sequence: the blocks are walked in order from the committed end;
    a finished block's wait starts at the first forward that reaches it in that walk (the prompt's
    at forward 0). The walk stops at the first unfinished block, and in its LLaDA code also at the
    first block still waiting (the family's `d3llm_code`). Its Dream code reads the logit of a
    cached forward's first column from that column's own output (`Transformer.packed_logits`).

    *Deliberate difference*: we attend each position once. d3LLM's refresh keeps the K/V up to the
    last waiting block's start while its committed prefix ends at the first's; where two blocks wait
    at once (its Dream code) its next cached forward attends the columns between them twice."""

    name = "delayed"
    refreshes_at_block_start = False

    def __init__(self, model, delay: int = 2, refresh_interval: int | None = None):
        super().__init__(model)
        self.delay, self.refresh_interval = delay, refresh_interval
        self.row_states: list[_DelayedRow] = []
        family = getattr(model, "family", None)
        self.dream_code = family is not None and family.rules.d3llm_code == "dream"

    @classmethod
    def from_config(cls, model, config) -> DelayedCache:
        return cls(model, config.cache_delay, config.refresh_interval)

    def relayout(self, sources):
        old = self.row_states
        self.row_states = [old[j] if j is not None and j < len(old) else _DelayedRow() for j in sources]

    def windows(self, seq, steps):
        bsz = seq.x.shape[0]
        self.row_states += [_DelayedRow() for _ in range(bsz - len(self.row_states))]
        masked = (seq.x == self.model.mask_token_id).tolist()
        return [self._window(seq, i, masked[i]) for i in range(bsz)]

    def _window(self, seq: SequenceView, i: int, masked: list[bool]) -> Window:
        row, shift = self.row_states[i], int(self.model.args.shifted_logits)
        row.forwards += 1
        length, end = seq.block_lengths[i], seq.seen[i]
        prompt = seq.starts[i] - seq.blocks[i] * length
        bounds = [(0, prompt)] + [(lo, min(lo + length, end)) for lo in range(prompt, end, length)]
        commit, waiting = None, False
        for k, (lo, hi) in enumerate(bounds):
            if hi <= row.committed:
                continue
            if any(masked[lo:hi]):
                break
            if row.forwards - row.finished.setdefault(k, row.forwards if k else 0) < self.delay:
                waiting = True
                if self.dream_code:
                    continue
                break
            commit = hi
        lo = row.committed if self.dream_code else min(row.committed, seq.starts[i] - shift)
        partial = (i, max(0, lo), seq.end(i), seq.seen[i], seq.starts[i])
        if commit is not None:
            row.committed = commit
            return partial if lo > 0 else self.full_window(seq, i)
        periodic = self.refresh_interval is not None and row.forwards % self.refresh_interval == 0
        if row.committed and not waiting and not periodic:
            return partial
        return self.full_window(seq, i)


@dataclass
class _DelayedRow:
    """A row's state under `DelayedCache`: its forwards, the end of its committed prefix (0: nothing
    committed yet), and when each finished block's wait began (block 0: the prompt)."""

    forwards: int = 0
    committed: int = 0
    finished: dict = field(default_factory=dict)
