"""Infilling's text, as token ids: the `fixed` texts and the `suffix` of a `GenerationConfig`.

The loop works on token ids (`engine.decoder`); the front ends that hold a tokenizer (generate_text,
the CLI, the server, the lm-eval plugin, the demo) encode a config's texts here, once per request,
and every mistake a text can make is refused here with the field's name.
"""

from __future__ import annotations

from ..config import ConfigError, GenerationConfig


def encode_infill(
    config: GenerationConfig, tokenizer, mask_token_id: int | None = None, limit: int | None = None
) -> GenerationConfig:
    """`config` with its fixed texts and suffix as token ids, each encoded as written (no special
    tokens added). A fixed text of several tokens takes the positions after its own. `limit`: the
    answer's positions a fixed token may take (default gen_length; the server's max_tokens).
    ConfigError (`fixed` / `suffix`): a text that encodes to nothing or holds the mask token, a span
    past the limit, spans that overlap."""
    if not config.fixed and not isinstance(config.suffix, str):
        return config
    limit = config.gen_length if limit is None else limit
    mask = mask_token_id
    fixed = []
    for pos, value in config.fixed:
        ids = tokenizer.encode(value, add_special_tokens=False) if isinstance(value, str) else list(value)
        if not ids:
            raise ConfigError("fixed", f"at {pos}: {value!r} encodes to no tokens")
        if mask is not None and mask in ids:
            raise ConfigError("fixed", f"at {pos}: {value!r} holds the mask token")
        if pos + len(ids) > limit:
            raise ConfigError(
                "fixed",
                f"at {pos}: {value!r} takes {len(ids)} token(s), past the answer's {limit} positions",
            )
        if fixed and fixed[-1][0] + len(fixed[-1][1]) > pos:
            prev = fixed[-1][0]
            raise ConfigError("fixed", f"the text at {prev} runs into the text at {pos} (tokens overlap)")
        fixed.append((pos, tuple(ids)))
    suffix = config.suffix
    if isinstance(suffix, str):
        ids = tokenizer.encode(suffix, add_special_tokens=False)
        if not ids:
            raise ConfigError("suffix", f"{suffix!r} encodes to no tokens")
        if mask is not None and mask in ids:
            raise ConfigError("suffix", "holds the mask token")
        suffix = tuple(ids)
    return config.replace(fixed=tuple(fixed), suffix=suffix)
