"""Chat templates render exactly as transformers renders them, with and without transformers."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
import typing

import pytest

import fastdllm
from fastdllm.text.tokenizer import render_template

LOOP_CONTROLS = (
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Qwen2.5-style: tools as JSON lines in the system turn, ChatML turns.
TOOLS = (
    "{%- if tools %}<|im_start|>system\\n{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are helpful.{% endif %}\\n\\n# Tools\\n<tools>{% for tool in tools %}\\n{{ tool | tojson }}"
    "{% endfor %}\\n</tools><|im_end|>\\n{%- endif %}"
    "{%- for m in messages %}{% if not (m.role == 'system' and tools) %}<|im_start|>{{ m.role }}\\n{{ m.content }}"
    "<|im_end|>\\n{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
)
# Llama-3.1-style: specials from the context, tojson with indent, a raise_exception branch.
LLAMA = (
    "{{ bos_token }}{% if messages[0].role == 'tool' %}{{ raise_exception('no tool first') }}{% endif %}"
    "{% if tools is not none %}<|start_header_id|>system<|end_header_id|>\\n\\n{% for t in tools %}"
    "{{ t | tojson(indent=4) }}\\n\\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\\n\\n{{ m.content | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\\n\\n{% endif %}"
    "{{ pad_token }}{{ mask_token }}"
)
DOCUMENTS = "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ messages[-1].content }}"
TEMPLATES = {"loop_controls": LOOP_CONTROLS, "tools": TOOLS, "llama": LLAMA, "documents": DOCUMENTS}
CONVERSATIONS = [
    [{"role": "user", "content": "Tom has 5 apples."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "  café <b>2+2</b>?  "},
    ],
]
TOOL_LIST = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für Zürich <now>",
            "parameters": {"type": "object", "required": ["z"], "b": 1, "a": 2},
        },
    }
]
DOCS = [{"title": "T1", "text": "one"}, {"title": "T2", "text": "two"}]
SPECIALS = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "mask_token": "<|mdm_mask|>",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(name, conv, add_generation_prompt):
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    kwargs = dict(
        tools=TOOL_LIST if name in ("tools", "llama") else None,
        documents=DOCS if name == "documents" else None,
        **SPECIALS,
    )
    theirs, _ = render_jinja_template(
        conversations=[CONVERSATIONS[conv]],
        chat_template=TEMPLATES[name],
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    ours = render_template(TEMPLATES[name], CONVERSATIONS[conv], add_generation_prompt, **kwargs)
    assert ours == theirs[0]


def test_the_embedded_templates_and_ids_match_transformers():
    transformers = pytest.importorskip("transformers")
    import fastdllm
    from fastdllm.models.loading import EMBEDDED_MODELS

    for name in EMBEDDED_MODELS:
        _, tok = fastdllm.load(name)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.fast, **tok.special_tokens_context())
        hf.chat_template = tok.chat_template
        for messages, tools in [(m, None) for m in CONVERSATIONS] + [(TOOL_CONVERSATION, TOOL_LIST)]:
            text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert render_template(tok.chat_template, messages, True, tools, **tok.special_tokens_context()) == text
            assert tok.render_chat(messages, tools=tools) == text
            assert tok.encode_chat(messages, tools=tools) == hf.encode(text, add_special_tokens=False)


@pytest.mark.slow  # loads transformers' tokenizers for every embedded model (~3 s)
def test_the_embedded_assets_load_in_transformers_without_remote_code():
    """A config.json whose auto_map names modeling files the folder lacks makes AutoTokenizer ask
    whether to trust remote code: every asset ships what its auto_map names (it names none), and
    transformers loads one without asking, as a user's script calls it."""
    pytest.importorskip("transformers")
    from fastdllm.models.loading import EMBEDDED_MODELS, resolve_model_path

    for name in EMBEDDED_MODELS:
        folder = resolve_model_path(name)
        named = {
            ref.split(".")[0] + ".py"
            for ref in json.loads((folder / "config.json").read_text()).get("auto_map", {}).values()
        }
        assert all((folder / f).is_file() for f in named), (name, named)
    folder = resolve_model_path(EMBEDDED_MODELS[0])
    script = (
        "import sys; from transformers import AutoTokenizer; "
        "print(AutoTokenizer.from_pretrained(sys.argv[1]).encode('3 + 4', add_special_tokens=False))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-1000:]
    assert "remote code" not in out.stdout + out.stderr and "custom code" not in out.stdout + out.stderr
    _, tok = fastdllm.load(EMBEDDED_MODELS[0])
    assert json.loads(out.stdout.strip().splitlines()[-1]) == tok.encode("3 + 4", add_special_tokens=False)


# A tool call and its result in the history, as `tool_calls.template_messages` passes them on.
TOOL_CONVERSATION = [
    {"role": "user", "content": "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"z": "8001", "a": 1}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "8"},
    {
        "role": "assistant",
        "content": "Two calls:",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": {"x": [1, 2]}}},
        ],
    },
]


def test_the_embedded_template_lists_tools_and_writes_calls_in_the_hermes_convention():
    import fastdllm
    from fastdllm.text import tool_calls

    _, tok = fastdllm.load()
    plain = CONVERSATIONS[1]
    assert tok.render_chat(plain) == (
        "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "hello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\ncafé <b>2+2</b>?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # the tools as signature lines in a system turn before the conversation
    add = {
        "type": "function",
        "function": {
            "name": "add",
            "description": " Add two numbers. ",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
    assert tok.render_chat(plain, tools=[add, *TOOL_LIST]) == (
        "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nYou can call these functions:\n"
        "- add(a, b): Add two numbers.\n- get_weather(): Wetter für Zürich <now>\nTo call one, answer "
        '<tool_call>{"name": <name>, "arguments": {<parameter>: <value>}}</tool_call><|eot_id|>'
    ) + tok.render_chat(plain).removeprefix("<|startoftext|>")
    text = tok.render_chat(TOOL_CONVERSATION, tools=TOOL_LIST)
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n<tool_call>{"name": "get_weather", "arguments": '
        '{"z": "8001", "a": 1}}</tool_call><|eot_id|><|start_header_id|>tool<|end_header_id|>\n\n8<|eot_id|>'
    ) in text
    assert (
        'Two calls:\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
        '"arguments": {"x": [1, 2]}}</tool_call><|eot_id|>'
    ) in text
    # what the model writes for a call parses back into the same call
    written = text.split("<|end_header_id|>\n\n")[-2].removesuffix("<|eot_id|><|start_header_id|>assistant")
    assert tool_calls.parse_hermes(written)[1] == [
        {"name": "f", "arguments": {}},
        {"name": "g", "arguments": {"x": [1, 2]}},
    ]


# What transformers' apply_chat_template does beyond rendering: its defaults (no generation prompt,
# tokenized), tensors and dicts, None-valued keys dropped, reasoning under its other names, the
# {% generation %} tag, continuing the final message, batches.
REASONING = (
    "{% for m in messages %}{{ m.role }}:{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}]"
    "{% endif %}{% if m.thinking is defined %}<{{ m.thinking }}>{% endif %}"
    "{% if m.content is defined %}{{ m.content }}{% else %}(no content){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}"
    "{% endgeneration %}{% else %}U: {{ m.content }}{% endif %}\n{% endfor %}"
)
PARITY_CASES = [
    (REASONING, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "reasoning": "think"}], {}),
    (REASONING, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "thinking": "t"}], {}),
    (GENERATION, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], {}),
    (LOOP_CONTROLS, CONVERSATIONS[1], {"add_generation_prompt": True}),
    (TOOLS, CONVERSATIONS[0], {"tools": TOOL_LIST}),
    (LLAMA, CONVERSATIONS[1][:3], {"continue_final_message": True}),
]


