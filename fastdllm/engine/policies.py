"""The policies one generation decodes with, built in one place.

`policies_for(model, config)` turns a config into the loop's two policy objects: the cache
policy (`cache`: which window each step recomputes, and its refresh rule) and the
unmasking strategy (`decode`: the proposal and the selection rule; `decode.renoising` for a canvas with
no mask token, `wedlm` for WeDLM's sliding window), with the model family's own rules applied
(Dream's block start with a cache).
Callers that bring their own objects pass them one way, as `policies=`, wherever a config goes
(`generate`, `iter_generate`, `stream_blocks`, `evaluate`, the server's scheduler): a `Policies`
bundle, where a field left None is the one the config names (`Policies(cache=MyCache(model))`), or a
callable `(model, config) -> Policies`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import GenerationConfig, selection_rule_name
from .cache import CachePolicy, cache_policy, configure
from .decode import RenoisingStrategy, UnmaskingStrategy, WeDLMStrategy


@dataclass
class Policies:
    """The loop's two policy objects; None: the one the config names."""

    cache: CachePolicy | None = None
    strategy: UnmaskingStrategy | None = None


PolicySource = Policies | Callable[..., Policies] | None


def policies_for(
    model, config: GenerationConfig, cache: CachePolicy | None = None, strategy: UnmaskingStrategy | None = None
) -> Policies:
    """The policies `config` names (either one replaced by the object given, which takes the
    config's engine settings all the same: `cache.configure`). The family's rule
    applies to a strategy built from the config: a Dream model decoding with a block cache, and a
    Fast-dLLM v2 model always, reveal each block's first position at its block-start step, as
    their reference code does; `sub_block_length` reveals blocks sub-block by sub-block."""
    cache = configure(cache, config) if cache is not None else cache_policy(model, config)
    if strategy is None and selection_rule_name(config) == "entropy_bound":  # a canvas with no mask
        strategy = RenoisingStrategy.from_config(config)
    if strategy is None and selection_rule_name(config) == "wedlm":  # a sliding window
        strategy = WeDLMStrategy.from_config(config)
    if strategy is None:
        family = getattr(model, "family", None)
        strategy = UnmaskingStrategy.from_config(config, family.rules if family is not None else None)
        if config.sub_block_length is not None:
            strategy = strategy.in_sub_blocks(config.sub_block_length)
        # Dream's rule belongs to its cached loops; a block-causal family's (Fast-dLLM v2's) to every loop
        if (
            family is not None
            and family.rules.block_start_reveals_first
            and (model.args.block_size or cache.refreshes_at_block_start)
        ):
            strategy = strategy.revealing_first_at_block_start()
    return Policies(cache, strategy)


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
