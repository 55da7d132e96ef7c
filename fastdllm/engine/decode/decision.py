"""What a decoder returns for a step (`Decision`, with the `Signal` that conditions the next forward:
DMax's `SoftTokens`, DiffusionGemma's `SelfConditioning`) and the log-probabilities rows report
(`token_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

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


class Signal:
    """What conditions a row's next forward, as its model turns it into input vectors
    (`soft_input`): per row, what the model reads (`payload`) and which of the block's columns it
    replaces (`keep`, None: all of them)."""

    def payload(self, i: int):
        raise NotImplementedError

    def payloads(self):
        """Every row's payload at once (the model reads a batch of them as one)."""
        raise NotImplementedError

    def keep(self, i: int) -> torch.Tensor | None:
        return None

    @classmethod
    def merged(cls, parts: list, rows: int) -> Signal:
        """One signal for the batch from the groups' ((row indices, signal), ...)."""
        first = parts[0][1]
        names = [f.name for f in fields(first)]
        out = cls(*(getattr(first, n).new_empty((rows, *getattr(first, n).shape[1:])) for n in names))
        for idx, sig in parts:
            for n in names:
                getattr(out, n)[idx] = getattr(sig, n)
        return out


@dataclass
class SoftTokens(Signal):
    """DMax's signal for a row's next forward: per position its most probable token and that
    token's probability, and which positions enter the forward as their soft embeddings (`kept`:
    those revealed in the block; the model mixes them, `Transformer.soft_input`)."""

    top_token: torch.Tensor
    top_prob: torch.Tensor
    kept: torch.Tensor

    def payload(self, i: int) -> SoftTokens:
        return SoftTokens(self.top_token[i], self.top_prob[i], self.kept[i])

    def payloads(self) -> SoftTokens:
        return self

    def keep(self, i: int) -> torch.Tensor:
        return self.kept[i]


@dataclass
class SelfConditioning(Signal):
    """DiffusionGemma's signal: the step's processed logits (B, T, V), which the model softmaxes
    into every column of the canvas's next forward (`DiffusionGemma.soft_input`)."""

    logits: torch.Tensor

    def payload(self, i: int) -> torch.Tensor:
        return self.logits[i]

    def payloads(self) -> torch.Tensor:
        return self.logits


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
    # (B,) whether each row's block is done, where the decoder decides it (editing, a canvas with
    # no mask); None: once it has no mask left
    block_done: torch.Tensor | None = None
    # what conditions each row's next forward; None: nothing
    signal: Signal | None = None
    # per row, the decoder's state for the row's next step in this block (`Row.carry`)
    carry: list | None = None
    # (B, W) positions of the window that become EOS with no step revealing them: a decoder's
    # early stop (everything after a stop is EOS)
    fill: torch.Tensor | None = None
    # (B, W) revealed positions of the window that return to [MASK] (a speculative draft's
    # rejected tail)
    remasked: torch.Tensor | None = None
    # (B,) how many of the blocks after the current one are final after this step, where the
    # decoder decides it (multi-block decoding); None, or -1 for a row: every block after it
    # revealed whole
    final_later: torch.Tensor | None = None
    # (B,) the positions each row's speculative verification accepted at this step (its acceptance
    # length: the drafts it kept and its own next token); None, or -1 for a row: no verification
    accepted: torch.Tensor | None = None

    def revealed_counts(self) -> torch.Tensor:
        """(B,) how many positions each row revealed, less those it masked again (edits not
        counted)."""
        n = self.chosen.sum(-1)
        n = n if self.ahead is None else n + self.ahead.sum(-1)
        return n if self.remasked is None else n - self.remasked.sum(-1)

    def applied(self, window: torch.Tensor, steps_of: torch.Tensor, step: torch.Tensor, eos_id: int, mask_id=None):
        """The rows' window (B, W: the current block, and with multi-block decoding the blocks after
        it) and the step that revealed each position of it (`steps_of`, -1: none), after this
        decision: edits and reveals written (a position revealed now at the row's `step`, (B,)),
        the later blocks' reveals, the positions masked again (`mask_id`), and the early stop's EOS
        (revealed by no step)."""
        blk = self.tokens.shape[1]
        tokens, steps = window[:, :blk], steps_of[:, :blk]
        if self.edited is not None:
            tokens = torch.where(self.edited, self.tokens, tokens)
        tokens = torch.where(self.chosen, self.tokens, tokens)
        steps = torch.where(self.chosen, step[:, None], steps)
        if self.ahead is not None:
            tokens = torch.cat([tokens, torch.where(self.ahead, self.ahead_tokens, window[:, blk:])], 1)
            steps = torch.cat([steps, torch.where(self.ahead, step[:, None], steps_of[:, blk:])], 1)
        if self.remasked is not None:
            tokens = torch.where(self.remasked, mask_id, tokens)
            steps = torch.where(self.remasked, -1, steps)
        if self.fill is not None:
            tokens = torch.where(self.fill, eos_id, tokens)
        return tokens, steps

    def blocks_over(self, block: torch.Tensor, mask_id: int) -> torch.Tensor:
        """(B,) whether each row's block is over after this step, for its block (B, T) as written:
        where the decoder decides it, its say; else once the block has no mask left."""
        return self.block_done if self.block_done is not None else ~(block == mask_id).any(-1)

    @classmethod
    def merged(cls, parts: list, rows: int) -> Decision:
        """One decision for `rows` rows from groups of rows that decided apart: ((row indices,
        decision), ...), each group's rows put back in their places."""
        out = {}
        for f in fields(cls):
            given = [getattr(d, f.name) for _, d in parts if getattr(d, f.name) is not None]
            if f.name == "carry" or not given:
                out[f.name] = None
            elif f.name == "signal":
                out[f.name] = type(given[0]).merged([(idx, d.signal) for idx, d in parts], rows)
            else:
                # a mask one group leaves out (no edits, no early stop) is False for its rows, a
                # count of final blocks -1 (the loop's own rule)
                merged = given[0].new_zeros((rows, *given[0].shape[1:]))
                if f.name in ("final_later", "accepted"):
                    merged.fill_(-1)
                for idx, d in parts:
                    value = getattr(d, f.name)
                    if value is None and given[0].dtype != torch.bool and f.name not in ("final_later", "accepted"):
                        raise ValueError(f"{f.name}: decided by some rows' decoders and not by others'")
                    if value is not None:
                        merged[idx] = value
                out[f.name] = merged
        if any(d.carry is not None for _, d in parts):
            out["carry"] = [None] * rows
            for idx, d in parts:
                for j, i in enumerate(idx.tolist()):
                    out["carry"][i] = None if d.carry is None else d.carry[j]
        return cls(**out)
