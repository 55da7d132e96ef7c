"""Turning generated ids into text: stop at the first stop token, cut at stop strings.

Shared by the CLI, the server and the evaluation harness, so that "generated tokens" means the
same thing everywhere: tokens up to (not including) the first stop token or stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Completion:
    text: str
    num_tokens: int  # generated tokens that the text accounts for
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    # whether the text also holds the start of the next token (a stop string that begins inside it)
    partial: bool = False


def first_stop_index(ids: Sequence[int], stop_token_ids: Sequence[int], start: int = 0) -> int | None:
    stops = set(stop_token_ids)
    for i, t in enumerate(ids):
        if t in stops and i >= start:
            return i
    return None


def complete(
    tokenizer, ids, stop_token_ids: Sequence[int], stop: Sequence[str] | None = None, fixed_end: int = 0
) -> Completion:
    """Decode generated ids up to the first stop token, then cut at the earliest stop string.
    `fixed_end` (`GenerationConfig.fixed_end`): with tokens fixed up to there, the stop tokens
    before it are the fill's padding: dropped, and the answer ends at the first stop after it."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    end = first_stop_index(ids, stop_token_ids, fixed_end)
    if fixed_end:
        stops = set(stop_token_ids)
        kept = [t for t in ids[: len(ids) if end is None else end] if t not in stops]
        ids, end = kept + ([] if end is None else ids[end:]), None if end is None else len(kept)
    reason = "stop" if end is not None else "length"
    ids = ids[: len(ids) if end is None else end]
    text = tokenizer.decode(ids)
    cut = min((text.find(s) for s in (stop or []) if s and s in text), default=-1)
    if cut < 0:
        return Completion(text, len(ids), reason)
    # Count the tokens whose text lies before the cut: decode growing prefixes (answers are short).
    n = 0
    while n < len(ids) and len(tokenizer.decode(ids[: n + 1])) <= cut:
        n += 1
    return Completion(text[:cut], n, "stop", partial=len(tokenizer.decode(ids[:n])) < cut)
