"""The policies one generation decodes with, built in one place.

`policies_for(model, config)` turns a config into the loop's two policy objects: the cache
policy (`cache`: which window each step recomputes, and its refresh rule) and the decoder
(`decode`: a `Decoder` registered for the config's selection rule, `decode.renoising` for a canvas
with no mask token, `wedlm` for WeDLM's sliding window, else the masked decoder with its proposal
and selection rule), with the model family's own rules applied (Dream's block start with a cache).
Callers that bring their own objects pass them one way, as `policies=`, wherever a config goes
(`generate`, `iter_generate`, `stream_blocks`, `evaluate`, the server's scheduler): a `Policies`
bundle, where a field left None is the one the config names (`Policies(cache=MyCache(model))`), or a
callable `(model, config) -> Policies`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import GenerationConfig, selection_rule_name
from .cache import CachePolicy, cache_policy
from .decode import DECODERS, Decoder, UnmaskingStrategy, check_canvas


@dataclass
class Policies:
    """The loop's two policy objects; None: the one the config names."""

    cache: CachePolicy | None = None
    strategy: Decoder | None = None


PolicySource = Policies | Callable[..., Policies] | None


def policies_for(
    model, config: GenerationConfig, cache: CachePolicy | None = None, strategy: Decoder | None = None
) -> Policies:
    """The policies `config` names (either one replaced by the object given; the config's engine
    settings, compiled, batch-invariant or graphed forwards, are the loop's own). The decoder is the one registered
    for the config's selection rule (`decode.DECODERS`; the masked decoder otherwise), built with
    the model's family rules; the cache policy learns from it whether a block-start step reveals the
    block's first position (its windows then open at the block)."""
    check_canvas(model, config)
    check_block_length(model, config)
    check_engine_settings(model, config)
    cache = cache if cache is not None else cache_policy(model, config)
    if strategy is None:
        strategy = DECODERS.get(selection_rule_name(config), UnmaskingStrategy).from_config(config, model, cache)
    cache.block_start_reveals_first = strategy.reveals_first_at_block_start
    return Policies(cache, strategy)


def check_block_length(model, config: GenerationConfig) -> None:
    """A block-causal model decodes in its own blocks, unless its family's reference builds the
    attention mask from the decoding block (`DecodingRules.any_decoding_block`)."""
    family = getattr(model, "family", None)
    if (
        model.args.block_size
        and config.block_length != model.args.block_size
        and not (family is not None and family.rules.any_decoding_block)
    ):
        raise ValueError(
            f"block_length: must be {model.args.block_size} for this model, whose attention is "
            f"block-causal in blocks of {model.args.block_size} (got {config.block_length})"
        )


def check_engine_settings(model, config: GenerationConfig) -> None:
    """`cuda_graphs` where the model has a fixed-shape step (`Transformer.captures_steps`), else a
    ValueError naming the field (every model compiles)."""
    name = getattr(getattr(model, "family", None), "name", "this model")
    if config.cuda_graphs and not getattr(model, "captures_steps", True):
        raise ValueError(f"cuda_graphs: not for {name} (its masks attend in an order its tokens decide)")


def brings_decoder(source: PolicySource) -> bool:
    """Whether a caller's policies bring a decoder object (or a factory of one) that then decides
    for every row; otherwise each row decides with the decoder its own config names."""
    return source is not None and not (isinstance(source, Policies) and source.strategy is None)


def resolve(source: PolicySource, model, config: GenerationConfig) -> Policies:
    """A whole bundle from what a caller passed: a bundle (its None fields the config's own), a
    factory called with (model, config), or None for the config's own policies."""
    if source is None:
        return policies_for(model, config)
    if not isinstance(source, Policies):
        source = source(model, config)
        if not isinstance(source, Policies):
            raise ValueError(f"policies: the factory returned {type(source).__name__}, not a Policies bundle")
    return policies_for(model, config, source.cache, source.strategy)
