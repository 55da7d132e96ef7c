"""Incremental text decoding of streamed blocks: what is final is sent, what a later token
or a stop string could still change is held back.
"""

from __future__ import annotations

import logging

from ..text.completion import complete, first_stop_index

log = logging.getLogger("fastdllm.server")


# ---- incremental decoding -----------------------------------------------------------------------
class ChoiceText:
    """The text of one choice, fed block by block.

    `feed` returns the new text that is safe to send: text that no later token can change. Held
    back: a trailing replacement character (an incomplete UTF-8 sequence), and the longest tail that
    could be the start of a stop string. Once final (stop token, stop string, max_tokens reached or
    the last block), the text equals `complete()` of the whole output cut to max_tokens."""

    def __init__(self, tokenizer, stop_token_ids, stop: list[str], max_tokens: int, fixed_end: int = 0):
        self.tokenizer, self.stop_token_ids, self.stop = tokenizer, stop_token_ids, stop
        self.max_tokens = max_tokens
        self.fixed_end = fixed_end  # infilling: stop tokens before it pad the fill (`complete`)
        self.ids: list[int] = []
        # with log-probabilities: per token of `ids`, (log-probability, top tokens) or None
        self.logprobs: list = []
        self._counted = 0  # leading tokens whose text is all in `sent`
        self.sent = ""
        self.final = False
        self.text = ""
        self.num_tokens = 0
        self.partial = False  # the final text ends inside its next token (a stop string began there)
        self.finish_reason: str | None = None

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, block_ids: list[int], engine_finished: bool = False, last: bool = False, logprobs=None) -> str:
        if self.final:
            return ""
        self.ids.extend(block_ids)
        self.logprobs.extend(logprobs or ())
        ids = self.ids[: self.max_tokens]
        end = first_stop_index(ids, self.stop_token_ids, self.fixed_end)
        end = len(ids) if end is None else end
        text = self.tokenizer.decode(ids[:end])
        found = [text.find(s) for s in self.stop if s in text]
        cut = min(found) if found else -1
        held_from = len(text) - self._held_tail(text)  # a stop string could still start here
        final = (
            end < len(ids)
            or engine_finished
            or last
            or len(self.ids) >= self.max_tokens
            or (cut >= 0 and cut <= held_from)
        )
        if final:
            c = complete(self.tokenizer, ids, self.stop_token_ids, self.stop, self.fixed_end)
            self.final, self.text, self.num_tokens, self.finish_reason = True, c.text, c.num_tokens, c.finish_reason
            self.partial = c.partial
            safe = c.text
        else:
            safe = text[:held_from].rstrip("\ufffd")
        if not safe.startswith(self.sent):  # cannot happen with prefix-stable decoding; never resend
            log.warning("decoded text is not an extension of the streamed text")
            return ""
        delta = safe[len(self.sent) :]
        self.sent = safe
        return delta

    def tokens_sent(self) -> int:
        """How many leading tokens the text sent so far holds whole (all of the answer's once
        final, and the one it ends inside): those whose log-probabilities may be sent with it."""
        if self.final:
            return self.num_tokens + self.partial
        n = self._counted
        while n < len(self.ids) and len(self.tokenizer.decode(self.ids[: n + 1])) <= len(self.sent):
            n += 1
        self._counted = n
        return n
