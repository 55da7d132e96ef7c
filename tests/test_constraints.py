"""Grammar-constrained decoding (JSON, schemas, regexes) in the one decoding loop, through the
Python API and the server's response_format; and transformers' keywords in the config and generate."""

import json

import pytest
import torch

import fastdllm
from fastdllm import ConfigError, GenerationConfig, generate
from fastdllm.engine.constraints import GrammarConstraint, response_format_constraint
from fastdllm.text import tool_calls

Q = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["steps", "answer"],
    "properties": {
        "steps": {"type": "string", "maxLength": 40},
        "answer": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
}


@pytest.fixture(scope="module")
def loaded():
    return fastdllm.load(dtype="float32")


def answer(tok, seq) -> str:
    return tok.decode(seq, skip_special_tokens=True)


def check_schema(obj):
    assert set(obj) == {"steps", "answer"}
    assert isinstance(obj["steps"], str) and len(obj["steps"]) <= 40
    assert isinstance(obj["answer"], int) and 0 <= obj["answer"] <= 1000


@pytest.mark.parametrize("threshold", [0.9, None])
def test_json_schema_output_is_valid_and_other_rows_are_untouched(loaded, threshold):
    model, tok = loaded
    ids = tok.encode_chat([{"role": "user", "content": Q}])
    cfg = GenerationConfig(gen_length=64, threshold=threshold)
    constraint = GrammarConstraint.json(tok, model.stop_token_ids, SCHEMA)
    out = generate(model, [ids, ids], cfg, constraints=[constraint, None])
    check_schema(json.loads(answer(tok, out.sequences[0])))
    alone = generate(model, [ids], cfg)
    assert torch.equal(out.sequences[1], alone.sequences[0])
    # left to right: each position revealed no earlier than the one before it
    steps = out.unmask_step[0][: len(constraint.consumed)]
    assert bool((steps[1:] >= steps[:-1]).all())
    assert constraint.finished


def test_parallel_candidates_are_kept_where_the_grammar_accepts_them(loaded):
    model, tok = loaded
    ids = tok.encode_chat([{"role": "user", "content": Q}])
    constraint = GrammarConstraint.json(tok, model.stop_token_ids, SCHEMA)
    config = GenerationConfig.for_model(model, gen_length=64, threshold=0.9)  # its own blocks of 64
    out = generate(model, [ids], config, constraints=[constraint])
    per_step = out.tokens_per_step[0]
    assert max(per_step[:-1]) > 1  # before the final fill with stop tokens
    assert out.nfe < len(constraint.consumed)


def test_json_object_and_regex(loaded):
    model, tok = loaded
    ids = tok.encode_chat([{"role": "user", "content": Q}])
    c = GrammarConstraint.regex(tok, model.stop_token_ids, r"[0-9]{1,3} apples")
    out = generate(model, [ids], GenerationConfig(gen_length=32), constraints=[c])
    text = answer(tok, out.sequences[0])
    assert text.split(" ")[1] == "apples" and text.split(" ")[0].isdigit() and len(text.split(" ")[0]) <= 3
    obj = response_format_constraint({"type": "json_object"}, tok, model.stop_token_ids)
    out = generate(model, [ids], GenerationConfig(gen_length=64), constraints=[obj])
    assert answer(tok, out.sequences[0]).startswith("{")
    assert response_format_constraint({"type": "text"}, tok, model.stop_token_ids) is None
    with pytest.raises(ValueError, match="response_format"):
        response_format_constraint({"type": "yaml"}, tok, model.stop_token_ids)
    with pytest.raises(ValueError, match="constraints"):
        generate(model, [ids], GenerationConfig(gen_length=32), constraints=[c, c])


UNBOUNDED = {
    "type": "object",
    "required": ["a", "b"],
    "additionalProperties": False,
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
}


def digit_lover(tok, vocab: int, t: int) -> torch.Tensor:
    """Logits of a model that wants to write the digit 7 at every position (ahead of `{`, `"`, ...)."""
    logits = torch.zeros(t, vocab)
    logits[:, tok.token_to_id("7")] = 10.0
    for text, score in (("{", 9.0), ('"', 8.0), ("a", 7.0), (":", 6.0), (" ", 5.0)):
        logits[:, tok.encode(text)[0]] = score
    return logits


