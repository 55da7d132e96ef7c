"""`GenerationConfig`: every decoding option, declared once.

Each field carries its help text and its kind (how a string from a command line or a model_args
string becomes a value). The CLI flags (`commands.args.add_generation_args`), the server's request
fields and the lm-eval plugin's parsing are all generated from these declarations, and
validation raises `ConfigError`, a `ValueError` that names the parameter in `.param`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
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
    ),
)
# A model family's own proposal (`DecodingRules.proposal`).
PROPOSALS = Names("proposal", ("sdar", "fast_dllm_v2", "llada2", "rnd1"))
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def selection_rule_name(config: GenerationConfig) -> str:
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


class ConfigError(ValueError):
    """An invalid decoding option; `.param` is the field's name."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.detail = param, message


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


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings, named as in the LLaDA / Fast-dLLM / Dream reference code. Immutable:
    change one with `config.replace(name=value)`, which validates again.

    The defaults go past Fast-dLLM: its full method (DualCache with threshold-0.9 parallel
    decoding, gen_length 256 in blocks of 32) with a suffix window of 32 (forwards see one block
    of the masked tail, after DPad) and the vicinity refresh (a block-start forward recomputes from
    the just-finished block on, after dInfer): the fastest combination measured within a point of
    the baseline's accuracy on the embedded model (docs/results/beyond/). Fast-dLLM exactly as
    published is `GenerationConfig.fast_dllm()`, LLaDA's baseline (no cache, one token per step)
    `GenerationConfig.baseline()`. Without a cache (`cache='none'`) every forward is full and
    `refresh` has no effect. Parallel decoding: `threshold` (unmask all
    positions at or above it) or `factor` (Fast-dLLM's factor rule; takes precedence over
    threshold). With neither, each block follows a fixed schedule of `steps` spread over the
    blocks: LLaDA's linear schedule, or Dream's timestep schedule when `alg` is set.

    `steps` not divisible by the number of blocks: the remainder goes to the first blocks (the
    reference requires divisibility). `steps` defaults to gen_length.
    """

    gen_length: int = _opt(
        256,
        "int",
        "tokens to generate (a multiple of block_length)",
        server=False,
        row=True,
        checks=((_positive_int, "must be a positive integer"),),
    )
    block_length: int = _opt(
        32,
        "int",
        "block size: blocks are decoded left to right",
        search=(8, 16, 32, 64),
        checks=((_positive_int, "must be a positive integer"),),
    )
    steps: int | None = _opt(None, "optional int", "schedule steps over all blocks (default: gen_length)", row=True)
    temperature: float = _opt(
        0.0,
        "float",
        "sampling temperature (0: greedy)",
        server=False,
        row=True,
        checks=(
            (_finite_at_least(0), "must be a finite number >= 0"),
            (_zero_or_warm, f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}"),
        ),
    )
    remasking: str = _opt(
        "low_confidence",
        "str",
        "LLaDA's confidence: " + " | ".join(REMASKING),
        row=True,
        checks=((_one_of(REMASKING), "must be one of " + ", ".join(REMASKING)),),
    )
    threshold: float | None = _opt(
        0.9,
        "optional float",
        "parallel decoding: reveal every position at least this confident (with unmasking=entropy: "
        "at most this entropy, in nats); 'none' for the schedule",
        search=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99),
        row=True,
    )
    factor: float | None = _opt(
        None,
        "optional float",
        "factor-rule parallel decoding (takes precedence)",
        row=True,
        checks=((_above(0), "must be > 0 or None"),),
    )
    cache: str = _opt(
        "dual",
        "str",
        "KV cache policy: " + " | ".join(CACHE_POLICIES),
        search=("none", "prefix", "dual"),
        checks=((_one_of(CACHE_POLICIES), lambda: "must be one of " + ", ".join(CACHE_POLICIES)),),
    )
    unmasking: str | None = _opt(
        None,
        "optional str",
        "the selection rule by name: "
        + " | ".join(SELECTION_RULES)
        + " (default: factor if set, else threshold, else the step schedule)",
        row=True,
        checks=((_one_of(SELECTION_RULES), lambda: "must be None or one of " + ", ".join(SELECTION_RULES)),),
    )
    alg: str | None = _opt(
        None,
        "optional str",
        "Dream's confidence: " + " | ".join(DREAM_ALGS),
        row=True,
        checks=((_one_of(DREAM_ALGS), "must be None or one of " + ", ".join(DREAM_ALGS)),),
    )
    alg_temp: float | None = _opt(
        None,
        "optional float",
        "Dream: sample positions with this temperature",
        row=True,
        checks=(
            (_finite_at_least(0), "must be a finite number >= 0 or None"),
            (_zero_or_warm, f"must be 0 or None (top-k) or at least {MIN_TEMPERATURE:g}"),
        ),
    )
    eps: float = _opt(
        1e-3,
        "float",
        "Dream: the final timestep",
        row=True,
        checks=((lambda v: _is_num(v) and 0 < v < 1, "must be in (0, 1)"),),
    )
    top_p: float | None = _opt(
        None,
        "optional float",
        "nucleus sampling (Dream)",
        server=False,
        row=True,
        checks=((lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1] or None"),),
    )
    top_k: int | None = _opt(
        None,
        "optional int",
        "top-k sampling (Dream)",
        row=True,
        checks=((_positive_int, "must be a positive integer or None"),),
    )
    max_denoising_steps: int = _opt(
        48,
        "int",
        "unmasking=entropy_bound (DiffusionGemma): at most this many steps per canvas",
        row=True,
        checks=((_positive_int, "must be >= 1"),),
    )
    entropy_bound: float = _opt(
        0.1,
        "float",
        "unmasking=entropy_bound: keep the lowest-entropy tokens whose summed entropy less the largest "
        "stays at most this; renoise the rest",
        row=True,
        checks=((_above(0), "must be > 0"),),
    )
    t_min: float = _opt(
        0.4,
        "float",
        "unmasking=entropy_bound: the temperature at a canvas's last step",
        row=True,
        checks=((lambda v: _is_num(v) and v >= 0, "must be >= 0"),),
    )
    t_max: float = _opt(0.8, "float", "unmasking=entropy_bound: the temperature at a canvas's first step", row=True)
    stability_threshold: int = _opt(
        1,
        "int",
        "unmasking=entropy_bound: a canvas may stop once its argmax held this many steps",
        row=True,
        checks=((lambda v: is_int(v) and v >= 0, "must be >= 0"),),
    )
    confidence_threshold: float | None = _opt(
        0.005,
        "optional float",
        "unmasking=entropy_bound: a canvas may stop once its mean entropy (nats) is below this "
        "(none: every canvas takes max_denoising_steps)",
        row=True,
        checks=((_above(0), "must be > 0 or None"),),
    )
    window_size: int = _opt(
        16,
        "int",
        "unmasking=wedlm: a step reveals only among this many positions from the first masked one "
        "(WeDLM's sliding window)",
        checks=((_positive_int, "must be a positive integer"),),
    )
    pos_penalty_factor: float = _opt(
        0.02,
        "float",
        "unmasking=wedlm: a masked position's entropy is raised by this per position after the window's first mask",
        row=True,
        checks=((_finite_at_least(0), "must be a finite number >= 0"),),
    )
    stop_at_eos: bool = _opt(True, "bool", "stop a row once a completed block holds a stop token", row=True)
    eos_early_stop: bool = _opt(
        False,
        "bool",
        "LLaDA2's eos_early_stop (needs stop_at_eos): without editing "
        "(2.0), stop a row inside a block as soon as it holds a stop token with every "
        "position before it revealed; with editing (2.1), after the block, as stop_at_eos; with the "
        "entropy rule over several blocks (d3LLM), every position after a revealed EOS becomes EOS",
        row=True,
    )
    sub_block_length: int | None = _opt(
        None,
        "optional int",
        "reveal a block's positions sub-block by sub-block, left to right (Fast-dLLM v2's small blocks)",
    )
    editing_threshold: float | None = _opt(
        None,
        "optional float",
        "token-to-token editing (LLaDA2.1): a revealed token of the current "
        "block is rewritten when the model's new token differs and is more "
        "confident than this; 'none': no editing",
        search=(None, 0.5, 0.8, 0.95),
        checks=((_unit_interval, "must be in [0, 1] or None"),),
    )
    max_post_steps: int = _opt(
        16,
        "int",
        "with editing: at most this many steps of a block after its last mask",
        checks=((lambda v: is_int(v) and v >= 0, "must be a non-negative integer"),),
    )
    stop_confidence: float | None = _opt(
        None,
        "optional float",
        "with editing: a block ends at the step where every position masked at its start has its most "
        "probable token at least this likely, or that changes nothing, and after at most block_length "
        "steps (DMax's rule); None: LLaDA2.1's (max_post_steps)",
        checks=((lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1]"),),
    )
    soft_embeddings: bool = _opt(
        False,
        "bool",
        "with editing: each revealed position of the block enters the next forward as "
        "p E[token] + (1 - p) E[mask], rescaled to the mixed norm (DMax's soft embeddings)",
    )
    suffix_window: int | None = _opt(
        32,
        "optional int",
        "forwards see only this many positions after the current block (after DPad); 'none': the whole answer region",
        search=(None, 0, 8, 16, 32, 64),
        checks=((lambda v: is_int(v) and v >= 0, "must be a non-negative integer or None"),),
    )
    parallel_blocks: int = _opt(
        1,
        "int",
        "multi-block decoding (after D2F): while the current block is finished, up to this many blocks "
        "in all are decoded in the same forwards (1: one block at a time)",
        search=(1, 2, 3),
        checks=((_positive_int, "must be a positive integer"),),
    )
    block_add_threshold: float = _opt(
        0.5,
        "float",
        "with parallel_blocks > 1: the next block joins the forwards once the block before it has "
        "this fraction of its positions revealed (D2F's block_add_threshold)",
        search=(0.25, 0.5, 0.75),
        row=True,
        checks=((_unit_interval, "must be in [0, 1]"),),
    )
    decoded_token_threshold: float = _opt(
        0.9,
        "float",
        "with parallel_blocks > 1: a later block whose predecessor has this fraction revealed reveals "
        "at least its most confident position each step (D2F's decoded_token_threshold)",
        row=True,
        checks=((_unit_interval, "must be in [0, 1]"),),
    )
    lookahead_threshold: float = _opt(
        0.95,
        "float",
        "with parallel_blocks > 1: a block after the current one reveals the positions more "
        "confident than this (D2F's skip_threshold; stricter than threshold)",
        search=(0.9, 0.95, 0.99),
        row=True,
        checks=((_unit_interval, "must be in [0, 1]"),),
    )
    refresh: str = _opt(
        "vicinity",
        "str",
        "what a cache policy's block-start forward recomputes: "
        + " | ".join(REFRESH_RULES)
        + " (vicinity: from the just-finished block on, after dInfer)",
        search=("full", "vicinity", "adaptive"),
        checks=((_one_of(REFRESH_RULES), lambda: "must be one of " + ", ".join(REFRESH_RULES)),),
    )
    refresh_every: int | None = _opt(
        None,
        "optional int",
        "with refresh=vicinity: a full refresh every N blocks",
        search=(None, 2, 4),
        checks=((_positive_int, "must be a positive integer or None"),),
    )
    cache_delay: int = _opt(
        2,
        "int",
        "with cache=delayed: the forwards a finished block waits, every one of them full, before its "
        "K/V join the cache (d3LLM's cache_delay_iter)",
        checks=((lambda v: is_int(v) and v >= 0, "must be an integer >= 0"),),
    )
    refresh_interval: int | None = _opt(
        None,
        "optional int",
        "with cache=delayed: a full forward every N forwards of a row (d3LLM's refresh_interval)",
        checks=((_positive_int, "must be a positive integer or None"),),
    )
    refresh_tol: float = _opt(
        0.1,
        "float",
        "with refresh=adaptive: the relative change of the just-finished "
        "block's keys above which a row is refreshed fully",
        checks=((_finite_at_least(0), "must be a finite number >= 0"),),
    )
    prefix_cache: str = _opt(
        "exact",
        "str",
        "share prompt K/V across rows and requests, block by block: "
        + " | ".join(PREFIX_CACHE)
        + " (exact: where a prompt block's K/V depend on it alone, block-causal models; "
        "approximate: bidirectional models too, like Fast-dLLM's prefix cache)",
        search=("exact", "approximate"),
        checks=((_one_of(PREFIX_CACHE), "must be one of " + ", ".join(PREFIX_CACHE)),),
    )
    prefill_chunk: int | None = _opt(
        2048,
        "optional int",
        "a block-causal model's prompt longer than this (and not found in the prefix cache) is "
        "computed this many positions (whole blocks) per step, in the forwards of the rows already "
        "decoding, before its row starts decoding, so that a long prompt does not stall them "
        "(chunked prefill); None: in one forward",
        row=True,
    )
    confidence_temperature: float = _opt(
        1.0,
        "float",
        "divide the logits by this where the selection rule reads confidences, not where tokens are "
        "chosen (a calibrated view for benchmarks: `fastdllm bench --calibrate`); greedy decoding only",
        server=False,
        row=True,
        checks=((lambda v: _is_num(v) and _finite(v) and v > 0, "must be a finite number > 0"),),
    )
    fixed: tuple = _opt(
        (),
        "fixed",
        "infilling: text fixed at answer positions, POS:TEXT (0-based; a text of several tokens takes "
        "the positions after POS; encoded as written); never masked, never edited",
        row=True,
    )
    suffix: str | tuple | None = _opt(
        None,
        "optional text",
        "infilling: text after the answer region, which the answer leads into (LLaDA, Dream: "
        "bidirectional attention; block-causal families cannot see it)",
        row=True,
    )
    seed: int | None = _opt(
        None,
        "optional int",
        "random seed (rows use seed, seed + 1, ...)",
        server=False,
        row=True,
        checks=((is_int, "must be an integer or None"),),
    )
    logprobs: int | None = _opt(
        None,
        "optional int",
        "report each generated token's log-probability from the forward that wrote it, and the N most "
        "likely tokens there (0: none; at most 20)",
        server=False,
        row=True,
        checks=((lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS, f"must be an integer 0-{MAX_LOGPROBS} or None"),),
    )
    logprobs_mode: str = _opt(
        "processed",
        "str",
        "with logprobs: processed (under the row's temperature, top-k / top-p and grammar, as vLLM "
        "reports them) or raw (the model's log-softmax as it is)",
        row=True,
        checks=((_one_of(LOGPROBS_MODES), "must be one of " + ", ".join(LOGPROBS_MODES)),),
    )
    adapter: str | None = _opt(
        None,
        "optional str",
        "the LoRA adapter a row decodes with, by the name it was loaded under (--lora-modules NAME=PATH); "
        "none: the base model",
        server=False,
        row=True,
        checks=((lambda v: isinstance(v, str) and v != "", "must be a name or None"),),
    )
    compile: bool = _opt(
        False,
        "bool",
        "run the dense math of the model's layers through torch.compile (the "
        "first use compiles: eval and serve do it before timing or serving)",
        server=False,
    )
    cuda_graphs: bool = _opt(
        False,
        "bool",
        "DualCache's cached steps with fixed shapes through torch.compile(mode='reduce-overhead'): "
        "CUDA graphs on a GPU, replayed at every block (the first use compiles)",
        server=False,
    )
    deterministic: bool = _opt(
        False,
        "bool",
        "batch-invariant forwards: a row's tokens are the same whatever else "
        "is in its batch, in bfloat16 too (slower; a server-wide setting)",
        server=False,
    )

    def __init__(self, **options):
        """The decoding options by name (`field_names()`; each unset one its declared default),
        transformers' keywords included (`max_new_tokens`, `do_sample`:
        `from_transformers_names`). A name that is not an option raises a ConfigError naming it."""
        options = from_transformers_names(options)
        for name in options:
            if name not in self.__dataclass_fields__:
                raise ConfigError(name, "is not a decoding option (see GenerationConfig.field_names())")
        for f in fields(self):  # every field is declared with a default (`_opt`)
            object.__setattr__(self, f.name, options.get(f.name, f.default))
        self.__post_init__()

    def __post_init__(self) -> None:
        # `fixed` as given ({pos: text or ids}, or pairs) -> sorted (pos, text | ids tuple) pairs,
        # so that a config stays hashable and two spellings of one constraint compare equal
        object.__setattr__(self, "fixed", _fixed_pairs(self.fixed))
        if isinstance(self.suffix, (list, tuple)):
            object.__setattr__(self, "suffix", tuple(self.suffix))
        self.validate()

    @classmethod
    def baseline(cls, **overrides) -> GenerationConfig:
        """LLaDA's semi-autoregressive baseline: no cache, one token per step, every forward over
        the whole sequence."""
        return cls(
            **{
                "threshold": None,
                "factor": None,
                "cache": "none",
                "suffix_window": None,
                "refresh": "full",
                "refresh_every": None,
                "parallel_blocks": 1,
                **overrides,
            }
        )

    @classmethod
    def _published(cls, overrides: dict, **fields) -> GenerationConfig:
        """A published method's config: what its reference fixes (`fields`) over the layout every
        reference shares (gen length 256 in blocks of 32, its own step rule, no scheduled refresh,
        one block at a time), with `overrides` on top."""
        layout = dict(gen_length=256, block_length=32, steps=None, factor=None, refresh_every=None, parallel_blocks=1)
        return cls(**{**layout, **fields, **overrides})

    @classmethod
    def fast_dllm(cls, **overrides) -> GenerationConfig:
        """Fast-dLLM exactly as published: DualCache, threshold 0.9, a full refresh at every block,
        every forward over the whole sequence; gen length 256 in blocks of 32."""
        return cls._published(overrides, threshold=0.9, cache="dual", suffix_window=None, refresh="full")

    @classmethod
    def dparallel(cls, **overrides) -> GenerationConfig:
        """dParallel's decoding, as its LLaDA `generate` and Dream `alg="entropy_threshold"`: no
        cache, blocks of 32, every masked position of entropy at most 0.5 nats (always the lowest);
        gen length 256."""
        return cls._published(
            overrides, threshold=0.5, unmasking="entropy", cache="none", suffix_window=None, refresh="full"
        )

    @classmethod
    def d3llm(cls, **overrides) -> GenerationConfig:
        """d3LLM's decoding (`generate_multi_block`, as its evaluation runs it): no cache, blocks of
        32, every block that takes part (a block joins once the one before it is 10% revealed)
        revealing its positions of entropy at most 0.5 nats, the lowest-entropy position always, and
        the current block at least its own lowest; once an EOS is revealed, everything after it is
        EOS. Gen length 256, so up to 8 blocks at once."""
        return cls._published(
            overrides,
            threshold=0.5,
            unmasking="entropy",
            cache="none",
            suffix_window=None,
            refresh="full",
            parallel_blocks=8,
            block_add_threshold=0.1,
            decoded_token_threshold=0.95,
            stop_at_eos=True,
            eos_early_stop=True,
        )

    @classmethod
    def dmax(cls, **overrides) -> GenerationConfig:
        """DMax's decoding (its dInfer `decode_uniform`): blocks of 32, each step reveals masked
        positions left to right up to the first below 0.5 (at least the first), revises every
        position revealed in the block (`editing_threshold=0`), feeds them back as soft embeddings,
        and ends the block once all are 0.9 likely, nothing changes, or after 32 steps; the
        previous block re-encoded from hard tokens at the next block's first step (the vicinity
        refresh), and nothing after the block in any forward."""
        return cls._published(
            overrides,
            threshold=0.5,
            unmasking="left_to_right",
            cache="dual",
            suffix_window=0,
            refresh="vicinity",
            editing_threshold=0.0,
            stop_confidence=0.9,
            soft_embeddings=True,
        )

    @classmethod
    def rnd1(cls, **overrides) -> GenerationConfig:
        """RND1's decoding (`rnd/sampling.py`'s `diffusion_sample`, with its demo's defaults): the
        answer as one block with no cache, a step per answer position, each step revealing the
        masked positions of lowest entropy so that floor(n (N - 1 - i) / N) of the block's n masks
        stay masked after step i of N; tokens sampled at temperature 0.01 (0: greedy, as its demo's
        `greedy`). Gen length 256."""
        fields = dict(unmasking="rnd1", threshold=None, cache="none", suffix_window=None, refresh="full")
        fields.update(temperature=0.01, block_length=overrides.get("gen_length", 256))
        return cls._published(overrides, **fields)

    @classmethod
    def wedlm(cls, **overrides) -> GenerationConfig:
        """WeDLM's decoding (Tencent/WeDLM's engine with the settings of its evaluation scripts): a
        window of the 16 positions from the first masked one; each step reveals the window's masks
        whose entropy plus 0.02 per position after its first mask is under 0.4 (at least the lowest),
        greedily; a token is final once every position before it is revealed, and its K/V join an
        exact prefix cache (the model's attention is causal, its masks after its tokens). Gen length
        256 (its `max_tokens`)."""
        fields = dict(unmasking="wedlm", threshold=0.4, block_length=1, cache="prefix", suffix_window=0)
        fields.update(refresh="vicinity", window_size=16, pos_penalty_factor=0.02, temperature=0.0)
        return cls._published(overrides, **fields)

    @classmethod
    def _dream_coder(cls, overrides: dict, temperature: float, gen_length: int) -> GenerationConfig:
        """Dream's own `diffusion_generate` as a coder's card runs it: the answer as one block with
        no cache, a step per token, Dream's timesteps revealing the lowest-entropy positions
        (`alg="entropy"`, `alg_temp=0`), tokens sampled at `temperature` within top-p 0.95."""
        gen = overrides.get("gen_length", gen_length)
        fields = dict(unmasking="dream_schedule", alg="entropy", alg_temp=None, temperature=temperature, top_p=0.95)
        fields.update(
            threshold=None, cache="none", suffix_window=None, refresh="full", gen_length=gen, block_length=gen
        )
        return cls._published(overrides, **fields)

    @classmethod
    def diffucoder(cls, **overrides) -> GenerationConfig:
        """DiffuCoder's (apple/ml-diffucoder's `inference_demo.py`): temperature 0.3, gen length 256."""
        return cls._dream_coder(overrides, 0.3, 256)

    @classmethod
    def dream_coder(cls, **overrides) -> GenerationConfig:
        """Dream-Coder's (DreamLM/Dream-Coder's README example): temperature 0.1, gen length 768."""
        return cls._dream_coder(overrides, 0.1, 768)

    @classmethod
    def diffusion_gemma(cls, **overrides) -> GenerationConfig:
        """DiffusionGemma's decoding (transformers' `DiffusionGemmaForBlockDiffusion.generate` with
        its defaults): canvases of 256 (the model's `canvas_length`), each opened as uniform noise and
        refined for at most 48 steps at a temperature falling from 0.8 to 0.4, each step keeping the
        lowest-entropy samples within an entropy bound of 0.1 and renoising the rest, until its
        argmax holds for a step with a mean entropy under 0.005; the answer is the argmax canvas.
        The prompt and each finished canvas are cached as its encoder computes them (the dual cache
        with the vicinity refresh: each canvas's first forward commits the one before), so a step
        computes the canvas alone, as the reference's decoder does. Gen length 256."""
        fields = dict(unmasking="entropy_bound", threshold=None, cache="dual", suffix_window=0, refresh="vicinity")
        return cls._published(overrides, **{"block_length": 256, **fields})

    @classmethod
    def preset(cls, name: str, **overrides) -> GenerationConfig:
        """A named preset: one of PRESETS ("default", "fast-dllm", "baseline", "dparallel", "d3llm", "dmax",
        "rnd1", "diffusion_gemma", "diffucoder", "dream-coder", "wedlm")."""
        if name not in PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(PRESETS)} (got {name!r})")
        return getattr(cls, PRESETS[name])(**overrides)

    @classmethod
    def from_preset(cls, path, family: str | None = None, **overrides) -> GenerationConfig:
        """The config of a preset file (`fastdllm tune --out`), with `overrides`. `family`: the
        model's family name; a preset tuned for another family is refused."""
        preset = read_preset(path)
        if family is not None and preset.get("family") not in (None, family):
            raise ConfigError("preset", f"{path} was tuned for {preset['family']} models, not {family}")
        return cls(**{**preset["config"], **overrides})

    @classmethod
    def search_space(cls) -> dict[str, tuple]:
        """The values `fastdllm tune` tries, per field (the fields' `search` declarations)."""
        return {f.name: f.metadata["search"] for f in fields(cls) if f.metadata.get("search")}

    @classmethod
    def default(cls, **overrides) -> GenerationConfig:
        """The defaults: Fast-dLLM with a suffix window of 32 and the vicinity refresh."""
        return cls(**overrides)

    @classmethod
    def for_model(
        cls, model, base: GenerationConfig | None = None, checkpoint_defaults: bool = True, **overrides
    ) -> GenerationConfig:
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

    @classmethod
    def for_call(cls, model, apply) -> GenerationConfig:
        """The config of a call given no config (`generate`, `generate_text`): what the model
        needs (`for_model` without the checkpoint's sampling defaults), changed by `apply` (the
        call's keywords). A block length of the checkpoint's own yields to the default where the
        keywords ask for an answer that does not hold whole blocks of it (`gen_length=32` on a
        checkpoint of blocks of 64)."""
        config = cls.for_model(model, checkpoint_defaults=False)
        try:
            return apply(config)
        except ConfigError as e:
            if e.param != "block_length" or not _own_block(model, config.gen_length):
                raise
            return apply(config.replace(block_length=cls().block_length))

    def fit_to_model(self, model, keep=(), own_block: bool = False) -> GenerationConfig:
        """This config (a named preset) with what the model's family needs (a block-diffusion
        model's block length, and its exact cache where the config has a cache), but for the
        fields in `keep` (the ones a user gave). `own_block`: also the block length the checkpoint
        names (the default preset takes it; a published method's preset keeps its own)."""
        family = getattr(model, "family", None)
        needed = family.decoding_defaults(model.args) if family is not None else {}
        if own_block and "block_length" not in needed:
            needed.update(_own_block(model, self.gen_length))
        if self.unmasking is not None and self.unmasking != needed.get("unmasking"):
            needed.pop("unmasking", None)  # a preset that names its own rule (dParallel's, DMax's) keeps it
        if self.cache == "none":
            needed = {
                k: v for k, v in needed.items() if k not in ("cache", "refresh", "refresh_every", "suffix_window")
            }
        if self.parallel_blocks > 1:
            needed = _one_block_fields_dropped(needed)
        return self.replace(**{k: v for k, v in needed.items() if k not in keep})

    @property
    def one_block(self) -> bool:
        """Whether the answer is decoded as one block that follows its length (a rule in
        `ONE_BLOCK_RULES` whose block is the whole answer): a new `gen_length` moves
        `block_length` with it."""
        return self.unmasking in ONE_BLOCK_RULES and self.block_length == self.gen_length

    def replace(self, **changes) -> GenerationConfig:
        if self.one_block and "gen_length" in changes and "block_length" not in changes:
            changes["block_length"] = changes["gen_length"]
        return replace(self, **changes)

    def with_max_new_tokens(self, n: int, **changes) -> GenerationConfig:
        """This config (with `changes`) for answers of at most `n` tokens, as transformers'
        `max_new_tokens` means: `gen_length` is `n` rounded up to whole blocks (the caller cuts the
        answer back to `n`), and a fixed step schedule keeps its steps per token unless `changes`
        set `steps`."""
        if not is_int(n) or n < 1:
            raise ConfigError("max_new_tokens", f"must be a positive integer (got {n!r})")
        block = changes.get("block_length", self.block_length)
        if not is_int(block) or block < 1:
            return self.replace(**changes)  # names block_length
        if self.one_block and "block_length" not in changes:
            block = n
        gen_length = -(-n // block) * block
        if "steps" not in changes and self.steps is not None:
            changes["steps"] = min(
                gen_length, max(gen_length // block, round(self.steps * gen_length / self.gen_length))
            )
        return self.replace(**{**changes, "gen_length": gen_length})

    def with_options(self, **fields) -> GenerationConfig:
        """This config with `fields` changed, transformers' keywords accepted as `generate(...,
        max_new_tokens=64, do_sample=False)` takes them (`from_transformers_names`)."""
        n = fields.pop("max_new_tokens", None)
        if fields.get("do_sample") is True and "temperature" not in fields and self.temperature > 0:
            fields["temperature"] = self.temperature
        mapped = from_transformers_names(fields)
        return self.replace(**mapped) if n is None else self.with_max_new_tokens(n, **mapped)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def fixed_end(self) -> int:
        """The answer position after the last fixed token (0: none fixed): stop tokens before it are
        the fill's padding, not the answer's end (`text.completion.complete`)."""
        return max((p + (1 if isinstance(v, str) else len(v)) for p, v in self.fixed), default=0)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def columns_past_answer(self) -> int:
        """Masked positions after the answer that decoding may reveal (and the answer attend to):
        WeDLM's window runs `window_size - 1` past the answer's last position."""
        return self.window_size - 1 if self.unmasking == "wedlm" else 0

    @property
    def total_steps(self) -> int:
        return self.gen_length if self.steps is None else self.steps

    def steps_per_block(self) -> list[int]:
        nb, total = self.num_blocks, self.total_steps
        return [total // nb + (1 if b < total % nb else 0) for b in range(nb)]

    # -- the declarations, for the CLI, the server and the lm-eval plugin
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def row_fields(cls) -> list[str]:
        """The fields each row of a batch decides with on its own (declared `row`)."""
        return [f.name for f in fields(cls) if f.metadata.get("row")]

    @classmethod
    def options(cls) -> list[dict]:
        """One entry per field: name, default, kind, help, server."""
        return [{"name": f.name, "default": f.default, **f.metadata} for f in fields(cls)]

    @classmethod
    def parse(cls, name: str, text: Any) -> Any:
        """A field's value from text ("none"/"off"/"null" for None where allowed); non-strings
        are returned as they are. A ConfigError names the field when the text does not parse."""
        kinds = {o["name"]: o["kind"] for o in cls.options()}
        if name not in kinds:
            raise ConfigError(name, f"unknown option; choose from {', '.join(kinds)}")
        if not isinstance(text, str):
            return text
        kind = kinds[name]
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

    # -- validation
    def validate(self) -> None:
        """Every field's own rules (declared beside it, `checks`; a bool field must be a bool),
        then the rules that join fields, grouped by what they concern. A ConfigError naming the
        parameter and what is allowed."""
        for f in fields(self):
            value, kind = getattr(self, f.name), f.metadata["kind"]
            if value is None and kind.startswith("optional "):
                continue
            if kind.endswith("bool"):
                _need(isinstance(value, bool), self, f.name, "must be true or false")
            for ok, allowed in f.metadata["checks"]:
                _need(ok(value), self, f.name, allowed() if callable(allowed) else allowed)
        self._check_schedule()
        self._check_selection()
        self._check_blocks_and_cache()
        self._check_editing()
        self._check_infill()
        _need(
            not (self.cuda_graphs and self.deterministic),
            self,
            "cuda_graphs",
            "not with deterministic (its forwards attend row by row)",
        )

    def _check_schedule(self) -> None:
        """The answer's blocks and steps, and the temperature schedule of a renoising canvas."""
        _need(
            self.gen_length % self.block_length == 0, self, "block_length", f"must divide gen_length={self.gen_length}"
        )
        if self.steps is not None:
            _need(is_int(self.steps), self, "steps", "must be an integer or None")
            if self.one_block:  # RND1's schedule: more steps than masks is a slower reveal, as there
                _need(self.steps >= 1, self, "steps", "must be at least 1")
            else:
                _need(
                    self.num_blocks <= self.steps <= self.gen_length,
                    self,
                    "steps",
                    f"must be between the number of blocks ({self.num_blocks}) and gen_length ({self.gen_length})",
                )
        _need(_is_num(self.t_max) and self.t_max > self.t_min, self, "t_max", f"must be > t_min={self.t_min}")

    def _check_selection(self) -> None:
        """The selection rule and its parameters; greedy-only calibration."""
        if self.threshold is not None and self.unmasking in ("entropy", "wedlm"):  # an entropy, in nats
            _need(_above(0)(self.threshold) and _finite(self.threshold), self, "threshold", "must be > 0 (nats)")
        elif self.threshold is not None:
            _need(_is_num(self.threshold) and 0 < self.threshold <= 1, self, "threshold", "must be in (0, 1] or None")
        for rule in ("threshold", "factor"):  # the rule named needs its parameter
            _need(
                self.unmasking != rule or getattr(self, rule) is not None,
                self,
                rule,
                f"unmasking={rule} needs a {rule}",
            )
        _need(
            self.unmasking != "entropy" or self.threshold is not None,
            self,
            "threshold",
            "unmasking=entropy needs a threshold (an entropy, in nats)",
        )
        if self.unmasking == "wedlm":  # its window moves one position at a time: blocks of one
            _need(
                self.block_length == 1,
                self,
                "block_length",
                "must be 1 with unmasking=wedlm (its window slides by positions)",
            )
            _need(
                self.parallel_blocks == 1,
                self,
                "parallel_blocks",
                "must be 1 with unmasking=wedlm (its window is window_size)",
            )
        _need(self.stop_at_eos or not self.eos_early_stop, self, "eos_early_stop", "needs stop_at_eos")
        _need(
            self.confidence_temperature == 1 or self.temperature == 0,
            self,
            "confidence_temperature",
            "needs greedy decoding (temperature 0): sampled tokens would be drawn twice",
        )

    def _check_blocks_and_cache(self) -> None:
        """Sub-blocks, several blocks at once, and what the cache policy needs."""
        if self.sub_block_length is not None:
            _need(
                is_int(self.sub_block_length)
                and self.sub_block_length >= 1
                and self.block_length % self.sub_block_length == 0,
                self,
                "sub_block_length",
                f"must be a positive integer dividing block_length={self.block_length}, or None",
            )
        _need(
            self.cache != "sub-block" or self.sub_block_length is not None,
            self,
            "cache",
            "'sub-block' needs sub_block_length",
        )
        _need(
            self.parallel_blocks == 1 or (self.sub_block_length is None and self.cache != "sub-block"),
            self,
            "parallel_blocks",
            "sub-block decoding (sub_block_length) reveals one block at a time: use parallel_blocks=1",
        )
        _need(
            self.prefill_chunk is None or (is_int(self.prefill_chunk) and self.prefill_chunk >= self.block_length),
            self,
            "prefill_chunk",
            f"must be None or an integer >= block_length ({self.block_length})",
        )

    def _check_editing(self) -> None:
        """LLaDA2.1's editing and what rides on it (DMax's stop and soft embeddings)."""
        if self.stop_confidence is not None:
            _need(self.editing_threshold is not None, self, "stop_confidence", "needs editing (editing_threshold)")
            _need(
                self.parallel_blocks == 1, self, "stop_confidence", "decides one block at a time: use parallel_blocks=1"
            )
        _need(
            not self.soft_embeddings or self.editing_threshold is not None,
            self,
            "soft_embeddings",
            "needs editing (editing_threshold): the fed-back positions are the ones a step may revise",
        )
        _need(
            not self.soft_embeddings or (not self.cuda_graphs and self.parallel_blocks == 1),
            self,
            "soft_embeddings",
            "not with cuda_graphs or parallel_blocks > 1",
        )

    def _check_infill(self) -> None:
        """Fixed tokens inside the answer and a suffix after it."""
        for pos, value in self.fixed:
            _need(is_int(pos) and pos >= 0, self, "fixed", "positions must be integers >= 0", got=f"position {pos!r}")
            _need(
                (isinstance(value, str) and value != "")
                or (isinstance(value, tuple) and value and all(is_int(t) for t in value)),
                self,
                "fixed",
                f"at {pos}: a non-empty text or token ids",
                got=repr(value),
            )
            _need(
                pos < self.gen_length, self, "fixed", f"positions must be below gen_length={self.gen_length}", f"{pos}"
            )
            if not isinstance(value, str):
                _need(
                    pos + len(value) <= self.gen_length,
                    self,
                    "fixed",
                    f"at {pos}: beyond gen_length={self.gen_length}",
                    got=f"{len(value)} tokens",
                )
        spans = [(p, p + len(v)) for p, v in self.fixed if not isinstance(v, str)]
        for (a, a_end), (b, _) in zip(spans, spans[1:]):
            _need(
                a_end <= b, self, "fixed", f"the spans at {a} and {b} overlap", got=f"the span at {a} ends at {a_end}"
            )
        if self.suffix is not None:
            _need(
                (isinstance(self.suffix, str) and self.suffix != "")
                or (isinstance(self.suffix, tuple) and self.suffix and all(is_int(t) for t in self.suffix)),
                self,
                "suffix",
                "must be a non-empty text, token ids, or None",
            )


def _need(ok: bool, config: GenerationConfig, name: str, allowed: str, got=None) -> None:
    """A ConfigError naming `name` unless `ok`; `got`: the offending part, in words, where the
    field's whole value is not it."""
    if not ok:
        raise ConfigError(name, f"{allowed} (got {got if got is not None else repr(getattr(config, name))})")


def _fixed_pairs(fixed) -> tuple:
    """`fixed` in its one form: (pos, text) or (pos, token-id tuple) pairs sorted by position."""
    if fixed is None:
        return ()
    if isinstance(fixed, dict):
        items = list(fixed.items())
    elif isinstance(fixed, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in fixed):
        items = list(fixed)
    else:
        raise ConfigError("fixed", f"a {{position: text}} mapping or (position, text) pairs (got {fixed!r})")
    pairs = []
    for pos, value in items:
        if isinstance(pos, str) and pos.strip().isdigit():  # JSON object keys are strings
            pos = int(pos)
        if not is_int(pos):
            raise ConfigError("fixed", f"positions must be integers (got {pos!r})")
        pairs.append(
            (pos, value if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else value)
        )
    pairs.sort(key=lambda pv: pv[0])
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        if a == b:
            raise ConfigError("fixed", f"position {a} is fixed twice")
    return tuple(pairs)


def _own_block(model, gen_length) -> dict:
    """{"block_length": N} where the checkpoint's generation_config.json names the block length N
    its answers were trained in and an answer of `gen_length` holds whole blocks of it, else {}."""
    own = (getattr(model, "generation_config", None) or {}).get("block_length")
    return {"block_length": own} if is_int(own) and own > 0 and is_int(gen_length) and gen_length % own == 0 else {}


def _one_block_fields_dropped(needed: dict) -> dict:
    """A family's decoding defaults for multi-block decoding: without its sub-blocks (Fast-dLLM
    v2's), which reveal one block at a time; the caller asked for several."""
    return {k: v for k, v in needed.items() if k != "sub_block_length" and not (k == "cache" and v == "sub-block")}


PRESET_FORMAT = "fastdllm-preset/1"


def read_preset(path) -> dict:
    """A preset file: {"format", "family", "model", "task", "config": {field: value}, ...}; a
    ConfigError naming `preset` when it is not one."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("preset", f"no preset file {path}") from None
    except (OSError, ValueError) as e:
        raise ConfigError("preset", f"{path} is not a JSON preset ({e})") from None
    if not isinstance(data, dict) or data.get("format") != PRESET_FORMAT or not isinstance(data.get("config"), dict):
        raise ConfigError("preset", f"{path} is not a fastdllm preset (format {PRESET_FORMAT!r} with a config)")
    unknown = sorted(set(data["config"]) - set(GenerationConfig.field_names()))
    if unknown:
        raise ConfigError("preset", f"{path} sets unknown fields {', '.join(unknown)}")
    return data


# --preset NAME -> the GenerationConfig classmethod that builds it.
PRESETS = {
    "default": "default",
    "fast-dllm": "fast_dllm",
    "baseline": "baseline",
    "dparallel": "dparallel",
    "d3llm": "d3llm",
    "dmax": "dmax",
    "rnd1": "rnd1",
    "diffusion_gemma": "diffusion_gemma",
    "diffucoder": "diffucoder",
    "dream-coder": "dream_coder",
    "wedlm": "wedlm",
}


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


def from_transformers_names(fields: dict) -> dict:
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
        block = fields.get("block_length", GenerationConfig.block_length)
        if is_int(block) and block >= 1:
            fields["gen_length"] = -(-n // block) * block
    return fields
