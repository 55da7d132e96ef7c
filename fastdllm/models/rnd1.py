"""RND1 (radicalnumerics/RND1-Base-0910, `RND1LM`): Qwen3-30B-A3B turned into a masked diffusion
model by continued pretraining.

The layout is Qwen3-MoE's: per-head RMSNorm of q and k before RoPE, no biases, an explicit
`head_dim`, untied embeddings, and in every layer a softmax router over `num_experts` experts of
which the top `num_experts_per_tok` run, their weights divided by their sum (`norm_topk_prob`).
As in its `hf` backend, the router's logits are computed in the model's dtype and the softmax in
float32. Attention is bidirectional over the whole sequence, and the logits are shifted as Dream's
are: the output at position i predicts token i + 1.

Its decoding (`rnd/sampling.py`, `diffusion_sample`) is the `rnd1` preset (`GenerationConfig.rnd1`):
the answer is one block decoded with no cache, each step revealing the masked positions of lowest
entropy on a schedule (`engine.rnd1.RND1Schedule`, `engine.rnd1.RND1Proposal`); a checkpoint of this
family decodes so unless told otherwise. Its sequence always ends with one pad token after the
answer (and after a suffix), which the model sees: the reference reserves the last of its
`max_new_tokens` positions for it, so our `gen_length` N is its `max_new_tokens` N + 1.

*Deliberate difference*: the experts' weighted sum is taken in float32 and cast back once, where
the `hf` backend casts each expert's weighted output to the model's dtype and adds them in it (the
same in float32 but for the order of the additions).
"""

from __future__ import annotations

from . import qwen
from .family import ConfigField, DecodingRules, Family, WeightNames

MODEL_TYPE = "rnd1"
MASK_TOKEN_ID = 151669
EOS_TOKEN_ID = 151645  # <|im_end|>
PAD_TOKEN_ID = 151643  # <|endoftext|>

# The values RND1's config class sets on every instance (`CONFIG_DEFAULTS`: Qwen3-30B-A3B's), with
# its own fields.
REFERENCE_CONFIG = {
    "architectures": ["RND1LM"],
    "auto_map": {
        "AutoConfig": "configuration_rnd.RND1Config",
        "AutoModel": "modeling_rnd.RND1Model",
        "AutoModelForMaskedLM": "modeling_rnd.RND1LM",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "mask_token_id": MASK_TOKEN_ID,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": MODEL_TYPE,
    "moe_backend": "hf",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_diffusion_steps": 256,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "pad_token_id": PAD_TOKEN_ID,
    "rms_norm_eps": 1e-06,
    "rope_scaling": False,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
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
    for key, only in (("attention_bias", False), ("hidden_act", "silu"), ("norm_topk_prob", True)):
        if cfg.get(key, only) != only:
            raise ValueError(f"{where}: field {key}={cfg[key]!r} is not supported (only {only!r})")
    if cfg.get("rope_scaling"):
        raise ValueError(f"{where}: field rope_scaling={cfg['rope_scaling']!r} is not supported")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{where}: fields mlp_only_layers / decoder_sparse_step: only a mixture of experts in every "
            f"layer is supported (got {cfg.get('mlp_only_layers')!r}, {cfg.get('decoder_sparse_step')!r})"
        )


FAMILY = Family(
    name="RND1",
    model_type=MODEL_TYPE,
    shifted_logits=True,
    reference_config=REFERENCE_CONFIG,
    required=REQUIRED,
    fields=qwen.config_fields(
        MASK_TOKEN_ID,
        EOS_TOKEN_ID,
        head_size=ConfigField(("head_dim",), default=lambda v: v["dim"] // v["n_heads"]),
        max_seq_len=ConfigField(("max_position_embeddings",), default=40960),
        rope_theta=ConfigField(("rope_theta",), float, 1000000.0),
        hidden_dim=ConfigField(("intermediate_size",), default=6144),
        n_experts=ConfigField(("num_experts",)),
        n_active_experts=ConfigField(("num_experts_per_tok",)),
        moe_hidden_dim=ConfigField(("moe_intermediate_size",)),
    ),
    check=_check,
    fixed={
        "qk_norm": True,
        "first_dense_layers": 0,
        "shared_expert_hidden_dim": 0,
        "router_score": "softmax",
        "router_in_float32": False,
        "router_bias": False,
        "bias_in_weights": False,
        "normalize_expert_weights": True,
        "combine_in_float32": True,
        "n_expert_groups": 1,
        "active_expert_groups": 1,
        "routed_scaling": 1.0,
    },
    weights=WeightNames(
        top=qwen.TOP_WEIGHTS,
        layer=qwen.LAYER_WEIGHTS,
        qk_norm=qwen.QK_NORM_WEIGHTS,
        moe={
            "layers.{i}.feed_forward.router.weight": "model.layers.{i}.mlp.gate.weight",
            "layers.{i}.feed_forward.w1": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "layers.{i}.feed_forward.w3": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
            "layers.{i}.feed_forward.w2": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        },
    ),
    rules=DecodingRules(published="rnd1", closing_token=("pad_token_id", PAD_TOKEN_ID)),
)
