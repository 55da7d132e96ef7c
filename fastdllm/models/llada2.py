"""LLaDA2.0 / LLaDA2.1 (inclusionAI/LLaDA2.0-mini, -flash; LLaDA2.1-mini, -flash): block-diffusion
mixtures of experts on the BailingMoeV2 (Ling 2.0) layout.

Attention: one fused `query_key_value` projection split into q, k and v heads (grouped-query),
a per-head RMSNorm of q and k *before* RoPE, and RoPE on only the first `head_dim *
partial_rotary_factor` dims of each head. Attention is block-causal: the published `generate`
builds the mask from its `block_length` (32); the checkpoints were trained with that block, so
it is the model's block here (`block_size`, 32 unless the config sets one). No logit shift.

MLP: dense SwiGLU in the first `first_k_dense_replace` layers, then a mixture of experts
(`moe.MoEFeedForward`): a float32 sigmoid router whose choice adds `expert_bias` and is limited
to the best `topk_group` of `n_group` groups, whose weights are the chosen experts' un-biased
scores normalised to sum to one and times `routed_scaling_factor`, plus the shared experts. As
in the published modeling file, the expert bias is always part of the router and the weights are
always normalised (with more than one expert per token), whatever `norm_topk_prob` and
`moe_router_enable_expert_bias` say.

Decoding: LLaDA2.0's `generate` is SDAR's quota rule (steps per block, every masked position
strictly above `threshold` if they fill the step's quota, else its top-k; `unmasking.Quota`)
with LLaDA2's own proposal (`unmasking.LLaDA2Proposal`) and a stop after the block that holds
EOS; LLaDA2.1 adds token-to-token editing (`editing_threshold`, `max_post_steps`: see
`unmasking.Editing`).
"""

from __future__ import annotations

from .family import ConfigField, DecodingRules, Family, WeightNames
from .transformer import ModelArgs

MODEL_TYPE = "llada2_moe"
MASK_TOKEN_ID = 156895  # <|mask|>
EOS_TOKEN_ID = 156892  # <|endoftext|>
BLOCK = 32  # the published generate's block_length

# LLaDA2.0-mini's config.json (BailingMoeV2 sizes of Ling-mini-2.0).
REFERENCE_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"],
    "auto_map": {
        "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
    },
    "attention_dropout": 0.0,
    "embedding_dropout": 0.0,
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "max_position_embeddings": 32768,
    "max_window_layers": 20,
    "model_type": MODEL_TYPE,
    "moe_intermediate_size": 512,
    "moe_router_enable_expert_bias": True,
    "n_group": 8,
    "norm_head": False,
    "norm_softmax": False,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 20,
    "num_key_value_heads": 4,
    "num_shared_experts": 1,
    "output_dropout": 0.0,
    "output_router_logits": False,
    "pad_token_id": EOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 600000,
    "routed_scaling_factor": 2.5,
    "score_function": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": False,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "use_sliding_window": False,
    "vocab_size": 157184,
}

REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def _check(cfg: dict, where: str) -> None:
    for key, only in (
        ("use_bias", False),
        ("hidden_act", "silu"),
        ("score_function", "sigmoid"),
        ("use_sliding_window", False),
        ("rope_scaling", None),
        ("norm_head", False),
    ):
        # use_bias defaults to True in LLaDA2MoeConfig: a config without it has a biased output projection
        value = cfg.get(key, True if key == "use_bias" else only)
        if value != only:
            raise ValueError(f"{where}: field {key}={value!r} is not supported (only {only!r})")


def _adjust(cfg: dict, values: dict) -> None:
    # Read as written: a false use_qk_norm must not fall back to the class default (True).
    values["qk_norm"] = bool(cfg.get("use_qk_norm", True))
    values["qkv_bias"] = bool(cfg.get("use_qkv_bias", False))
    values["rope_dim"] = int(values["head_size"] * float(cfg.get("partial_rotary_factor", 0.5)))
    values["shared_expert_hidden_dim"] *= values["moe_hidden_dim"]  # num_shared_experts experts in one MLP
    if values["n_experts"] % values["n_expert_groups"]:
        raise ValueError(
            f"num_experts: {values['n_experts']} experts do not split into n_group={values['n_expert_groups']} groups"
        )


def _derived(args: ModelArgs) -> dict:
    return {
        "partial_rotary_factor": args.rotary_dim / args.head_dim,
        "use_qk_norm": args.qk_norm,
        "use_qkv_bias": args.qkv_bias,
        "pad_token_id": args.eos_token_id,
        "num_shared_experts": args.shared_expert_hidden_dim // args.moe_hidden_dim,
    }


