"""The log-probabilities that rows report (`GenerationConfig.logprobs`), kept per layout column while
they decode: the loop records each step's written tokens here and reads a row's block back when
the block becomes final."""

from __future__ import annotations

import torch

from ..config import LOGPROB_FLOOR
from .decode import Decision, token_logprobs


class LogprobColumns:
    """Per row of the loop's layout and per column: the log-probability of the token a forward wrote
    there (`values`, NaN: none did), and the most likely tokens there as (B, L, k) ids and
    log-probabilities (`top_ids`, `top_values`). A token that cannot be drawn there (filtered out by
    top_p, top_k or a grammar) has the floor `config.LOGPROB_FLOOR`, as vLLM reports it."""

    def __init__(self, values: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor):
        self.values, self.top_ids, self.top_values = values, top_ids, top_values

    @classmethod
    def laid_out(cls, old: LogprobColumns | None, rows, length: int, kept: list[tuple[int, int]], device):
        """The columns for a new layout of `rows` (`length` columns), where a row of it reports
        them; kept rows ((new index, old index) pairs) keep theirs. None where no row reports them."""
        asked = [r.config.logprobs for r in rows if r.config.logprobs is not None]
        if not asked:
            return None
        bsz, k = len(rows), max(asked)
        values = torch.full((bsz, length), float("nan"), device=device)
        top_ids = torch.zeros((bsz, length, k), dtype=torch.long, device=device)
        top_values = torch.full((bsz, length, k), float("nan"), device=device)
        if kept and old is not None:
            dst, src = (torch.tensor(t, device=device) for t in zip(*kept))
            width, old_k = min(length, old.values.shape[1]), min(k, old.top_values.shape[-1])
            values[dst, :width] = old.values[src, :width]
            top_ids[dst, :width, :old_k] = old.top_ids[src, :width, :old_k]
            top_values[dst, :width, :old_k] = old.top_values[src, :width, :old_k]
        return cls(values, top_ids, top_values)

    def record(self, logits: torch.Tensor, columns: torch.Tensor, decision: Decision, rows, at=None) -> None:
        """Where this step wrote a token (revealed, edited, or ahead in a later block), its
        log-probability and the most likely tokens in this forward (`decode.token_logprobs`);
        `columns` (B, W) the layout columns of the rows' windows; `at` (B,) the rows' places in
        the layout (None: every row, in order)."""
        tokens, written = decision.tokens, decision.chosen
        if decision.edited is not None:
            written = written | decision.edited
        if decision.ahead is not None:
            tokens = torch.cat([tokens, decision.ahead_tokens], 1)
            written = torch.cat([written, decision.ahead], 1)
        width = written.shape[1]
        lp = token_logprobs(logits[:, :width], [r.config for r in rows])
        for i, r in enumerate(rows):  # a grammar's rows: renormalised over what it allowed
            if r.constraint is None or r.config.logprobs_mode == "raw":
                continue
            for p, allowed in r.constraint.masks.items():
                kept = torch.where(allowed, lp[i, p], float("-inf"))
                lp[i, p] = kept - kept.logsumexp(-1)
        lp = lp.clamp_min(LOGPROB_FLOOR)  # what cannot be drawn (-inf) at the reported floor
        cols = columns[:, :width]
        at = torch.arange(len(rows), device=cols.device) if at is None else at
        where = (at[:, None], cols)
        chosen = lp.gather(-1, tokens[..., None]).squeeze(-1)
        self.values[where] = torch.where(written, chosen, self.values[where])
        k = self.top_values.shape[-1]
        if k:
            values, ids = lp.topk(k, -1)
            keep = written[..., None]
            self.top_values[where] = torch.where(keep, values, self.top_values[where])
            self.top_ids[where] = torch.where(keep, ids, self.top_ids[where])

    def window(self, i: int, columns: torch.Tensor, k: int) -> list:
        """Row i's window (its `columns`) as (log-probability, top `k` tokens) per column, None per
        column no forward wrote."""
        values = self.values[i, columns].tolist()
        ids, lps = self.top_ids[i, columns, :k].tolist(), self.top_values[i, columns, :k].tolist()
        return [None if v != v else (v, list(zip(d, p))) for v, d, p in zip(values, ids, lps)]