def decode_left_to_right(constraint, logits: torch.Tensor, stop_id: int) -> list[int]:
    """Run `amend` one frontier per step over an answer of len(logits) positions."""
    t = logits.shape[0]
    answer = torch.full((t,), -1)
    while (answer < 0).any():
        masked = answer < 0
        tokens = logits.argmax(-1)
        chosen = torch.zeros(t, dtype=torch.bool)
        constraint.amend(logits, tokens, chosen, masked)
        answer[chosen] = tokens[chosen]
    return answer.tolist()


BUDGET = 20  # `{"a": 7, "b": 0}` and the stop token take 14 tokens of this tokenizer


def test_the_grammar_finishes_within_the_budget(loaded):
    """An integer with no bound, and a model that would write digits forever: with a budget of
    BUDGET positions the answer is still valid JSON, ended by the stop token inside them; without
    one the digits run the answer out, unfinished."""
    model, tok = loaded
    logits = digit_lover(tok, model.args.vocab_size, BUDGET)
    stop = model.stop_token_ids[0]
    budgeted = GrammarConstraint.json(tok, model.stop_token_ids, UNBOUNDED, budget=BUDGET)
    answer = decode_left_to_right(budgeted, logits, stop)
    assert budgeted.finished and stop in answer
    obj = json.loads(tok.decode(answer[: answer.index(stop)], skip_special_tokens=True))
    assert set(obj) == {"a", "b"} and all(isinstance(v, int) for v in obj.values())
    assert "7" in str(obj["a"])  # the model's digits are kept while they leave room
    unbounded = GrammarConstraint.json(tok, model.stop_token_ids, UNBOUNDED)
    decode_left_to_right(unbounded, logits, stop)
    assert not unbounded.finished
    with pytest.raises(ValueError, match="budget"):
        GrammarConstraint.json(tok, model.stop_token_ids, UNBOUNDED, budget=0)


# Schemas whose values have no bound a model could be stopped by: numbers, strings, arrays without
# maxItems (nested), optional members.
OPEN_ENDED = {
    "integer and string": {
        "type": "object",
        "required": ["answer", "unit"],
        "properties": {"answer": {"type": "integer"}, "unit": {"type": "string"}},
    },
    "one long string": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
    "nested arrays": {
        "type": "object",
        "required": ["rows"],
        "properties": {"rows": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}},
    },
    "optional fields": {
        "type": "object",
        "required": ["a"],
        "properties": {
            "a": {"type": "string"},
            "b": {"type": "integer"},
            "c": {"type": "array", "items": {"type": "string"}},
        },
    },
}


def open_ended_lover(tok, vocab: int, t: int) -> torch.Tensor:
    """Logits of a model that would grow any value for ever: digits, letters, a `}` inside a string,
    opening brackets, commas, ahead of what closes a value."""
    logits = torch.zeros(t, vocab)
    for text, score in (
        ("7", 10.0),
        ("a", 9.5),
        ("}", 9.4),
        ("[", 9.0),
        (",", 8.5),
        ("{", 8.0),
        ('"', 7.0),
        (":", 6.0),
        (" ", 5.0),
        ("b", 4.0),
    ):
        logits[:, tok.encode(text, add_special_tokens=False)[0]] = score
    return logits


def is_valid(tok, model, schema, answer_ids) -> bool:
    """The answer up to the stop token, read by a fresh grammar of `schema` to its accepting end."""
    stop = model.stop_token_ids[0]
    if stop not in answer_ids:
        return False
    text = tok.decode(answer_ids[: answer_ids.index(stop)], skip_special_tokens=True)
    json.loads(text)
    fresh = GrammarConstraint.json(tok, model.stop_token_ids, schema)
    ids = fresh.tokenizer.tokenize_bytes(text.encode())
    return fresh.matcher.consume_tokens(ids) and fresh.matcher.is_accepting()


# Each schema's shortest instance, as the grammar writes JSON.
SHORTEST = {
    "integer and string": '{"answer": 0, "unit": ""}',
    "one long string": '{"text": ""}',
    "nested arrays": '{"rows": []}',
    "optional fields": '{"a": ""}',
}


