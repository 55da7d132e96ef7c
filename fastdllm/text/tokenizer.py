"""Tokenizers from a checkpoint folder, with the model's chat template.

Two layouts are read: a fast-tokenizer `tokenizer.json` (LLaDA, our embedded model), or Qwen2's
byte-level BPE files `vocab.json` + `merges.txt` + `added_tokens.json` (Dream), built here with the
`tokenizers` library, never through remote code. The chat template comes from
`tokenizer_config.json` and is rendered with jinja2's sandbox, as transformers does.
"""

from __future__ import annotations

import functools
import json
import secrets
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.models import BPE

# Qwen2's pre-tokenisation pattern (digits split one by one).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Names of the end-of-turn tokens of the chat templates we know: generation may stop at them.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>")  # LLaMA-3, ChatML, Gemma


def check_text(text: str) -> str:
    """`text` if it is text a tokenizer takes, else a ValueError saying where it is not: a lone
    surrogate, which is what Python makes of bytes that are not UTF-8 (a command-line argument or
    stdin in another encoding: the byte it stood for is named) or of a lone UTF-16 surrogate in
    JSON ("\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise ValueError(f"not valid UTF-8 text ({what} at character {e.start}); give the text in UTF-8") from None
    return text


class Tokenizer:
    def __init__(self, fast: FastTokenizer, tokenizer_config: dict | None = None):
        self.fast = fast
        self.config = tokenizer_config or {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = self._token_str("bos_token")
        self.eos_token = self._token_str("eos_token")
        self.pad_token = self._token_str("pad_token") or self.eos_token

    def _token_str(self, key: str) -> str | None:
        value = self.config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value

    # ---- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.fast.token_to_id(token)

    def id_of(self, token: str | None) -> int | None:
        return None if token is None else self.fast.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.id_of(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.id_of(self.pad_token)

    def stop_token_ids(self) -> list[int]:
        """EOS and any end-of-turn token present: once generated, nothing after them matters."""
        ids = [self.eos_token_id] + [self.fast.token_to_id(t) for t in END_OF_TURN_TOKENS]
        return sorted({i for i in ids if i is not None})

    # ---- text <-> ids -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As transformers' `encode`: the tokenizer's own special tokens (its post-processor's BOS,
        where it has one) added unless `add_special_tokens=False`."""
        return self.fast.encode(check_text(text), add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.fast.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_tokens_context(self) -> dict:
        """The special tokens a chat template sees by name (bos_token, eos_token, pad_token,
        unk_token, mask_token, ...), as transformers passes them."""
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        context = {n: self._token_str(n) for n in names if self._token_str(n) is not None}
        context["pad_token"] = self.pad_token or context.get("pad_token")
        return {k: v for k, v in context.items() if v is not None}

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None, documents=None, **template_kwargs
    ) -> str:
        """The conversation as the template renders it (the engine's own call: the generation prompt
        on by default), through `apply_chat_template(tokenize=False)`."""
        return self.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        documents=None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_tensors: str | None = None,
        return_dict: bool = True,
        **template_kwargs,
    ):
        """transformers' `apply_chat_template` (v5): the same signature, defaults and results (a string
        with `tokenize=False`; else a dict of `input_ids` and `attention_mask`, or the ids alone with
        `return_dict=False`, tensors with `return_tensors="pt"`; a list of conversations gives one
        result each), by transformers' steps done here, without importing it (which costs seconds):
        None-valued keys dropped, a message's reasoning under `reasoning_content` and `thinking` as
        well, the template rendered in transformers' environment (`render_template`), then encoded
        without special tokens. `tests/test_chat_templates.py` holds it to transformers' own."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        context = {**self.special_tokens_context(), **template_kwargs}
        texts = []
        for chat in conversation if batched else [conversation]:
            chat = normalize_messages(chat)
            if not continue_final_message:
                texts.append(render_template(template, chat, add_generation_prompt, tools, documents, **context))
                continue
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ValueError("continue_final_message is set but the final message has no content to continue")
            tag = "CONTINUE_FINAL_MESSAGE_TAG "
            chat[-1] = {**chat[-1], "content": final + tag}
            text = render_template(template, chat, False, tools, documents, **context)
            if final.strip() not in text or tag.strip() not in text:
                raise ValueError(
                    "continue_final_message is set but the final message does not appear in the chat "
                    "after applying the chat template"
                )
            at = text.rindex(tag.strip())
            # a template that trims the message trimmed the tag's space too: cut its trailing space
            texts.append(text[:at] if text[at : at + len(tag)] == tag else text[:at].rstrip())
        if not tokenize:
            return texts if batched else texts[0]
        ids = [self.fast.encode(t, add_special_tokens=False).ids for t in texts]
        out = ids if batched else ids[0]
        if return_tensors == "pt":
            import torch

            out = torch.tensor(ids)
        elif return_tensors is not None:
            raise ValueError(f"return_tensors: only 'pt' is supported here (got {return_tensors!r})")
        if return_dict:
            mask = [[1] * len(x) for x in ids]
            if return_tensors == "pt":
                import torch

                mask = torch.tensor(mask)
            return {"input_ids": out, "attention_mask": mask if batched or return_tensors else mask[0]}
        return out

    def __call__(
        self,
        text,
        add_special_tokens: bool = True,
        return_tensors: str | None = None,
        padding: bool = False,
        return_attention_mask: bool = True,
    ):
        """transformers' `tokenizer(text)`: {"input_ids", "attention_mask"} for a string or a list of
        them (`padding=True` pads a batch to its longest, on `padding_side` from the tokenizer's
        config, default right; `return_tensors="pt"` for tensors, which a ragged batch needs padding for)."""
        batched = isinstance(text, (list, tuple))
        ids = [self.encode(t, add_special_tokens=add_special_tokens) for t in (text if batched else [text])]
        mask = [[1] * len(x) for x in ids]
        if padding and batched:
            longest, pad = max(map(len, ids)), self.pad_token_id if self.pad_token_id is not None else 0
            left = self.config.get("padding_side", "right") == "left"
            for i, x in enumerate(ids):
                fill = longest - len(x)
                ids[i] = [pad] * fill + x if left else x + [pad] * fill
                mask[i] = [0] * fill + mask[i] if left else mask[i] + [0] * fill
        if return_tensors == "pt":
            import torch

            if len({len(x) for x in ids}) > 1:
                raise ValueError("return_tensors: a batch of different lengths needs padding=True")
            ids, mask = torch.tensor(ids), torch.tensor(mask)
        elif return_tensors is not None:
            raise ValueError(f"return_tensors: only 'pt' is supported here (got {return_tensors!r})")
        elif not batched:
            ids, mask = ids[0], mask[0]
        out = {"input_ids": ids}
        if return_attention_mask:
            out["attention_mask"] = mask
        return out

    def encode_plain(self, text: str) -> list[int]:
        """`text` as plain text: special-token text in it ("<|eot_id|>", the mask token) is encoded
        as the characters it is made of, never as the special token."""
        if getattr(self, "_plain", None) is None:
            self._plain = FastTokenizer.from_str(self.fast.to_str())
            self._plain.encode_special_tokens = True
        return self._plain.encode(check_text(text), add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> list[int]:
        """The conversation rendered with the chat template and encoded. The template's own text is
        encoded with its special tokens; each message's content as plain text (`encode_plain`), so
        that what a user writes cannot forge a turn (`<|eot_id|><|start_header_id|>system...`) or
        put a mask token into the prompt (a content may be a list of parts: its text parts are
        encoded so, its image parts are what the template writes for them). A template that
        changes contents other than by trimming them falls back to encoding the rendered text as
        a whole."""
        text = self.render_chat(messages, add_generation_prompt, tools=tools)
        salt = secrets.token_hex(8)
        contents, marked_messages = [], []  # each content's text (a string, or a list's text parts) marked
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                contents.append(content)
                m = {**m, "content": _mark(len(contents) - 1, salt)}
            elif isinstance(content, list):
                parts = []
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                        contents.append(part["text"])
                        part = {**part, "text": _mark(len(contents) - 1, salt)}
                    parts.append(part)
                m = {**m, "content": parts}
            marked_messages.append(m)
        marks = [_mark(i, salt) for i in range(len(contents))]
        marked = self.render_chat(marked_messages, add_generation_prompt, tools=tools)
        parts, kept, rest = [], [], marked
        for mark, content in zip(marks, contents):
            if mark not in marked:  # the template leaves it out
                continue
            if rest.count(mark) != 1 or marked.count(mark) != 1:  # out of order, or rendered more than once
                return self.encode(text, add_special_tokens=False)
            head, rest = rest.split(mark)
            parts.append(head)
            kept.append(content)
        contents = kept
        for form in (lambda c: c, str.strip):
            if "".join(p + form(c) for p, c in zip(parts, contents)) + rest == text:
                ids = []
                for p, c in zip(parts, contents):
                    ids += self.encode(p, add_special_tokens=False) + self.encode_plain(form(c))
                return ids + self.encode(rest, add_special_tokens=False)
        return self.encode(text, add_special_tokens=False)

    # ---- files ------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.fast.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")
        special = {k: self.config[k] for k in ("bos_token", "eos_token", "pad_token") if k in self.config}
        (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _mark(i: int, salt: str) -> str:
    """A stand-in for the i-th content text in a rendering (`Tokenizer.encode_chat`)."""
    return f"\x00content{i}-{salt}\x00"


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: None-valued keys dropped, and a
    reasoning given under any of its names also under `reasoning_content` and `thinking`."""
    out = []
    for m in messages:
        m = {k: v for k, v in dict(m).items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _generation_tag():
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
        renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


GenerationTag = _generation_tag()


def render_template(
    template: str, messages: list[dict], add_generation_prompt: bool = True, tools=None, documents=None, **context
) -> str:
    """A chat template rendered in transformers' environment, without transformers. A tool given as
    a Python function reaches the template as its JSON schema, as transformers makes it
    (`tool_schema.function_schema`)."""
    from .tool_schema import as_tool_schemas

    return compiled_template(template).render(
        messages=messages,
        tools=as_tool_schemas(tools),
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **context,
    )


@functools.lru_cache(maxsize=32)
def compiled_template(template: str):
    """A template compiled once in transformers' environment (compiling costs ~10 ms, rendering well
    under one; transformers caches its compiled templates too)."""
    import jinja2.ext

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationTag]
    )

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(template)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _qwen2_bpe(folder: Path) -> FastTokenizer:
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    for f in (vocab, merges):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (a byte-level BPE tokenizer needs vocab.json and merges.txt)")
    tok = FastTokenizer(BPE.from_file(str(vocab), str(merges), unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added_path = folder / "added_tokens.json"
    if added_path.is_file():
        added = _read_json(added_path)
        for content, _id in sorted(added.items(), key=lambda kv: kv[1]):
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
            if tok.token_to_id(content) != _id:
                raise ValueError(
                    f"{added_path}: token {content!r} should have id {_id}, got {tok.token_to_id(content)}"
                )
    return tok


def load_tokenizer(folder: str | Path) -> Tokenizer:
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    if (folder / "tokenizer.json").is_file():
        try:
            fast = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise ValueError(f"{folder / 'tokenizer.json'}: cannot be read ({e})") from None
    elif (folder / "vocab.json").is_file():
        fast = _qwen2_bpe(folder)
    else:
        raise FileNotFoundError(f"{folder}: no tokenizer.json nor vocab.json + merges.txt")
    # added_tokens_decoder in tokenizer_config.json marks specials that tokenizer.json may lack.
    for _id, spec in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
        if fast.token_to_id(spec["content"]) is None:
            fast.add_special_tokens([AddedToken(spec["content"], special=True, normalized=False)])
    return Tokenizer(fast, config)
