"""`GenerationConfig`: every decoding option, declared once.

Each field carries its help text and its kind (how a string from a command line or a model_args
string becomes a value). The CLI flags (`commands.args.add_generation_args`), the server's request
fields and the lm-eval plugin's parsing are all generated from these declarations, and
validation raises `ConfigError`, a `ValueError` that names the parameter in `.param`.

The modules: `generation` (the fields and what a config does), `names` (the names and bounds fields
take, `ConfigError`), `rules` (the rules that join fields), `presets` (the published decoders'
configs and preset files) and `fitting` (a config for a model and a call; transformers' names).
"""

from .generation import GenerationConfig
from .names import (
    CACHE_POLICIES,
    LOGPROB_FLOOR,
    MAX_LOGPROBS,
    PROPOSALS,
    REFRESH_RULES,
    SELECTION_RULES,
    ConfigError,
    Names,
    is_int,
    selection_rule_name,
)
from .presets import PRESET_FORMAT, PRESETS, read_preset, register_preset

__all__ = [
    "CACHE_POLICIES",
    "LOGPROB_FLOOR",
    "MAX_LOGPROBS",
    "PRESETS",
    "PRESET_FORMAT",
    "PROPOSALS",
    "REFRESH_RULES",
    "SELECTION_RULES",
    "ConfigError",
    "GenerationConfig",
    "Names",
    "is_int",
    "read_preset",
    "register_preset",
    "selection_rule_name",
]
