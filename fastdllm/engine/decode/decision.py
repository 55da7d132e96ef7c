"""What a strategy returns for a step (`Decision`, DMax's `SoftTokens`) and the log-probabilities
rows report (`token_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import filter_top_p_top_k


def token_logprobs(logits: torch.Tensor, configs) -> torch.Tensor:
    """(B, T, V) float32 log-probabilities a row's sampling draws from, for logits (B, T, V) and
    each row's config: at temperature > 0 of softmax(logits / temperature) after its top-k / top-p
    filtering (a filtered token: -inf), at temperature 0 of the logits as they are (as vLLM reports
    processed log-probabilities); with `logprobs_mode="raw"`, the logits' own log-softmax."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        raw = c.logprobs_mode == "raw"
        groups.setdefault((0.0, None, None) if raw else (c.temperature, c.top_p, c.top_k), []).append(i)
    for (temperature, top_p, top_k), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        part = logits.index_select(0, idx).float()
        if temperature > 0:
            part = filter_top_p_top_k(part / temperature, top_p, top_k)
        out[idx] = part.log_softmax(-1)
    return out


@dataclass
class SoftTokens:
    """DMax's signal for a row's next forward: per position its most probable token and that
    token's probability, and which positions enter the forward as their soft embeddings (`keep`:
    those revealed in the block; the model mixes them, `Transformer.soft_input`)."""

    top_token: torch.Tensor
    top_prob: torch.Tensor
    keep: torch.Tensor

    def __getitem__(self, i) -> SoftTokens:
        return SoftTokens(self.top_token[i], self.top_prob[i], self.keep[i])

    @staticmethod
    def merged(parts: list, rows: int) -> SoftTokens:
        """One signal for the batch from the groups' ((row indices, signal), ...)."""
        first = parts[0][1]
        out = SoftTokens(*(t.new_empty((rows, *t.shape[1:])) for t in (first.top_token, first.top_prob, first.keep)))
        for idx, sig in parts:
            out.top_token[idx], out.top_prob[idx], out.keep[idx] = sig.top_token, sig.top_prob, sig.keep
        return out


@dataclass
class Decision:
    """What one step decides for every row: the tokens proposed for its current block, which of
    its masked positions they reveal (`chosen`), which revealed ones they rewrite (`edited`, None
    without editing), and for the blocks after the current one (multi-block decoding) their
    proposals and what they reveal (`ahead_tokens`, `ahead`; None with one block at a time)."""

    tokens: torch.Tensor
    chosen: torch.Tensor
    edited: torch.Tensor | None = None
    ahead_tokens: torch.Tensor | None = None
    ahead: torch.Tensor | None = None
    # each position's most probable token and its probability (DMax's stop rule and soft embeddings)
    top_token: torch.Tensor | None = None
    top_prob: torch.Tensor | None = None
    # (B,) whether each row's block is done, where the strategy decides it (a canvas with no mask)
    block_done: torch.Tensor | None = None
    # what conditions each row's next forward, as its model turns it into input vectors
    # (`soft_input`): DiffusionGemma's (B, T, V) logits (self-conditioning), DMax's `SoftTokens`;
    # None: nothing
    signal: torch.Tensor | SoftTokens | None = None
    # per row, the strategy's state for the row's next step in this block (`Row.carry`)
    carry: list | None = None

    def revealed_counts(self) -> torch.Tensor:
        """(B,) how many positions each row revealed (edits not counted)."""
        n = self.chosen.sum(-1)
        return n if self.ahead is None else n + self.ahead.sum(-1)
