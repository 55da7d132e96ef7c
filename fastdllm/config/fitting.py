"""A config for a model and a call: what the model's family needs and its checkpoint names
(`GenerationConfig.for_model`, `for_call`, `fit_to_model`), and transformers' keywords read as ours
(`from_transformers_names`)."""

from __future__ import annotations

from .names import ConfigError, is_int


def for_model(
    cls,
    model,
    base=None,
    checkpoint_defaults: bool = True,
    **overrides,
):
    """`base` (default: the defaults) with the checkpoint's own generation defaults (Dream's
    generation_config.json: alg, eps, temperature, ...) and what the model needs (a
    block-causal model's block length and exact cache, `Family.decoding_defaults`; the
    `block_length` a checkpoint's generation_config.json names) in the fields `overrides`
    leave unset. `checkpoint_defaults=False`: only what the family needs
    (what `generate` and friends use when given no config). Without `base`, a checkpoint
    trained for a decoder of its own (`model.decoding`, recognised by its name) starts from
    that decoder's preset."""
    family = getattr(model, "family", None)
    names = family.generation_defaults if family is not None and checkpoint_defaults else ()
    found = getattr(model, "generation_config", None) or {}
    checkpoint = {k: found[k] for k in names if k in found}
    needed = family.decoding_defaults(model.args) if family is not None else {}
    recognized = getattr(model, "decoding", None)  # a checkpoint trained for its own decoder
    base = base or (cls.preset(recognized) if recognized else cls())
    if "block_length" not in needed:
        needed.update(_own_block(model, overrides.get("gen_length", base.gen_length)))
    if "unmasking" in needed and ({"unmasking", "factor"} & set(overrides) or base.factor is not None):
        del needed["unmasking"]  # a rule the caller chose wins over the family's
    if overrides.get("parallel_blocks", base.parallel_blocks) > 1:
        needed = _one_block_fields_dropped(needed)
    return base.replace(**{**needed, **checkpoint, **overrides})


def for_call(cls, model, apply):
    """The config of a call given no config (`generate`, `generate_text`): what the model
    needs (`for_model` without the checkpoint's sampling defaults), changed by `apply` (the
    call's keywords). A block length of the checkpoint's own yields to the default where the
    keywords ask for an answer that does not hold whole blocks of it (`gen_length=32` on a
    checkpoint of blocks of 64)."""
    config = for_model(cls, model, checkpoint_defaults=False)
    try:
        return apply(config)
    except ConfigError as e:
        if e.param != "block_length" or not _own_block(model, config.gen_length):
            raise
        return apply(config.replace(block_length=cls().block_length))


def fit_to_model(config, model, keep=(), own_block: bool = False):
    """This config (a named preset) with what the model's family needs (a block-diffusion
    model's block length, and its exact cache where the config has a cache), but for the
    fields in `keep` (the ones a user gave). `own_block`: also the block length the checkpoint
    names (the default preset takes it; a published method's preset keeps its own)."""
    family = getattr(model, "family", None)
    needed = family.decoding_defaults(model.args) if family is not None else {}
    if own_block and "block_length" not in needed:
        needed.update(_own_block(model, config.gen_length))
    if config.unmasking is not None and config.unmasking != needed.get("unmasking"):
        needed.pop("unmasking", None)  # a preset that names its own rule (dParallel's, DMax's) keeps it
    if config.cache == "none":
        needed = {k: v for k, v in needed.items() if k not in ("cache", "refresh", "refresh_every", "suffix_window")}
    if config.parallel_blocks > 1:
        needed = _one_block_fields_dropped(needed)
    return config.replace(**{k: v for k, v in needed.items() if k not in keep})


def _own_block(model, gen_length) -> dict:
    """{"block_length": N} where the checkpoint's generation_config.json names the block length N
    its answers were trained in and an answer of `gen_length` holds whole blocks of it, else {}."""
    own = (getattr(model, "generation_config", None) or {}).get("block_length")
    return {"block_length": own} if is_int(own) and own > 0 and is_int(gen_length) and gen_length % own == 0 else {}


def _one_block_fields_dropped(needed: dict) -> dict:
    """A family's decoding defaults for multi-block decoding: without its sub-blocks (Fast-dLLM
    v2's), which reveal one block at a time; the caller asked for several."""
    return {k: v for k, v in needed.items() if k != "sub_block_length" and not (k == "cache" and v == "sub-block")}


# ---- transformers' names -------------------------------------------------------------------------
# transformers' GenerationConfig / generate() keywords that have a meaning for diffusion decoding,
# and those that do not (a ConfigError that names the field and says what to use).
TRANSFORMERS_REFUSED = {
    "max_length": "a dLLM's answer region is fixed before decoding starts: use max_new_tokens (or gen_length)",
    "min_length": "use gen_length",
    "min_new_tokens": "use gen_length",
    "num_beams": "diffusion decoding has no beam search",
    "repetition_penalty": "not supported by diffusion decoding (every position is decoded at once)",
    "no_repeat_ngram_size": "not supported by diffusion decoding",
    "num_return_sequences": "pass it to fastdllm.generate(..., num_return_sequences=N), which repeats each prompt",
    "eos_token_id": "stop tokens come from the model and tokenizer (model.stop_token_ids)",
    "pad_token_id": "padding comes from the tokenizer; pass an attention_mask for left-padded input",
}


def from_transformers_names(fields: dict, default_block_length: int) -> dict:
    """`fields` with transformers' keywords mapped onto ours: `max_new_tokens=n` (gen_length n
    rounded up to whole blocks, as `GenerationConfig.with_max_new_tokens`; text front ends cut the
    answer back to n), `do_sample=False` (temperature 0: greedy) / `do_sample=True` (temperature
    1.0, transformers' default, unless a temperature > 0 is given). Keywords with no meaning
    here raise a ConfigError naming them."""
    fields = dict(fields)
    for name, why in TRANSFORMERS_REFUSED.items():
        if name in fields:
            raise ConfigError(name, why)
    if "do_sample" in fields:
        sample = fields.pop("do_sample")
        if not isinstance(sample, bool):
            raise ConfigError("do_sample", f"must be true or false (got {sample!r})")
        temperature = fields.get("temperature")
        if not sample:
            if temperature not in (None, 0, 0.0):
                raise ConfigError(
                    "do_sample", f"do_sample=False decodes greedily; it contradicts temperature={temperature}"
                )
            fields["temperature"] = 0.0
        elif temperature in (None, 0, 0.0):
            if temperature is not None:
                raise ConfigError("do_sample", "do_sample=True needs a temperature > 0")
            fields["temperature"] = 1.0
    if "max_new_tokens" in fields:
        n = fields.pop("max_new_tokens")
        if not is_int(n) or n < 1:
            raise ConfigError("max_new_tokens", f"must be a positive integer (got {n!r})")
        if "gen_length" in fields:
            raise ConfigError("max_new_tokens", "give max_new_tokens or gen_length, not both")
        block = fields.get("block_length", default_block_length)
        if is_int(block) and block >= 1:
            fields["gen_length"] = -(-n // block) * block
    return fields