FIELDS = {
    "dim": ConfigField(("hidden_size",)),
    "n_layers": ConfigField(("num_hidden_layers",), write=("num_hidden_layers", "max_window_layers")),
    "n_heads": ConfigField(("num_attention_heads",)),
    "n_kv_heads": ConfigField(("num_key_value_heads",), default=lambda v: v["n_heads"]),
    "head_size": ConfigField(("head_dim",), default=lambda v: v["dim"] // v["n_heads"], write=("head_dim",)),
    "hidden_dim": ConfigField(("intermediate_size",), default=lambda v: 4 * v["dim"]),
    "vocab_size": ConfigField(("vocab_size",)),
    "max_seq_len": ConfigField(("max_position_embeddings",), default=16384),
    "rope_theta": ConfigField(("rope_theta",), float, 10000.0),
    "norm_eps": ConfigField(("rms_norm_eps",), float, 1e-5),
    "tie_embeddings": ConfigField(("tie_word_embeddings",), bool, False),
    "mask_token_id": ConfigField(("mask_token_id",), default=MASK_TOKEN_ID),  # not in the published configs
    "eos_token_id": ConfigField(("eos_token_id",), default=EOS_TOKEN_ID),
    "block_size": ConfigField(("block_size",), default=BLOCK),  # not in the published configs
    "n_experts": ConfigField(("num_experts",)),
    "n_active_experts": ConfigField(("num_experts_per_tok",)),
    "moe_hidden_dim": ConfigField(("moe_intermediate_size",)),
    "shared_expert_hidden_dim": ConfigField(
        ("num_shared_experts",), default=0, write=()
    ),  # times moe_hidden_dim: _adjust
    "first_dense_layers": ConfigField(("first_k_dense_replace",), default=0),
    "n_expert_groups": ConfigField(("n_group",), default=8),
    "active_expert_groups": ConfigField(("topk_group",), default=4),
    "routed_scaling": ConfigField(("routed_scaling_factor",), float, 2.5),
}

LAYER_WEIGHTS = {
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.attention.wqkv.weight": "model.layers.{i}.attention.query_key_value.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.attention.dense.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
}
MOE_WEIGHTS = {
    "layers.{i}.feed_forward.router.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.feed_forward.w1": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "layers.{i}.feed_forward.w3": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "layers.{i}.feed_forward.w2": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
}
SHARED_EXPERT_WEIGHTS = {
    "layers.{i}.feed_forward.shared.w1.weight": "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
    "layers.{i}.feed_forward.shared.w3.weight": "model.layers.{i}.mlp.shared_experts.up_proj.weight",
    "layers.{i}.feed_forward.shared.w2.weight": "model.layers.{i}.mlp.shared_experts.down_proj.weight",
}

FAMILY = Family(
    special_tokens={"mask_token_id": "<|mask|>", "eos_token_id": "<|endoftext|>"},
    name="LLaDA2",
    model_type=MODEL_TYPE,
    shifted_logits=False,
    reference_config=REFERENCE_CONFIG,
    fields=FIELDS,
    required=REQUIRED,
    check=_check,
    adjust=_adjust,
    derived=_derived,
    fixed={"fused_qkv": True, "router_bias": True, "router_score": "sigmoid", "normalize_expert_weights": True},
    weights=WeightNames(
        top={
            "tok_embeddings.weight": "model.word_embeddings.weight",
            "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
        },
        layer=LAYER_WEIGHTS,
        qk_norm={
            "layers.{i}.attention.q_norm.weight": "model.layers.{i}.attention.query_layernorm.weight",
            "layers.{i}.attention.k_norm.weight": "model.layers.{i}.attention.key_layernorm.weight",
        },
        qkv_bias={"layers.{i}.attention.wqkv.bias": "model.layers.{i}.attention.query_key_value.bias"},
        moe=MOE_WEIGHTS,
        shared_expert=SHARED_EXPERT_WEIGHTS,
        router_bias={"layers.{i}.feed_forward.expert_bias": "model.layers.{i}.mlp.gate.expert_bias"},
    ),
    rules=DecodingRules(
        # The published generate's rule. Its default threshold (0.95) is not imposed: a threshold the
        # caller leaves at the engine's default (0.9) stays.
        defaults={"unmasking": "quota"},
        proposal="llada2",
        any_decoding_block=True,  # the published generate builds its mask from block_length
        edits=True,  # LLaDA2.1's token editing
    ),
)