@pytest.mark.parametrize("case", range(len(PARITY_CASES)))
@pytest.mark.parametrize(
    "returns",
    [
        dict(tokenize=False),
        dict(),
        dict(return_tensors="pt"),
        dict(return_dict=False),
        dict(return_dict=False, return_tensors="pt"),
    ],
)
def test_apply_chat_template_matches_transformers_with_and_without_it(case, returns):
    transformers = pytest.importorskip("transformers")
    import torch

    import fastdllm

    template, messages, kwargs = PARITY_CASES[case]
    _, tok = fastdllm.load()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.fast, **tok.special_tokens_context())
    theirs = hf.apply_chat_template(messages, chat_template=template, **kwargs, **returns)
    ours = tok.apply_chat_template(messages, chat_template=template, **kwargs, **returns)
    if isinstance(theirs, (str, list)):
        assert ours == theirs
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs)
    else:
        assert set(ours) == set(theirs) and all(
            torch.equal(ours[k], theirs[k]) if isinstance(theirs[k], torch.Tensor) else ours[k] == list(theirs[k])
            for k in theirs
        )


def test_apply_chat_template_batches_and_the_tokenizer_call():
    transformers = pytest.importorskip("transformers")
    import fastdllm

    _, tok = fastdllm.load()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.fast, **tok.special_tokens_context())
    hf.chat_template = tok.chat_template
    assert tok.apply_chat_template(CONVERSATIONS, tokenize=False) == hf.apply_chat_template(
        CONVERSATIONS, tokenize=False
    )
    assert tok.apply_chat_template(CONVERSATIONS, return_dict=False) == hf.apply_chat_template(
        CONVERSATIONS, return_dict=False
    )
    for text in ("Tom has 5 apples.", ["a b", "Tom has 5 apples."]):
        ours, theirs = tok(text), hf(text)
        assert ours["input_ids"] == theirs["input_ids"] and ours["attention_mask"] == theirs["attention_mask"]
    assert tok.encode("Tom has 5 apples.") == hf.encode("Tom has 5 apples.")
    padded = tok(["a", "a b c"], padding=True, return_tensors="pt")
    assert padded["input_ids"].shape == (2, padded["input_ids"].shape[1]) and padded["attention_mask"][0, -1] == 0


