"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct): LLaDA's masked diffusion with
OLMoE-style mixture-of-experts layers.

LLaDA's semantics: bidirectional attention over the whole sequence, no logit shift, LLaDA's
decoding and every cache and unmasking policy. The layout is OLMoE's: q/k/v/o projections, a
per-head RMSNorm of q and k before RoPE (`qk_layernorm`), and in the layers `moe_layer_freq`
marks (all of them in the released models) a softmax router over `num_experts` experts of which
the top `num_experts_per_tok` run, weighted by their softmax scores as they are (not normalised;
with `moe_router_enable_expert_bias` the bias is added to the scores, and so to the weights),
plus a shared expert where `shared_expert_intermediate_size` is set. As in the published
modeling file, the router's logits are computed in the model's dtype and the softmax in float32,
the experts' weighted sum in the model's dtype, and `routed_scaling_factor` is not applied.

Its checkpoints' config.json says model_type "llada" (as LLaDA-8B's does); the expert fields
tell them apart (`models.family_of`).
"""

from __future__ import annotations

from . import qwen
from .family import ConfigField, Family, WeightNames
from .transformer import ModelArgs

MODEL_TYPE = "lladamoe"
ALIASES = ("llada_moe",)  # other spellings seen in configs
MASK_TOKEN_ID = 156895  # <|mdm_mask|>
EOS_TOKEN_ID = 156892

# LLaDA-MoE-7B-A1B-Instruct's config.json.
REFERENCE_CONFIG = {
    "architectures": ["LLaDAMoEModelLM"],
    "auto_map": {
        "AutoConfig": "configuration_lladamoe.LLaDAConfig",
        "AutoModel": "modeling_lladamoe.LLaDAMoEModel",
        "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "dense_intermediate_size": 8192,
    "eos_token_id": EOS_TOKEN_ID,
    "expert_intermediate_size": 1024,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "mask_token_id": MASK_TOKEN_ID,
    "max_position_embeddings": 8192,
    "model_type": "llada",
    "moe_layer_freq": [1] * 16,
    "moe_router_enable_expert_bias": False,
    "moe_router_score_function": "softmax",
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "pad_token_id": EOS_TOKEN_ID,
    "partial_rotary_factor": 1.0,
    "qk_layernorm": True,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "router_aux_loss_coef": 0.01,
    "routed_scaling_factor": 1,
    "shared_expert_intermediate_size": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": False,
    "vocab_size": 157184,
}

REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "expert_intermediate_size",
)


def is_moe_config(cfg: dict) -> bool:
    """A config of model_type "llada" that is LLaDA-MoE's (LLaDA-8B's has no experts)."""
    return "num_experts" in cfg and "expert_intermediate_size" in cfg


def _check(cfg: dict, where: str) -> None:
    for key, only in (
        ("attention_bias", False),
        ("clip_qkv", None),
        ("hidden_act", "silu"),
        ("moe_router_score_function", "softmax"),
        ("rope_scaling", None),
    ):
        if cfg.get(key, only) != only:
            raise ValueError(f"{where}: field {key}={cfg[key]!r} is not supported (only {only!r})")
    layers = cfg["num_hidden_layers"]
    freq = cfg.get("moe_layer_freq") or [1] * layers
    dense = next((i for i, f in enumerate(freq) if f), layers)
    if len(freq) != layers or any(not f for f in freq[dense:]):
        raise ValueError(
            f"{where}: field moe_layer_freq={freq!r} is not supported (dense layers, if any, must come "
            "first, then only mixture-of-experts layers)"
        )


def _adjust(cfg: dict, values: dict) -> None:
    freq = cfg.get("moe_layer_freq") or [1] * values["n_layers"]
    values["first_dense_layers"] = next((i for i, f in enumerate(freq) if f), values["n_layers"])
    values["qk_norm"] = bool(cfg.get("qk_layernorm", True))
    values["router_bias"] = bool(cfg.get("moe_router_enable_expert_bias", False))
    values["rope_dim"] = int(values["dim"] // values["n_heads"] * float(cfg.get("partial_rotary_factor", 1.0)))


def _derived(args: ModelArgs) -> dict:
    return {
        "moe_layer_freq": [int(args.is_moe_layer(i)) for i in range(args.n_layers)],
        "qk_layernorm": args.qk_norm,
        "moe_router_enable_expert_bias": args.router_bias,
        "partial_rotary_factor": args.rotary_dim / args.head_dim,
        "shared_expert_intermediate_size": args.shared_expert_hidden_dim or None,
    }


FAMILY = Family(
    special_tokens={"mask_token_id": "<|mdm_mask|>", "eos_token_id": "<|endoftext|>"},
    name="LLaDA-MoE",
    model_type=MODEL_TYPE,
    shifted_logits=False,
    reference_config=REFERENCE_CONFIG,
    required=REQUIRED,
    fields={
        "dim": ConfigField(("hidden_size",)),
        "n_layers": ConfigField(("num_hidden_layers",)),
        "n_heads": ConfigField(("num_attention_heads",)),
        "n_kv_heads": ConfigField(("num_key_value_heads",), default=lambda v: v["n_heads"]),
        "hidden_dim": ConfigField(("dense_intermediate_size",), default=8192),
        "vocab_size": ConfigField(("vocab_size",)),
        "max_seq_len": ConfigField(("max_position_embeddings",), default=8192),
        "rope_theta": ConfigField(("rope_theta",), float, 50000.0),
        "norm_eps": ConfigField(("rms_norm_eps",), float, 1e-5),
        "tie_embeddings": ConfigField(("tie_word_embeddings",), bool, False),
        # the config class's default mask id is its EOS id; the released checkpoints mask with 156895
        "mask_token_id": ConfigField(("mask_token_id",), default=MASK_TOKEN_ID),
        "eos_token_id": ConfigField(("eos_token_id",), default=EOS_TOKEN_ID),
        "n_experts": ConfigField(("num_experts",)),
        "n_active_experts": ConfigField(("num_experts_per_tok",)),
        "moe_hidden_dim": ConfigField(("expert_intermediate_size",)),
        "shared_expert_hidden_dim": ConfigField(("shared_expert_intermediate_size",), default=0, write=()),
    },
    check=_check,
    adjust=_adjust,
    derived=_derived,
    fixed={
        "router_score": "softmax",
        "router_in_float32": False,
        "bias_in_weights": True,
        "normalize_expert_weights": False,
        "combine_in_float32": False,
        "n_expert_groups": 1,
        "active_expert_groups": 1,
        "routed_scaling": 1.0,
    },
    weights=WeightNames(
        top=qwen.TOP_WEIGHTS,  # its dense names are Qwen's
        layer=qwen.LAYER_WEIGHTS,
        qk_norm=qwen.QK_NORM_WEIGHTS,  # its names are Qwen3's; loaded unless qk_layernorm is false
        moe={
            "layers.{i}.feed_forward.router.weight": "model.layers.{i}.mlp.gate.weight",
            "layers.{i}.feed_forward.w1": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "layers.{i}.feed_forward.w3": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
            "layers.{i}.feed_forward.w2": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        },
        router_bias={"layers.{i}.feed_forward.expert_bias": "model.layers.{i}.mlp.expert_bias"},
        shared_expert={
            "layers.{i}.feed_forward.shared.w1.weight": "model.layers.{i}.shared_expert.gate_proj.weight",
            "layers.{i}.feed_forward.shared.w3.weight": "model.layers.{i}.shared_expert.up_proj.weight",
            "layers.{i}.feed_forward.shared.w2.weight": "model.layers.{i}.shared_expert.down_proj.weight",
        },
    ),
)
