"""`GenerationConfig`: every decoding option, declared once (see the package's docstring)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from . import fitting, presets, rules
from .names import (
    CACHE_POLICIES,
    DREAM_ALGS,
    LOGPROBS_MODES,
    MAX_LOGPROBS,
    MIN_TEMPERATURE,
    ONE_BLOCK_RULES,
    PREFIX_CACHE,
    REFRESH_RULES,
    REMASKING,
    SELECTION_RULES,
    ConfigError,
    _above,
    _finite,
    _finite_at_least,
    _is_num,
    _one_of,
    _opt,
    _positive_int,
    _unit_interval,
    _zero_or_warm,
    is_int,
    parse_value,
)


def _preset_method(name: str, doc: str):
    """A class method building preset `name` (`presets.PRESETS`) with overrides."""

    def build(cls, **overrides) -> GenerationConfig:
        return cls.preset(name, **overrides)

    build.__doc__ = doc
    return classmethod(build)


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
        "block size: blocks are decoded left to right (default: 32, or the block length a checkpoint's "
        "generation_config.json names where the answer holds whole blocks of it: 64 for the default model)",
        search=(8, 16, 32, 64),
        row=True,
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
        "(WeDLM's sliding window); unmasking=linear_spec: the draft's length (LinearSpec's block)",
        row=True,
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
    max_thinking_tokens: int | None = _opt(
        None,
        "optional int",
        "a thinking budget (Nemotron-Labs-Diffusion's): once the answer holds this many tokens with no "
        "end-of-thinking token (</think>) among them, the next block to open places one at the first "
        "position from there",
        row=True,
        checks=((lambda v: v is None or (is_int(v) and v >= 0), "must be an integer >= 0 or None"),),
    )
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
    draft_adapter: str | None = _opt(
        None,
        "optional str",
        "unmasking=linear_spec: the LoRA adapter its drafts decode with (a name loaded with "
        "--lora-modules; a Nemotron-Labs-Diffusion checkpoint's linear_spec_lora loads by that name); "
        "its verifications and the prompt's pass decode without it",
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
        "every step after a row's first, in shapes padded to buckets, through "
        "torch.compile(mode='reduce-overhead'): CUDA graphs on a GPU, replayed at every step of "
        "every policy (the first use compiles; docs/decoding.md#cuda-graphs)",
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
        options = fitting.from_transformers_names(options, BLOCK_LENGTH)
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

    # -- the published decoders' presets (`config.presets`), each a class method of its name
    baseline = _preset_method("baseline", "LLaDA's semi-autoregressive baseline: no cache, one token per step.")
    fast_dllm = _preset_method(
        "fast-dllm", "Fast-dLLM exactly as published: DualCache, threshold 0.9, a full refresh at every block."
    )
    dparallel = _preset_method(
        "dparallel", "dParallel's decoding: no cache, every masked position of entropy at most 0.5 nats."
    )
    d3llm = _preset_method("d3llm", "d3LLM's decoding: dParallel's rule over up to 8 blocks at once, its early stop.")
    dmax = _preset_method("dmax", "DMax's decoding: left to right, every revealed position revised, soft embeddings.")
    rnd1 = _preset_method(
        "rnd1", "RND1's decoding: the answer as one block, a step per position, lowest entropy first."
    )
    wedlm = _preset_method(
        "wedlm", "WeDLM's decoding: a sliding window of 16 over a causal model with an exact prefix cache."
    )
    diffucoder = _preset_method("diffucoder", "DiffuCoder's (Dream's own generate at temperature 0.3, gen length 256).")
    dream_coder = _preset_method(
        "dream-coder", "Dream-Coder's (Dream's own generate at temperature 0.1, gen length 768)."
    )
    diffusion_gemma = _preset_method(
        "diffusion_gemma", "DiffusionGemma's decoding: canvases of 256 renoised under an entropy bound."
    )
    nemotron_labs_diffusion = _preset_method(
        "nemotron_labs_diffusion",
        "Nemotron-Labs-Diffusion's diffusion mode: blocks of 32 opened causally, threshold 0.9 against the cache.",
    )
    nemotron_labs_diffusion_ar = _preset_method(
        "nemotron_labs_diffusion_ar", "Nemotron-Labs-Diffusion's autoregressive mode: one token per causal forward."
    )
    nemotron_labs_diffusion_linear_spec = _preset_method(
        "nemotron_labs_diffusion_linear_spec",
        "Nemotron-Labs-Diffusion's LinearSpec: a bidirectional draft of 31 positions verified by a causal pass.",
    )

    @classmethod
    def preset(cls, name: str, **overrides) -> GenerationConfig:
        """A named preset: one of PRESETS ("default", "fast-dllm", "baseline", "dparallel", "d3llm", "dmax",
        "rnd1", "diffusion_gemma", "diffucoder", "dream-coder", "wedlm", "nemotron_labs_diffusion",
        "nemotron_labs_diffusion_ar", "nemotron_labs_diffusion_linear_spec")."""
        if name not in presets.PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(presets.PRESETS)} (got {name!r})")
        return presets.PRESETS[name](cls, **overrides)

    @classmethod
    def from_preset(cls, path, family: str | None = None, **overrides) -> GenerationConfig:
        """The config of a preset file (`fastdllm tune --out`), with `overrides`. `family`: the
        model's family name; a preset tuned for another family is refused."""
        preset = presets.read_preset(path, cls.field_names())
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

    # -- a config for a model and a call (`config.fitting`)
    @classmethod
    def for_model(
        cls, model, base: GenerationConfig | None = None, checkpoint_defaults: bool = True, **overrides
    ) -> GenerationConfig:
        """`base` (default: the defaults, or the preset of the decoder a checkpoint was trained for)
        with the checkpoint's own generation defaults and what the model needs, in the fields
        `overrides` leave unset (`fitting.for_model`)."""
        return fitting.for_model(cls, model, base, checkpoint_defaults, **overrides)

    @classmethod
    def for_call(cls, model, apply) -> GenerationConfig:
        """The config of a call given no config (`generate`, `generate_text`): what the model
        needs, changed by `apply` (the call's keywords; `fitting.for_call`)."""
        return fitting.for_call(cls, model, apply)

    def fit_to_model(self, model, keep=(), own_block: bool = False) -> GenerationConfig:
        """This config (a named preset) with what the model's family needs, but for the fields in
        `keep` (the ones a user gave; `fitting.fit_to_model`)."""
        return fitting.fit_to_model(self, model, keep, own_block)

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
        mapped = fitting.from_transformers_names(fields, BLOCK_LENGTH)
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
        WeDLM's window runs `window_size - 1` past the answer's last position, a LinearSpec draft
        `window_size` past (its verification reads one column more)."""
        return {"wedlm": self.window_size - 1, "linear_spec": self.window_size}.get(self.unmasking, 0)

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
        return parse_value(name, kinds[name], text)

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
                rules.need(isinstance(value, bool), self, f.name, "must be true or false")
            for ok, allowed in f.metadata["checks"]:
                rules.need(ok(value), self, f.name, allowed() if callable(allowed) else allowed)
        for check in rules.CROSS_FIELD:
            check(self)
        rules.need(
            not (self.cuda_graphs and self.deterministic),
            self,
            "cuda_graphs",
            "not with deterministic (its forwards attend row by row)",
        )


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


BLOCK_LENGTH = GenerationConfig.block_length  # the default, for transformers' max_new_tokens
