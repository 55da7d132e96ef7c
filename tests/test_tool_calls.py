"""Tool calling: parsing the Hermes and Llama-3.1 formats, the history as templates take it, the
tools in the prompt, and the server's tools / tool_choice (auto, required, named, none)."""

import json

import pytest

import fastdllm
from fastdllm.text import tool_calls
from fastdllm.text.tokenizer import Tokenizer

from .test_chat_templates import LOOP_CONTROLS, TOOLS
from .test_server import LiveServer

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two numbers",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["a", "b"],
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 1000},
                "b": {"type": "integer", "minimum": 0, "maximum": 1000},
            },
        },
    },
}
MUL = {
    "type": "function",
    "function": {
        "name": "mul",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["x"],
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
}
MSG = [{"role": "user", "content": "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"}]


def test_hermes_calls_and_the_text_around_them():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 3}}\n</tool_call>\n'
        '<tool_call>{"name": "mul", "arguments": "{\\"x\\": 2}"}</tool_call>'
    )
    content, calls = tool_calls.parse_hermes(text)
    assert content == "Let me add."
    assert calls == [{"name": "add", "arguments": {"a": 5, "b": 3}}, {"name": "mul", "arguments": {"x": 2}}]
    # an unclosed last call (the answer ended) still counts; broken JSON is text
    assert tool_calls.parse_hermes('<tool_call>{"name": "add", "arguments": {}}')[1] == [
        {"name": "add", "arguments": {}}
    ]
    assert tool_calls.parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert tool_calls.parse_hermes("8 apples") == ("8 apples", [])


def test_llama3_json_calls():
    content, calls = tool_calls.parse_llama3_json(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "mul", "parameters": {}}'
    )
    assert content is None and [c["name"] for c in calls] == ["add", "mul"]
    assert tool_calls.parse_llama3_json("The answer is 8.") == ("The answer is 8.", [])
    assert tool_calls.parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_calls.parser_for_template(TOOLS) == "hermes"


def test_forced_calls_and_their_schema():
    schema = tool_calls.forced_schema([ADD, MUL], "required")
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert tool_calls.forced_calls('[{"name": "add", "parameters": {"a": 1, "b": 2}}]', "required") == [
        {"name": "add", "arguments": {"a": 1, "b": 2}}
    ]
    named = {"type": "function", "function": {"name": "add"}}
    assert tool_calls.forced_schema([ADD, MUL], named) == ADD["function"]["parameters"]
    assert tool_calls.forced_calls('{"a": 1, "b": 2}', named) == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert tool_calls.forced_calls('{"a": 1', named) == []  # ran out before closing


@pytest.mark.parametrize(
    "tools,choice,words",
    [
        ([{"type": "function"}], None, "tools[0]"),
        ("x", None, "tools"),
        ([ADD], "sometimes", "tool_choice"),
        ([ADD], {"type": "function", "function": {"name": "mul"}}, "no tool named 'mul'"),
        ([], "required", "needs tools"),
    ],
)
def test_malformed_tools_name_the_field(tools, choice, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        tool_calls.check_tools(tools, choice)


def test_history_reaches_the_template_as_transformers_passes_it():
    history = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 5, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "8"},
    ]
    out = tool_calls.template_messages(history)
    assert "content" not in out[1]  # None dropped
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 5, "b": 3}
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "8"}


def test_tools_reach_a_template_that_reads_them():
    model, tok = fastdllm.load()
    qwenish = Tokenizer(tok.fast, {**tok.config, "chat_template": TOOLS})
    ids = qwenish.encode_chat(MSG, tools=[ADD])
    assert '"name": "add"' in qwenish.decode(ids)
    assert tool_calls.template_reads_tools(TOOLS) and tool_calls.template_reads_tools(tok.chat_template)
    assert not tool_calls.template_reads_tools(LOOP_CONTROLS)
    system = tool_calls.tools_system_message([ADD])
    assert system["role"] == "system" and '"name": "add"' in system["content"] and "<tool_call>" in system["content"]


# The Llama-3 layout without tools: a template that would drop them.
NO_TOOLS = (
    "{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_server_gives_a_template_that_drops_tools_a_system_turn_with_them():
    from fastdllm import GenerationConfig
    from fastdllm.server import Server, ServerSettings
    from fastdllm.server.schema import ChatCompletionRequest

    model, tok = fastdllm.load()
    plain = Tokenizer(tok.fast, {**tok.config, "chat_template": NO_TOOLS})
    assert not tool_calls.template_reads_tools(NO_TOOLS)
    server = Server(model, plain, ServerSettings("m", GenerationConfig()))
    with_tools = server.chat_prompt(ChatCompletionRequest(model="m", messages=MSG, tools=[ADD]))
    assert with_tools == plain.encode_chat([tool_calls.tools_system_message([ADD]), *MSG])
    assert server.chat_prompt(
        ChatCompletionRequest(model="m", messages=MSG, tools=[ADD], tool_choice="none")
    ) == plain.encode_chat(MSG)


@pytest.fixture(scope="module")
def srv():
    server = LiveServer(*fastdllm.load(dtype="float32"))
    yield server
    server.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_server_forced_tool_calls(srv, choice):
    r = srv.client.chat.completions.create(
        model="llada-arith", messages=MSG, tools=[ADD, MUL], tool_choice=choice, max_tokens=64
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "add"
    args = json.loads(call.function.arguments)
    if call.function.name == "add":
        assert set(args) == {"a", "b"} and all(0 <= v <= 1000 for v in args.values())


def test_server_fits_a_call_with_unbounded_arguments_into_max_tokens(srv):
    """Integers without bounds (openai-agents' `a: int`, llama-index's schemas) and a model never
    taught to call tools: the call still closes inside max_tokens, so it is a call, not a cut."""
    unbounded = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "required": ["a", "b"],
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
    for max_tokens in (48, 64):  # the shortest such call takes 42 tokens of this tokenizer
        r = srv.client.chat.completions.create(
            model="llada-arith", messages=MSG, tools=[unbounded], tool_choice="required", max_tokens=max_tokens
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (max_tokens, c)
        assert set(json.loads(c.message.tool_calls[0].function.arguments)) == {"a", "b"}
        assert r.usage.completion_tokens <= max_tokens


def test_server_streams_a_tool_call_whole(srv):
    stream = srv.client.chat.completions.create(
        model="llada-arith", messages=MSG, tools=[ADD], tool_choice="required", max_tokens=64, stream=True
    )
    chunks = [c for c in stream if c.choices]
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "add"
    json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_server_auto_none_and_history(srv):
    auto = srv.client.chat.completions.create(model="llada-arith", messages=MSG, tools=[ADD], max_tokens=32, seed=1)
    none = srv.client.chat.completions.create(
        model="llada-arith", messages=MSG, tools=[ADD], tool_choice="none", max_tokens=32, seed=1
    )
    plain = srv.client.chat.completions.create(model="llada-arith", messages=MSG, max_tokens=32, seed=1)
    # the embedded model does not call tools on its own: auto answers in text
    assert auto.choices[0].finish_reason in ("stop", "length") and auto.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content  # no tools in the prompt
    history = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 5, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "8"},
    ]
    after = srv.client.chat.completions.create(model="llada-arith", messages=history, tools=[ADD], max_tokens=32)
    assert after.choices[0].finish_reason in ("stop", "length")  # the history is taken; the answer is the model's
    for body, param in [
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ]:
        r = srv.post("/v1/chat/completions", {"model": "llada-arith", "messages": MSG, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = srv.post("/v1/chat/completions", {"model": "llada-arith", "messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400
    assert srv.health()["status"] == "ok"
