"""`Family`: how one checkpoint format maps onto `Transformer`, as data.

A family is a field map (which config.json keys give each `ModelArgs` field, and which keys a
saved config writes), the settings it cannot run, and weight-name templates (ours -> theirs, per
layer with `{i}`, q/k/v with `{p}`; a mixture-of-experts layer's stacked expert weights with
`{e}`, one checkpoint tensor per expert). Reading a config, writing one and naming the weights are the
same three functions for every family, so a new family is a short file of declarations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .transformer import ModelArgs


@dataclass(frozen=True)
class ConfigField:
    """One ModelArgs field: read from the first of `read` that is set (not None, 0 or false), else
    `default` (a callable gets the fields read so far); written to every key of `write`."""

    read: tuple[str, ...]
    cast: Callable = int
    default: Any = None
    write: tuple[str, ...] | None = None  # default: read[0]

    @property
    def targets(self) -> tuple[str, ...]:
        return self.write if self.write is not None else self.read[:1]


@dataclass(frozen=True)
class WeightNames:
    """Our parameter names -> the checkpoint's. "{i}" stands for the layer, "{p}" for q, k and v,
    and "{e}" in a checkpoint name for the expert (one tensor each, stacked on our side)."""

    top: dict[str, str]  # outside the layers (output.weight only when untied)
    layer: dict[str, str]  # each layer's
    qkv_bias: dict[str, str] = field(default_factory=dict)  # when args.qkv_bias
    qk_norm: dict[str, str] = field(default_factory=dict)  # when args.qk_norm
    moe: dict[str, str] = field(default_factory=dict)  # a mixture-of-experts layer's MLP, instead of the layer's
    shared_expert: dict[str, str] = field(default_factory=dict)  # when args.shared_expert_hidden_dim
    router_bias: dict[str, str] = field(default_factory=dict)  # when args.router_bias


@dataclass(frozen=True)
class DecodingRules:
    """How the family's reference code decodes, where it differs from LLaDA's loop; the rest of a
    Family is what its checkpoints hold."""

    # Decoding fields the reference uses unless told otherwise (SDAR's selection rule).
    defaults: dict[str, Any] = field(default_factory=dict)
    # Its own way of proposing tokens and confidences (`config.PROPOSALS`); None: LLaDA's, or
    # Dream's with `alg`.
    proposal: str | None = None
    # With a block cache, the block-start step (the one that refreshes the cache) reveals the
    # block's first masked position (Fast-dLLM's Dream code).
    block_start_reveals_first: bool = False
    # A block-causal family whose reference builds the attention mask from the decoding block, so
    # that any block_length decodes; False: block_length must be the model's block_size.
    any_decoding_block: bool = False
    # Its reference loop edits revealed tokens (LLaDA2.1's editing_threshold), so tuning tries it.
    edits: bool = False
    # Which of d3LLM's two codes its multi-block decoding follows (`unmasking.EntropyLookahead`,
    # `cache.DelayedCache`): "llada" (d3llm_llada_generate_util) or "dream"
    # (d3llm_dream_generate_util).
    d3llm_code: str = "llada"
    # The preset (`config.PRESETS`) its reference decodes with, where it has its own: a checkpoint
    # of the family decodes so unless told otherwise (`GenerationConfig.for_model`).
    published: str | None = None
    # A token the reference places after the answer (and any suffix), which the model sees:
    # (config.json key of its id, the id where the key is missing).
    closing_token: tuple[str, int] | None = None
    # No mask token: a block opens as uniform random tokens (its canvas), which every step rewrites
    # (DiffusionGemma's renoising), drawn from the row's generator when the block opens.
    noise_canvas: bool = False


@dataclass(frozen=True)
class Family:
    name: str  # as people write it: "LLaDA", "Dream"
    model_type: str
    shifted_logits: bool
    reference_config: dict
    fields: dict[str, ConfigField]  # ModelArgs field -> how config.json holds it
    required: tuple[str, ...]
    weights: WeightNames
    unsupported: dict[str, Any] = field(default_factory=dict)  # config key -> the only value we run
    fixed: dict[str, Any] = field(default_factory=dict)  # ModelArgs fields the family fixes
    check: Callable[[dict, str], None] | None = None  # further checks of a config
    adjust: Callable[[dict, dict], None] | None = None  # (config, fields read) -> fix-ups in place
    derived: Callable[[ModelArgs], dict] | None = None  # extra keys a saved config writes
    # generation_config.json: the decoding fields a checkpoint's own file sets as our defaults
    # (`GenerationConfig.for_model`), and the file a saved checkpoint writes (None: none)
    generation_defaults: tuple[str, ...] = ()
    generation_config: Callable[[ModelArgs, dict | None], dict] | None = None
    # ModelArgs id fields -> the token's text in the family's vocabulary: where config.json does not
    # state the id, it is that token's id in the checkpoint's own tokenizer (`loading.read_config`).
    special_tokens: dict[str, str] = field(default_factory=dict)
    rules: DecodingRules = field(default_factory=lambda: DecodingRules())
    # The part of config.json its fields are read from (DiffusionGemma's text_config); None: all of it.
    source: Callable[[dict], dict] | None = None
    # The model class its checkpoints build (None: `Transformer`).
    model_class: type | None = None
    # Folders of PEFT LoRA adapters its checkpoints ship beside the weights, loaded by their folder's
    # name (Nemotron-Labs-Diffusion's `linear_spec_lora`, for its drafts).
    bundled_adapters: tuple[str, ...] = ()

    def decoding_defaults(self, args: ModelArgs) -> dict:
        """Decoding fields a model of this family needs unless told otherwise. A block-causal model
        decodes in its attention blocks, and its cache is exact with the cheapest windows: each
        block's first step recomputes the just-finished block (committing its final K/V) with the
        current one, later steps the current block alone, and nothing after it is ever part of a
        forward (no later block is visible to it)."""
        if self.rules.noise_canvas:  # its canvases, whole forwards, its own rule
            canvas = {"block_length": args.extra["canvas_length"], "cache": "dual", "suffix_window": 0}
            return {**canvas, "refresh": "vicinity", "unmasking": "entropy_bound", **self.rules.defaults}
        if not args.block_size:
            return dict(self.rules.defaults)
        return {
            "block_length": args.block_size,
            "cache": "dual",
            "refresh": "vicinity",
            "refresh_every": None,
            "suffix_window": 0,
            **self.rules.defaults,
        }

    # -- config.json -> ModelArgs
    def args_from_config(self, cfg: dict, where: str = "config.json") -> ModelArgs:
        if self.source is not None:
            cfg = self.source(cfg)
        missing = [k for k in self.required if k not in cfg]
        if missing:
            raise ValueError(f"{where}: {self.name} config is missing field(s) {', '.join(missing)}")
        for key, supported in self.unsupported.items():
            if key in cfg and cfg[key] != supported:
                raise ValueError(f"{where}: field {key}={cfg[key]!r} is not supported (only {supported!r})")
        if self.check is not None:
            self.check(cfg, where)
        values: dict[str, Any] = {}
        for name, f in self.fields.items():
            raw = next((cfg[k] for k in f.read if cfg.get(k)), None)
            if name == "eos_token_id" and isinstance(raw, list):  # the first; all stop (`stop_ids_of`)
                raw = raw[0]
            if raw is None:
                raw = f.default(values) if callable(f.default) else f.default
            values[name] = f.cast(raw)
        if self.adjust is not None:
            self.adjust(cfg, values)
        return ModelArgs(**values, **self.fixed, shifted_logits=self.shifted_logits)

    # -- ModelArgs -> config.json
    def config_from_args(self, args: ModelArgs, base: dict | None = None) -> dict:
        """A complete config.json for `args`: every reference field, sizes replaced."""
        cfg = dict(self.reference_config)
        cfg.update(base or {})
        for name, f in self.fields.items():
            for key in f.targets:
                listed = cfg.get(key)
                if isinstance(listed, list) and listed and listed[0] == getattr(args, name):
                    continue  # a list of stop ids led by this one stays as the checkpoint has it
                cfg[key] = getattr(args, name)
        if self.derived is not None:
            cfg.update(self.derived(args))
        return cfg

    # -- weight names
    def experts_one_by_one(self, theirs: str, args: ModelArgs) -> list[tuple[str, ...]] | None:
        """Where the checkpoint stores a stacked experts tensor `theirs` one expert at a time instead
        (as llm-compressor writes a quantized mixture of experts): per expert, the names of its
        tensors, joined along their first dimension; None for a family without such a form."""
        return None

    def fit_to_checkpoint(self, model, present: set[str]) -> None:
        """The model built from config.json fitted to the tensors its checkpoint holds (`present`),
        before they are read: a family with optional parts drops those the files lack."""

    def weight_names(self, args: ModelArgs) -> dict[str, str | tuple[str, ...]]:
        """Our parameter name -> the checkpoint's (a tuple for a stacked expert weight: the
        checkpoint's tensor of each expert, in order)."""
        names: dict[str, str | tuple[str, ...]] = {
            k: v for k, v in self.weights.top.items() if k != "output.weight" or not args.tie_embeddings
        }
        per_layer = dict(self.weights.layer)
        if args.qk_norm:
            per_layer.update(self.weights.qk_norm)
        if args.qkv_bias:
            per_layer.update(self.weights.qkv_bias)
        moe_layer = {k: v for k, v in per_layer.items() if not k.startswith("layers.{i}.feed_forward.")}
        moe_layer.update(self.weights.moe)
        if args.shared_expert_hidden_dim:
            moe_layer.update(self.weights.shared_expert)
        if args.router_bias:
            moe_layer.update(self.weights.router_bias)
        for i in range(args.n_layers):
            for ours, theirs in (moe_layer if args.is_moe_layer(i) else per_layer).items():
                if "{p}" in ours:
                    for p in "qkv":
                        names[ours.format(i=i, p=p)] = theirs.format(i=i, p=p)
                elif "{e}" in theirs:
                    names[ours.format(i=i)] = tuple(theirs.format(i=i, e=e) for e in range(args.n_experts))
                else:
                    names[ours.format(i=i)] = theirs.format(i=i)
        return names