@pytest.mark.parametrize("name", sorted(OPEN_ENDED))
def test_open_ended_values_close_within_every_budget_from_the_shortest_up(loaded, name):
    """From the schema's shortest answer (its shortest instance and the stop token) to 256
    positions, a model that would never close a value still ends with valid JSON and its stop token
    inside the budget; one position below, the JSON fills the budget with no room for the stop
    token (the server's finish_reason "length"), and two below it cannot close."""
    model, tok = loaded
    schema = OPEN_ENDED[name]
    shortest = len(tok.encode(SHORTEST[name], add_special_tokens=False)) + 1
    assert (
        len(GrammarConstraint.json(tok, model.stop_token_ids, schema).completion()) == shortest
    )  # the search finds it
    stop = model.stop_token_ids[0]
    for budget in sorted({shortest, shortest + 1, shortest + 5, 2 * shortest, 64, 256}):
        c = GrammarConstraint.json(tok, model.stop_token_ids, schema, budget=budget)
        answer = decode_left_to_right(c, open_ended_lover(tok, model.args.vocab_size, budget), stop)
        assert c.finished and is_valid(tok, model, schema, answer), (name, budget, tok.decode(answer))
    for short in (shortest - 1, shortest - 2):  # no room for the stop token; then not for the JSON either
        below = GrammarConstraint.json(tok, model.stop_token_ids, schema, budget=short)
        answer = decode_left_to_right(below, open_ended_lover(tok, model.args.vocab_size, short), stop)
        assert stop not in answer and below.finished == (short == shortest - 1)