def test_tojson_keeps_key_order_and_non_ascii():
    out = render_template("{{ tools | tojson }}", [], tools=[{"b": "ü<", "a": 1}])
    assert out == '[{"b": "ü<", "a": 1}]'


def test_decoding_keeps_added_tokens_that_are_not_special():
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as FastTokenizer

    from fastdllm.embedded.recipe import build_tokenizer
    from fastdllm.text.tokenizer import Tokenizer

    base = build_tokenizer()
    fast = FastTokenizer.from_str(base.fast.to_str())
    fast.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tok = Tokenizer(fast, base.config)
    ids = tok.encode("a <think> b<|eot_id|>")
    assert tok.token_to_id("<think>") in ids
    assert "<think>" in tok.decode(ids) and "<|eot_id|>" not in tok.decode(ids)


# ---- tools given as Python functions: their JSON schema, by transformers' rules ---------------------
class Unit(enum.Enum):
    CELSIUS = "celsius"
    KELVIN = "kelvin"


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b (float): The second number, which may
            be written over two lines.

    Returns:
        The sum.
    """


def weather(
    city: str,
    unit: Unit,
    days: list[int] | None = None,
    mode: typing.Literal["fast", 1] = "fast",
    extra: dict[str, bool] = None,
    pair: tuple[int, str] = (1, "a"),
    either: int | list[str] = 0,
    anything: typing.Any = None,
    kind: str = "a",
):
    """Get the weather.
    Over several lines.

    Args:
        city: The city.
        unit: The unit.
        days: The days ahead.
        mode: How.
        extra: Flags.
        pair: A pair.
        either: One or the other.
        anything: Whatever.
        kind: Which kind (choices: ["a", "b"])
    """


class Tools:
    def method(self, x: str):
        """A method.

        Args:
            x: A string.
        """


@pytest.mark.parametrize("func", [add, weather, Tools().method])
def test_a_python_function_is_the_tool_schema_transformers_makes(func):
    from fastdllm.text.tool_schema import function_schema

    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    assert function_schema(func) == get_json_schema(func)


def test_a_function_without_what_its_schema_needs_names_it():
    from fastdllm.text.tool_schema import function_schema

    def bare(x: int):
        pass

    def undocumented(x: int):
        """Does things."""

    def unhinted(x):
        """Does things.

        Args:
            x: A thing.
        """

    for f, words in ((bare, "no docstring"), (undocumented, "'x'"), (unhinted, "type hint")):
        with pytest.raises(ValueError, match=words):
            function_schema(f)


def test_apply_chat_template_takes_python_functions_as_tools_as_transformers_does():
    _, tok = fastdllm.load("llada-arith")
    messages = [{"role": "user", "content": "Tom has 5 apples. He buys 3 more. How many now?"}]
    ours = tok.apply_chat_template(messages, tools=[add, weather], tokenize=False, add_generation_prompt=True)
    from fastdllm.text.tool_schema import function_schema

    assert ours == tok.apply_chat_template(
        messages, tools=[function_schema(add), function_schema(weather)], tokenize=False, add_generation_prompt=True
    )
    assert "- add(a, b): Add two numbers.\n" in ours
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.fast, **tok.special_tokens_context())
    theirs = hf.apply_chat_template(
        messages, tools=[add, weather], chat_template=tok.chat_template, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
