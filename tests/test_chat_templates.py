"""Chat templates render exactly as transformers renders them, with and without transformers."""

from __future__ import annotations

import pytest

from fastdllm.tokenizer import render_template

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
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "  café <b>2+2</b>?  "}],
]
TOOL_LIST = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für Zürich <now>",
                                               "parameters": {"type": "object", "required": ["z"], "b": 1, "a": 2}}}]
DOCS = [{"title": "T1", "text": "one"}, {"title": "T2", "text": "two"}]
SPECIALS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "mask_token": "<|mdm_mask|>"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(name, conv, add_generation_prompt):
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    kwargs = dict(tools=TOOL_LIST if name in ("tools", "llama") else None,
                  documents=DOCS if name == "documents" else None, **SPECIALS)
    theirs, _ = render_jinja_template(conversations=[CONVERSATIONS[conv]], chat_template=TEMPLATES[name],
                                      add_generation_prompt=add_generation_prompt, **kwargs)
    ours = render_template(TEMPLATES[name], CONVERSATIONS[conv], add_generation_prompt, **kwargs)
    assert ours == theirs[0]


def test_the_embedded_templates_and_ids_match_transformers():
    transformers = pytest.importorskip("transformers")
    import fastdllm

    for name in ("llada-arith", "dream-arith"):
        _, tok = fastdllm.load(name)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.fast, **tok.special_tokens_context())
        hf.chat_template = tok.chat_template
        for messages in CONVERSATIONS:
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert render_template(tok.chat_template, messages, True, **tok.special_tokens_context()) == text
            assert tok.apply_chat_template(messages) == text
            assert tok.encode_chat(messages) == hf.encode(text, add_special_tokens=False)


def test_tojson_keeps_key_order_and_non_ascii():
    out = render_template("{{ tools | tojson }}", [], tools=[{"b": "ü<", "a": 1}])
    assert out == '[{"b": "ü<", "a": 1}]'


def test_decoding_keeps_added_tokens_that_are_not_special():
    from tokenizers import AddedToken, Tokenizer as FastTokenizer

    from fastdllm.tokenizer import Tokenizer
    from fastdllm.embedded import build_tokenizer

    base = build_tokenizer()
    fast = FastTokenizer.from_str(base.fast.to_str())
    fast.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tok = Tokenizer(fast, base.config)
    ids = tok.encode("a <think> b<|eot_id|>")
    assert tok.token_to_id("<think>") in ids
    assert "<think>" in tok.decode(ids) and "<|eot_id|>" not in tok.decode(ids)