@pytest.mark.parametrize(
    "name,budget",
    [
        ("integer and string", 32),
        pytest.param("integer and string", 64, marks=pytest.mark.slow),
        pytest.param("one long string", 32, marks=pytest.mark.slow),
    ],
)
def test_the_embedded_model_closes_open_ended_values_in_time(loaded, name, budget):
    """The default model left to its own devices writes digits and text past any budget: the
    answer still closes, valid, within it."""
    model, tok = loaded
    ids = tok.encode_chat([{"role": "user", "content": Q}])
    c = GrammarConstraint.json(tok, model.stop_token_ids, OPEN_ENDED[name], budget=budget)
    out = generate(model, [ids], GenerationConfig(gen_length=-(-budget // 32) * 32), constraints=[c])
    answer = out.sequences[0].tolist()
    assert c.finished and answer.index(model.stop_token_ids[0]) < budget
    assert is_valid(tok, model, OPEN_ENDED[name], answer)


def test_a_completion_closes_what_is_open(loaded):
    model, tok = loaded
    c = GrammarConstraint.json(tok, model.stop_token_ids, UNBOUNDED)
    prefix = tok.encode('{"a": 12')
    assert c.matcher.consume_tokens(prefix)
    rest = c.completion()
    assert rest[-1] == model.stop_token_ids[0]
    assert json.loads(tok.decode(prefix + rest[:-1])) == {"a": 12, "b": 0}
    assert c.consumed == [] and not c.finished  # the search moved a copy, not the row's grammar


def test_generate_fits_a_schema_into_the_answer_length(loaded):
    model, tok = loaded
    ids = tok.encode_chat([{"role": "user", "content": Q}])
    for gen_length in (16, 32):
        constraint = GrammarConstraint.json(tok, model.stop_token_ids, UNBOUNDED)
        out = generate(model, [ids], GenerationConfig(gen_length=gen_length, block_length=16), constraints=[constraint])
        assert constraint.budget == gen_length and constraint.finished
        obj = json.loads(answer(tok, out.sequences[0]))
        assert set(obj) == {"a", "b"}


def test_server_response_format(loaded):
    from .test_server import LiveServer

    server = LiveServer(*loaded)
    try:
        msg = [{"role": "user", "content": Q}]
        fmt = {"type": "json_schema", "json_schema": {"name": "result", "schema": SCHEMA, "strict": True}}
        r = server.client.chat.completions.create(model="llada-arith", messages=msg, max_tokens=64, response_format=fmt)
        check_schema(json.loads(r.choices[0].message.content))
        assert (
            "x-fastdllm-ignored"
            not in server.post(
                "/v1/chat/completions",
                {"model": "llada-arith", "messages": msg, "max_tokens": 64, "response_format": fmt},
            ).headers
        )
        bad = server.post(
            "/v1/chat/completions",
            {"model": "llada-arith", "messages": msg, "response_format": {"type": "json_schema", "json_schema": {}}},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
        bad = server.post(
            "/v1/chat/completions", {"model": "llada-arith", "messages": msg, "response_format": {"type": "yaml"}}
        )
        assert bad.status_code == 400
        assert server.health()["status"] == "ok"
    finally:
        server.stop()


def test_the_server_closes_open_ended_json_and_forced_calls_within_max_tokens(loaded):
    """Through the API: a json_schema answer and a forced tool call with a string argument are
    complete and valid within max_tokens from the shortest answer up; below it, finish_reason is
    "length"."""
    from .test_server import LiveServer

    model, tok = loaded
    schema = OPEN_ENDED["integer and string"]
    shortest = len(tok.encode(SHORTEST["integer and string"], add_special_tokens=False)) + 1
    fmt = {"type": "json_schema", "json_schema": {"name": "result", "schema": schema}}
    tool = {
        "type": "function",
        "function": {
            "name": "note",
            "parameters": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
        },
    }
    forced = tool_calls.forced_schema([tool], "required")
    call_shortest = len(GrammarConstraint.json(tok, model.stop_token_ids, forced).completion())  # an upper bound
    server = LiveServer(*loaded)
    try:
        msg = [{"role": "user", "content": Q}]
        for max_tokens in (shortest, 48):
            r = server.client.chat.completions.create(
                model="llada-arith", messages=msg, max_tokens=max_tokens, response_format=fmt
            )
            obj = json.loads(r.choices[0].message.content)
            assert r.choices[0].finish_reason == "stop" and isinstance(obj["answer"], int), max_tokens
            assert r.usage.completion_tokens <= max_tokens
        for max_tokens in (call_shortest, 64):
            r = server.client.chat.completions.create(
                model="llada-arith", messages=msg, max_tokens=max_tokens, tools=[tool], tool_choice="required"
            )
            calls = r.choices[0].message.tool_calls
            assert calls and isinstance(json.loads(calls[0].function.arguments)["text"], str), max_tokens
        r = server.client.chat.completions.create(
            model="llada-arith", messages=msg, max_tokens=shortest - 2, response_format=fmt
        )
        assert r.choices[0].finish_reason == "length"
    finally:
        server.stop()


# ---- transformers' keywords --------------------------------------------------------------------
def test_transformers_keywords_map_onto_ours():
    assert GenerationConfig(max_new_tokens=40).gen_length == 64
    assert GenerationConfig(max_new_tokens=40, block_length=8).gen_length == 40
    assert GenerationConfig(do_sample=False).temperature == 0.0
    assert GenerationConfig(do_sample=True).temperature == 1.0
    assert GenerationConfig(do_sample=True, temperature=0.7).temperature == 0.7
    assert GenerationConfig(temperature=0.5).with_options(do_sample=True).temperature == 0.5
    assert GenerationConfig().with_options(max_new_tokens=20, threshold=0.5).gen_length == 32


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(max_length=100), "max_length"),
        (dict(num_beams=4), "num_beams"),
        (dict(num_return_sequences=2), "num_return_sequences"),
        (dict(repetition_penalty=1.1), "repetition_penalty"),
        (dict(do_sample=True, temperature=0.0), "do_sample"),
        (dict(do_sample="yes"), "do_sample"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=8, gen_length=64), "max_new_tokens"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_keywords_without_a_meaning_here_name_themselves(kw, param):
    with pytest.raises(ConfigError) as e:
        GenerationConfig(**kw)
    assert e.value.param == param


def test_generate_takes_transformers_keywords(loaded):
    model, tok = loaded
    ids = tok.encode_chat([{"role": "user", "content": Q}])
    out = generate(model, [ids], max_new_tokens=20, do_sample=False)
    assert out.sequences.shape == (1, 20) and out.unmask_step.shape == (1, 20)
    full = generate(model, [ids], gen_length=out.config.gen_length)  # max_new_tokens: whole blocks, cut
    assert torch.equal(out.sequences[0], full.sequences[0, :20])
    assert generate(model, [ids], gen_length=32).config.block_length == 32  # its blocks of 64 yield
    many = generate(model, [ids, ids[:-2]], num_return_sequences=3, gen_length=32, temperature=1.0, seed=0)
    assert many.sequences.shape == (6, 32)
    tensor_in = generate(model, torch.tensor([ids]), num_return_sequences=2, gen_length=32)
    assert torch.equal(tensor_in.sequences[0], tensor_in.sequences[1])  # greedy: the copies agree
    with pytest.raises(ConfigError, match="max_length"):
        generate(model, [ids], max_length=50)
    with pytest.raises(ValueError, match="num_return_sequences"):
        generate(model, [ids], num_return_sequences=0)
