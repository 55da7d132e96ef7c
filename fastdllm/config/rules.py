"""The rules that join fields of a `GenerationConfig`, grouped by what they concern (each field's own
rules are declared beside it, `checks`). Each raises a `ConfigError` naming the parameter and what
is allowed."""

from __future__ import annotations

from .names import ConfigError, _above, _finite, _is_num, is_int


def need(ok: bool, config, name: str, allowed: str, got=None) -> None:
    """A ConfigError naming `name` unless `ok`; `got`: the offending part, in words, where the
    field's whole value is not it."""
    if not ok:
        raise ConfigError(name, f"{allowed} (got {got if got is not None else repr(getattr(config, name))})")


def check_schedule(config) -> None:
    """The answer's blocks and steps, and the temperature schedule of a renoising canvas."""
    need(
        config.gen_length % config.block_length == 0,
        config,
        "block_length",
        f"must divide gen_length={config.gen_length}",
    )
    if config.steps is not None:
        need(is_int(config.steps), config, "steps", "must be an integer or None")
        if config.one_block:  # RND1's schedule: more steps than masks is a slower reveal, as there
            need(config.steps >= 1, config, "steps", "must be at least 1")
        else:
            need(
                config.num_blocks <= config.steps <= config.gen_length,
                config,
                "steps",
                f"must be between the number of blocks ({config.num_blocks}) and gen_length ({config.gen_length})",
            )
    need(_is_num(config.t_max) and config.t_max > config.t_min, config, "t_max", f"must be > t_min={config.t_min}")


def check_selection(config) -> None:
    """The selection rule and its parameters; greedy-only calibration."""
    if config.threshold is not None and config.unmasking in ("entropy", "wedlm"):  # an entropy, in nats
        need(_above(0)(config.threshold) and _finite(config.threshold), config, "threshold", "must be > 0 (nats)")
    elif config.threshold is not None:
        need(_is_num(config.threshold) and 0 < config.threshold <= 1, config, "threshold", "must be in (0, 1] or None")
    for rule in ("threshold", "factor"):  # the rule named needs its parameter
        need(
            config.unmasking != rule or getattr(config, rule) is not None,
            config,
            rule,
            f"unmasking={rule} needs a {rule}",
        )
    need(
        config.unmasking != "entropy" or config.threshold is not None,
        config,
        "threshold",
        "unmasking=entropy needs a threshold (an entropy, in nats)",
    )
    if config.unmasking in ("wedlm", "linear_spec"):  # its window moves by positions: blocks of one
        need(
            config.block_length == 1,
            config,
            "block_length",
            f"must be 1 with unmasking={config.unmasking} (its window slides by positions)",
        )
        need(
            config.parallel_blocks == 1,
            config,
            "parallel_blocks",
            f"must be 1 with unmasking={config.unmasking} (its window is window_size)",
        )
    need(config.stop_at_eos or not config.eos_early_stop, config, "eos_early_stop", "needs stop_at_eos")
    need(
        config.confidence_temperature == 1 or config.temperature == 0,
        config,
        "confidence_temperature",
        "needs greedy decoding (temperature 0): sampled tokens would be drawn twice",
    )


def check_blocks_and_cache(config) -> None:
    """Sub-blocks, several blocks at once, and what the cache policy needs."""
    if config.sub_block_length is not None:
        need(
            is_int(config.sub_block_length)
            and config.sub_block_length >= 1
            and config.block_length % config.sub_block_length == 0,
            config,
            "sub_block_length",
            f"must be a positive integer dividing block_length={config.block_length}, or None",
        )
    need(
        config.cache != "sub-block" or config.sub_block_length is not None,
        config,
        "cache",
        "'sub-block' needs sub_block_length",
    )
    need(
        config.parallel_blocks == 1 or (config.sub_block_length is None and config.cache != "sub-block"),
        config,
        "parallel_blocks",
        "sub-block decoding (sub_block_length) reveals one block at a time: use parallel_blocks=1",
    )
    need(
        config.prefill_chunk is None or (is_int(config.prefill_chunk) and config.prefill_chunk >= config.block_length),
        config,
        "prefill_chunk",
        f"must be None or an integer >= block_length ({config.block_length})",
    )


def check_editing(config) -> None:
    """LLaDA2.1's editing and what rides on it (DMax's stop and soft embeddings)."""
    if config.stop_confidence is not None:
        need(config.editing_threshold is not None, config, "stop_confidence", "needs editing (editing_threshold)")
        need(
            config.parallel_blocks == 1, config, "stop_confidence", "decides one block at a time: use parallel_blocks=1"
        )
    need(
        not config.soft_embeddings or config.editing_threshold is not None,
        config,
        "soft_embeddings",
        "needs editing (editing_threshold): the fed-back positions are the ones a step may revise",
    )
    need(
        not config.soft_embeddings or config.parallel_blocks == 1,
        config,
        "soft_embeddings",
        "not with parallel_blocks > 1",
    )


def check_infill(config) -> None:
    """Fixed tokens inside the answer and a suffix after it."""
    for pos, value in config.fixed:
        need(is_int(pos) and pos >= 0, config, "fixed", "positions must be integers >= 0", got=f"position {pos!r}")
        need(
            (isinstance(value, str) and value != "")
            or (isinstance(value, tuple) and value and all(is_int(t) for t in value)),
            config,
            "fixed",
            f"at {pos}: a non-empty text or token ids",
            got=repr(value),
        )
        need(
            pos < config.gen_length,
            config,
            "fixed",
            f"positions must be below gen_length={config.gen_length}",
            f"{pos}",
        )
        if not isinstance(value, str):
            need(
                pos + len(value) <= config.gen_length,
                config,
                "fixed",
                f"at {pos}: beyond gen_length={config.gen_length}",
                got=f"{len(value)} tokens",
            )
    spans = [(p, p + len(v)) for p, v in config.fixed if not isinstance(v, str)]
    for (a, a_end), (b, _) in zip(spans, spans[1:]):
        need(a_end <= b, config, "fixed", f"the spans at {a} and {b} overlap", got=f"the span at {a} ends at {a_end}")
    if config.suffix is not None:
        need(
            (isinstance(config.suffix, str) and config.suffix != "")
            or (isinstance(config.suffix, tuple) and config.suffix and all(is_int(t) for t in config.suffix)),
            config,
            "suffix",
            "must be a non-empty text, token ids, or None",
        )


# the cross-field rules `GenerationConfig.validate` applies, in order
CROSS_FIELD = (check_schedule, check_selection, check_blocks_and_cache, check_editing, check_infill)
