"""Text in, text out: `generate_text` for one prompt, a batch, or a chat.

    text = fastdllm.generate_text(model, tokenizer, "Question: ...\\nAnswer:", max_new_tokens=64).text
    reply = fastdllm.generate_text(model, tokenizer, messages=[{"role": "user", "content": "hi"}])

A plain prompt is continued as it is (no chat template), as transformers' text-generation
pipeline does with a string; `messages` (a conversation, or a list of them) go through the
tokenizer's chat template. `max_new_tokens` is rounded up to whole blocks for decoding and the
text cut back to that many tokens, as the server does with `max_tokens`. Every other keyword is a
`GenerationConfig` field (`threshold=0.7`, `cache="prefix"`, ...), applied over `config`.

Infilling: `fixed={5: " apples"}` fixes text at answer positions, `suffix="..."` gives the text
after the answer (LLaDA, Dream); the texts are encoded as written:

    fastdllm.generate_text(model, tokenizer, "The sky is", suffix=" and the grass is green.")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import GenerationConfig
from ..text.completion import complete
from ..text.images import split_images
from ..text.infill import encode_infill
from .generation import generate


@dataclass
class TextOutput:
    text: str
    num_tokens: int  # generated tokens the text accounts for
    finish_reason: str  # "stop" (a stop token or string) or "length"
    nfe: int  # forward passes this prompt needed
    tokens_per_second: float  # of the whole call
    positions_per_token: float  # of the whole call: forward positions per generated token


def generate_text(
    model,
    tokenizer,
    prompt: str | Sequence[str] | None = None,
    *,
    messages=None,
    max_new_tokens: int | None = None,
    config: GenerationConfig | None = None,
    stop: Sequence[str] | None = None,
    **options,
) -> TextOutput | list[TextOutput]:
    """Generate text for a prompt (or a list of prompts), or for `messages` (a conversation or a
    list of them; a model that reads images takes image parts in them: `text.images.split_images`).
    Returns one TextOutput, or a list when given a list."""
    if (prompt is None) == (messages is None):
        raise ValueError("prompt: give either a prompt (text) or messages (a conversation), not both or neither")
    if messages is not None:
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        if not conversations or not all(isinstance(c, (list, tuple)) and c for c in conversations):
            raise ValueError("messages: a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: this tokenizer has no chat template; pass a plain prompt")
        split = [split_images(list(c)) for c in conversations]
        ids = [tokenizer.encode_chat(c) for c, _ in split]
        images = [imgs for _, imgs in split] if any(imgs for _, imgs in split) else None
    else:
        images = None
        single = isinstance(prompt, str)
        texts = [prompt] if single else list(prompt)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt: a string or a non-empty list of strings")
        ids = [tokenizer.encode(t) for t in texts]

    def apply(c: GenerationConfig) -> GenerationConfig:
        return c.replace(**options) if max_new_tokens is None else c.with_max_new_tokens(max_new_tokens, **options)

    config = apply(config) if config is not None else GenerationConfig.for_call(model, apply)
    keep = max_new_tokens if max_new_tokens is not None else config.gen_length
    config = encode_infill(config, tokenizer, model.mask_token_id, keep)
    out = generate(model, ids, config=config, images=images)
    results = []
    for i, row in enumerate(out.sequences.tolist()):
        c = complete(tokenizer, row[:keep], model.stop_token_ids, stop, config.fixed_end)
        reason = c.finish_reason if c.finish_reason == "stop" or keep >= config.gen_length else "length"
        results.append(
            TextOutput(
                c.text, c.num_tokens, reason, int(out.nfe_per_row[i]), out.tokens_per_second, out.positions_per_token
            )
        )
    return results[0] if single else results
