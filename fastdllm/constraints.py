"""Constrained decoding: answers that a grammar accepts (JSON, a JSON schema, a regex, Lark).

A dLLM reveals many positions per step, anywhere in the block, but a grammar can only judge a token
whose left context is fixed. So while a row is constrained, the decoding loop asks its
`GrammarConstraint` to amend each step's choice (`amend`):

- the row's *frontier* (its first masked position: every token before it is already revealed and
  was fed to the grammar) is always revealed, with the most likely token the grammar allows there;
- the positions right after the frontier that the selection rule chose anyway (threshold, factor,
  schedule) are revealed too, as long as the grammar accepts them in order: the longest accepted
  run, so parallel decoding keeps working where the model is confident and right;
- a chosen position after a gap, or after a token the grammar rejects, waits (its left context
  is not fixed yet).

Every answer position is therefore revealed left to right with its left context known, each token
checked, and at least one token per step. Once the grammar is complete and takes nothing more but
the end, every remaining position is the model's stop token.

The grammar engine is llguidance (Microsoft's; the one vLLM and SGLang can use): it runs on the
CPU from a `tokenizers` JSON, computes a token mask per position in microseconds, and checks a
run of candidate tokens (`validate_tokens`) without consuming them, which is what checking
several parallel candidates at once needs. xgrammar and outlines-core would serve a left-to-right
mask too, but neither validates a run of tokens in one call.
"""

from __future__ import annotations

import functools
import json

import torch


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ValueError("constrained decoding needs llguidance (pip install llguidance)") from None
    return llguidance


# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): a model that likes newlines
# cannot fill the answer with them, which a grammar allowing any whitespace lets it do. A schema's
# own "x-guidance" options override this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=8)
def _grammar_tokenizer(tokenizer_json: str, eos: tuple[int, ...]):
    return _llguidance().LLTokenizer(tokenizer_json, eos_token=list(eos))


class GrammarConstraint:
    """One row's grammar and how far into its answer the grammar has read."""

    def __init__(self, grammar: str, tokenizer, stop_token_ids, *, what: str = "grammar"):
        ll = _llguidance()
        stops = tuple(int(t) for t in stop_token_ids)
        self.stop_id = stops[0]
        lt = _grammar_tokenizer(tokenizer.fast.to_str(), stops)
        self.matcher = ll.LLMatcher(lt, grammar)
        if self.matcher.is_error():
            raise ValueError(f"{what}: {self.matcher.get_error()}")
        self.grammar_vocab = lt.vocab_size
        self.consumed: list[int] = []

    @classmethod
    def json(cls, tokenizer, stop_token_ids, schema: dict | None = None, what: str = "response_format"):
        """Any JSON object (schema None: `json_object`), or JSON valid against `schema`."""
        ll = _llguidance()
        target = schema if schema is not None else {"type": "object"}
        try:
            grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(target), defaults=JSON_STYLE)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"{what}: the JSON schema cannot be compiled ({e})") from None
        return cls(grammar, tokenizer, stop_token_ids, what=what)

    @classmethod
    def regex(cls, tokenizer, stop_token_ids, pattern: str, what: str = "regex"):
        return cls(_llguidance().LLMatcher.grammar_from_regex(pattern), tokenizer, stop_token_ids, what=what)

    def allowed(self, vocab_size: int, device) -> torch.Tensor:
        """(vocab_size,) True where the grammar accepts the token at the frontier."""
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, bias.numel())
        allowed[:n] = bias[:n] > 0
        return allowed.to(device)

    def reset(self) -> None:
        """Back to the answer's start (the row is decoded again)."""
        self.matcher.reset()
        self.consumed = []

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    def amend(self, logits: torch.Tensor, tokens: torch.Tensor, chosen: torch.Tensor, masked: torch.Tensor) -> None:
        """Amend one row's step in place (see the module docstring). logits (T, V); tokens,
        chosen, masked (T,): the step's proposals, the rule's choice, the masked positions."""
        open_ = masked.nonzero().flatten().tolist()
        if not open_:
            return
        if self.finished:  # the answer is complete: the rest is the end
            tokens[masked] = self.stop_id
            chosen.copy_(masked)
            return
        f = open_[0]
        allowed = self.allowed(logits.shape[-1], logits.device)
        if not bool(allowed.any()):  # the grammar is in an error state: end the answer
            tokens[masked] = self.stop_id
            chosen.copy_(masked)
            return
        first = int(torch.where(allowed, logits[f].float(), float("-inf")).argmax())
        run, j = [first], f + 1
        picked = chosen.tolist()
        wanted = tokens.tolist()
        while j < len(picked) and picked[j] and bool(masked[j]):
            run.append(int(wanted[j]))
            j += 1
        accepted = max(1, self.matcher.validate_tokens(run))
        run = run[:accepted]
        if not self.matcher.consume_tokens(run):
            raise RuntimeError(f"grammar rejected tokens it validated: {self.matcher.get_error()}")
        self.consumed += run
        chosen.zero_()
        chosen[f : f + len(run)] = True
        tokens[f : f + len(run)] = torch.tensor(run, dtype=tokens.dtype, device=tokens.device)
        if self.finished:  # the grammar took its last token: what is left of the block ends
            rest = masked.clone()
            rest[: f + len(run)] = False
            tokens[rest] = self.stop_id
            chosen |= rest


def response_format_constraint(response_format: dict | None, tokenizer, stop_token_ids) -> GrammarConstraint | None:
    """The constraint of an OpenAI `response_format` ({"type": "text" | "json_object" |
    "json_schema", "json_schema": {"name", "schema", "strict"}}); None for plain text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError("response_format: must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarConstraint.json(tokenizer, stop_token_ids)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format: json_schema must be an object with a schema object")
        return GrammarConstraint.json(tokenizer, stop_token_ids, spec.get("schema") or {"type": "object"})
    raise ValueError(f"response_format: type must be text, json_object or json_schema (got {kind!r})")
