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

A dLLM knows how many positions its answer has, so the grammar is also made to finish in them (the
row's `budget`: the answer's length, or a request's `max_tokens`): a run is revealed only as far
as the grammar can still be completed, stop token included, in the positions left after it; where
not even the frontier's token leaves room, the frontier gets the first token of the shortest
completion found instead. So an unbounded integer or string ends, closed, before the budget runs
out, where a left-to-right engine would cut the answer mid-value. The completion is searched
greedily (forced tokens, then closing bytes first: `}` `]` `"`, then separators, then the smallest
literals; of those, the first that moves the grammar on, so that a `}` inside a string is not
taken for the object's end) and respelt in the tokenizer's own tokens: an upper bound of the
shortest, found in a few steps for JSON; where none is found the run is left as it was.

The grammar engine is llguidance (Microsoft's; the one vLLM and SGLang can use): it runs on the
CPU from a `tokenizers` JSON, computes a token mask per position in microseconds, checks a run of
candidate tokens (`validate_tokens`) without consuming them, which is what checking several
parallel candidates at once needs, and copies a matcher's state (`deep_copy`), which the
completion search needs. xgrammar and outlines-core would serve a left-to-right mask too, but
neither validates a run of tokens in one call.
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


# The completion search's preference among single-byte tokens: what closes a string or a container
# first, then what moves on to the next required member (never a digit, which would grow a number
# for ever), then the shortest literals.
CLOSING_BYTES = (b"}", b"]", b'"', b",", b":", b"0", b"1", b"n", b"f", b"t")
# The longest completion searched for (tokens); none longer is looked for.
CLOSING_LIMIT = 256
# Where the model's choice leaves no room to finish: how many of its next most likely allowed
# tokens are tried before the completion's own.
RANKED_ALTERNATIVES = 16


@functools.lru_cache(maxsize=8)
def _byte_tokens(lt) -> tuple[list[int], list[int]]:
    """The grammar tokenizer's single-byte tokens: those of CLOSING_BYTES in that order, and all."""
    single = {}
    for i in range(lt.vocab_size):
        b = lt.decode_bytes([i])
        if len(b) == 1 and not lt.is_special_token(i):
            single.setdefault(b, i)
    return [single[b] for b in CLOSING_BYTES if b in single], sorted(single.values())


def _allowed(matcher, vocab_size: int) -> torch.Tensor:
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    n = min(vocab_size, bias.numel())
    allowed[:n] = bias[:n] > 0
    return allowed


class GrammarConstraint:
    """One row's grammar and how far into its answer the grammar has read."""

    def __init__(self, grammar: str, tokenizer, stop_token_ids, *, what: str = "grammar", budget: int | None = None):
        ll = _llguidance()
        stops = tuple(int(t) for t in stop_token_ids)
        self.stop_id = stops[0]
        self.tokenizer = _grammar_tokenizer(tokenizer.fast.to_str(), stops)
        self.matcher = ll.LLMatcher(self.tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(f"{what}: {self.matcher.get_error()}")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget: must be a positive number of tokens (got {budget!r})")
        self.grammar, self.what, self.asked_budget = grammar, what, budget
        self.budget = budget  # answer tokens the grammar must finish in, its stop token included
        self.consumed: list[int] = []
        # With `keeps_masks` (a row reporting log-probabilities), the last `amend`'s grammar mask at
        # each position it wrote: {block position: (V,) True where the grammar allowed a token}
        self.keeps_masks = False
        self.masks: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        """Back to the answer's start (a batch that failed decodes the row again)."""
        self.matcher = _llguidance().LLMatcher(self.tokenizer, self.grammar)
        self.budget, self.consumed = self.asked_budget, []

    def spec(self) -> tuple:
        """What rebuilds this constraint, as it was made, elsewhere (another rank): `from_spec`."""
        return (self.grammar, self.what, self.asked_budget)

    @classmethod
    def from_spec(cls, spec: tuple, tokenizer, stop_token_ids) -> GrammarConstraint:
        grammar, what, budget = spec
        return cls(grammar, tokenizer, stop_token_ids, what=what, budget=budget)

    def fit_within(self, positions: int) -> None:
        """The answer has `positions` positions: the grammar finishes in them (and in the budget)."""
        self.budget = positions if self.budget is None else min(self.budget, positions)

    @classmethod
    def json(
        cls,
        tokenizer,
        stop_token_ids,
        schema: dict | None = None,
        what: str = "response_format",
        budget: int | None = None,
    ):
        """Any JSON object (schema None: `json_object`), or JSON valid against `schema`."""
        ll = _llguidance()
        target = schema if schema is not None else {"type": "object"}
        try:
            grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(target), defaults=JSON_STYLE)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"{what}: the JSON schema cannot be compiled ({e})") from None
        return cls(grammar, tokenizer, stop_token_ids, what=what, budget=budget)

    @classmethod
    def regex(cls, tokenizer, stop_token_ids, pattern: str, what: str = "regex", budget: int | None = None):
        return cls(
            _llguidance().LLMatcher.grammar_from_regex(pattern), tokenizer, stop_token_ids, what=what, budget=budget
        )

    def allowed(self, vocab_size: int, device) -> torch.Tensor:
        """(vocab_size,) True where the grammar accepts the token at the frontier."""
        return _allowed(self.matcher, vocab_size).to(device)

    def completion(self, matcher=None) -> list[int] | None:
        """A short run of tokens that completes the grammar from `matcher`'s state (default: the
        row's), its stop token last; None where the search finds none (see the module docstring)."""
        start = matcher or self.matcher
        m = start.deep_copy()
        closers, single = _byte_tokens(self.tokenizer)
        path: list[int] = []
        while len(path) <= CLOSING_LIMIT:
            if m.is_stopped() or m.is_accepting():  # the answer ends here: a stop token follows
                return self._respelt(start, path) + [self.stop_id]
            forced = m.compute_ff_tokens()
            if forced:
                if not m.consume_tokens(forced):
                    return None
                path += forced
                continue
            allowed = _allowed(m, self.tokenizer.vocab_size)
            candidates = [t for t in closers if allowed[t]]
            # a closer that is only content here (a `}` inside a string) leaves the state as it
            # was: the first one that moves the grammar on is taken
            pick = next((t for t in candidates if self._moves(m, t, allowed)), candidates[0] if candidates else None)
            if pick is None:
                pick = next((t for t in single if allowed[t]), None)
            if pick is None:
                anything = allowed.nonzero().flatten()
                if not len(anything):
                    return None
                pick = int(anything[0])
            if not m.consume_token(pick):
                return None
            path.append(pick)
        return None

    def _moves(self, matcher, token: int, allowed: torch.Tensor) -> bool:
        """Whether `token` changes what the grammar allows next (it ends or starts something)."""
        m = matcher.deep_copy()
        if not m.consume_token(token):
            return False
        return m.is_stopped() or m.is_accepting() or not torch.equal(_allowed(m, self.tokenizer.vocab_size), allowed)

    def _respelt(self, matcher, run: list[int]) -> list[int]:
        """`run`'s bytes in the tokenizer's own (longer) tokens where that is shorter and the
        grammar takes it from `matcher`'s state; else `run`."""
        text = self.tokenizer.decode_bytes(run)
        respelt = self.tokenizer.tokenize_bytes(text) if text else []
        if len(respelt) < len(run) and matcher.validate_tokens(respelt) == len(respelt):
            return respelt
        return run

    def _within_budget(self, run: list[int], ranked) -> list[int]:
        """The longest prefix of `run` (validated) after which the grammar can still finish in the
        positions left; else the best of `ranked` (the frontier's allowed tokens, most likely first)
        that leaves room; else the first token of a completion; else `run` as it is."""
        left = self.budget - len(self.consumed)

        def fits(tokens: list[int]) -> bool:
            m = self.matcher.deep_copy()
            if not m.consume_tokens(tokens):
                return False
            rest = self.completion(m)
            return rest is not None and len(tokens) + len(rest) <= left

        for n in range(len(run), 0, -1):
            if fits(run[:n]):
                return run[:n]
        for token in ranked():
            if token != run[0] and fits([token]):
                return [token]
        rest = self.completion()
        return rest[:1] if rest else run

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    def amend(self, logits: torch.Tensor, tokens: torch.Tensor, chosen: torch.Tensor, masked: torch.Tensor) -> None:
        """Amend one row's step in place (see the module docstring). logits (T, V); tokens,
        chosen, masked (T,): the step's proposals, the rule's choice, the masked positions."""
        self.masks = {}
        open_ = masked.nonzero().flatten().tolist()
        if not open_:
            return
        if self.finished:  # the answer is complete: the rest is the end
            self._ended(tokens, chosen, masked, masked, logits.shape[-1])
            return
        f = open_[0]
        allowed = self.allowed(logits.shape[-1], logits.device)
        if not bool(allowed.any()):  # the grammar is in an error state: end the answer
            self._ended(tokens, chosen, masked, masked, logits.shape[-1])
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
        if self.budget is not None:

            def ranked() -> list[int]:
                scores = torch.where(allowed, logits[f].float(), float("-inf"))
                return scores.topk(min(RANKED_ALTERNATIVES, int(allowed.sum()))).indices.tolist()

            run = self._within_budget(run, ranked)
        for k, t in enumerate(run if self.keeps_masks else ()):  # each token's mask, as it is consumed
            self.masks[f + k] = allowed if k == 0 else self.allowed(logits.shape[-1], logits.device)
            if not self.matcher.consume_tokens([t]):
                raise RuntimeError(f"grammar rejected tokens it validated: {self.matcher.get_error()}")
        if not self.keeps_masks and not self.matcher.consume_tokens(run):
            raise RuntimeError(f"grammar rejected tokens it validated: {self.matcher.get_error()}")
        self.consumed += run
        chosen.zero_()
        chosen[f : f + len(run)] = True
        tokens[f : f + len(run)] = torch.tensor(run, dtype=tokens.dtype, device=tokens.device)
        if self.finished:  # the grammar took its last token: what is left of the block ends
            rest = masked.clone()
            rest[: f + len(run)] = False
            self._ended(tokens, chosen, masked, rest, logits.shape[-1])

    def _ended(self, tokens, chosen, masked, rest, vocab: int) -> None:
        """The positions `rest` become the stop token, the only token the grammar allows there."""
        tokens[rest] = self.stop_id
        if rest is masked:
            chosen.copy_(masked)
        else:
            chosen |= rest
        if self.keeps_masks:
            only = torch.zeros(vocab, dtype=torch.bool, device=tokens.device)
            only[self.stop_id] = True
            self.masks.update({p: only for p in rest.nonzero().flatten().tolist()})


def response_format_constraint(
    response_format: dict | None, tokenizer, stop_token_ids, budget: int | None = None
) -> GrammarConstraint | None:
    """The constraint of an OpenAI `response_format` ({"type": "text" | "json_object" |
    "json_schema", "json_schema": {"name", "schema", "strict"}}), finishing within `budget`
    tokens; None for plain text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError("response_format: must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarConstraint.json(tokenizer, stop_token_ids, budget=budget)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format: json_schema must be an object with a schema object")
        return GrammarConstraint.json(
            tokenizer, stop_token_ids, spec.get("schema") or {"type": "object"}, budget=budget
        )
    raise ValueError(f"response_format: type must be text, json_object or json_schema (got {kind!r})")
