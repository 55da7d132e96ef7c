"""The names and kinds a config's fields take: the policy names configs may give (`Names`, which
the engine's registries extend), the constants that bound fields, `ConfigError`, and the
declaration of a field (`_opt`) with the predicates its checks use."""

from __future__ import annotations

from dataclasses import field
from typing import Any


# The names a config may give each kind of policy; the classes they name are the engine's
# (`engine.registry`), which adds the name of every class registered there.
class Names:
    """The names configs may give one kind of policy: the built-in ones, and those a policy class
    adds as it registers (`engine.registry.Registry.register`, a user's policy included), so that
    reading and validating a config needs no torch."""

    def __init__(self, kind: str, builtins: tuple[str, ...]):
        self.kind = kind
        self._names = list(builtins)

    def __contains__(self, name) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(list(self._names))

    def add(self, name: str) -> None:
        if name not in self._names:
            self._names.append(name)


CACHE_POLICIES = Names("cache", ("none", "prefix", "dual", "sub-block", "delayed"))
REFRESH_RULES = Names("refresh", ("full", "vicinity", "adaptive"))
SELECTION_RULES = Names(
    "unmasking",
    (
        "threshold",
        "factor",
        "linear",
        "dream_schedule",
        "quota",
        "entropy",
        "left_to_right",
        "rnd1",
        "entropy_bound",
        "wedlm",
        "linear_spec",
    ),
)
# A model family's own proposal (`DecodingRules.proposal`).
PROPOSALS = Names("proposal", ("sdar", "fast_dllm_v2", "llada2", "rnd1", "nemotron_labs_diffusion"))
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def selection_rule_name(config) -> str:
    """The selection rule a config means: `unmasking` when given; else `factor` when set (it takes
    precedence), else `threshold`, else the step schedule (LLaDA's linear one; Dream's timesteps
    when `alg` is set)."""
    if config.unmasking is not None:
        return config.unmasking
    if config.factor is not None:
        return "factor"
    if config.threshold is not None:
        return "threshold"
    return "linear" if config.alg is None else "dream_schedule"


REMASKING = ("low_confidence", "random")
# Selection rules whose reference decodes the whole answer as one block (`GenerationConfig.one_block`).
ONE_BLOCK_RULES = ("rnd1", "dream_schedule")
# Prompt K/V shared across rows and requests (`engine.kv.prefix`): where exact (block-causal
# attention), also where approximate (bidirectional), or never.
PREFIX_CACHE = ("exact", "approximate", "off")
MIN_TEMPERATURE = 1e-3  # below it, dividing float32 logits overflows
NONE_WORDS = ("none", "off", "null")


def is_int(value) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


LOGPROBS_MODES = ("processed", "raw")
# The most top tokens a generated token's log-probability reports (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20
# The log-probability reported for a token that cannot be drawn (filtered out by top_p, top_k or a
# grammar: -inf), as vLLM reports it: JSON has no infinity.
LOGPROB_FLOOR = -9999.0


class ConfigError(ValueError):
    """An invalid decoding option; `.param` is the field's name."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.detail = param, message


def parse_value(name: str, kind: str, text: Any) -> Any:
    """The value of field `name`, of `kind`, from text ("none"/"off"/"null" for None where allowed);
    non-strings are returned as they are. A ConfigError names the field when the text does not parse."""
    if not isinstance(text, str):
        return text
    optional = kind.startswith("optional ")
    base = kind.removeprefix("optional ")
    if optional and text.strip().lower() in NONE_WORDS:
        return None
    if base == "fixed":  # one POS:TEXT; the CLI's repeated --fix adds them up
        pos, sep, value = text.partition(":")
        if not sep or not pos.strip().isdigit():
            raise ConfigError(name, f"expected POS:TEXT (an answer position, a colon, the text), got {text!r}")
        return ((int(pos), value),)
    try:
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
        if base == "bool":
            low = text.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
    except ValueError:
        raise ConfigError(name, f"expected {kind.replace('optional ', 'an optional ')}, got {text!r}") from None
    return text


def _opt(default, kind: str, help: str, server: bool = True, search: tuple = (), row: bool = False, checks: tuple = ()):
    """A field: `kind` is int | float | str | bool, prefixed with "optional " when None is allowed;
    `server` says whether an API request may set it under this name; `search` lists the values
    `fastdllm tune` tries for it (a speed knob; empty: tune leaves the field as given); `row` that
    it decides only what a row reveals, not what a forward computes, so rows that differ in it
    share forwards (`engine.rows.join_key`); `checks`, the field's own rules, (predicate, what is
    allowed) pairs that `validate` applies to a value that is not None (the rules that join fields
    are `validate`'s)."""
    meta = {"kind": kind, "help": help, "server": server, "search": search, "row": row, "checks": checks}
    return field(default=default, metadata=meta)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


def _positive_int(v) -> bool:
    return is_int(v) and v > 0


def _unit_interval(v) -> bool:
    return _is_num(v) and 0 <= v <= 1


def _zero_or_warm(v) -> bool:
    """A temperature that dividing float32 logits by does not overflow (0: none)."""
    return v == 0 or v >= MIN_TEMPERATURE


def _above(lo):
    return lambda v: _is_num(v) and v > lo


def _finite_at_least(lo):
    return lambda v: _is_num(v) and _finite(v) and v >= lo


def _one_of(names):
    return lambda v: v in names
