"""WeDLM (tencent/WeDLM-7B and -8B, base and instruct; `WeDLMForCausalLM`): Qwen2.5 and Qwen3
turned into diffusion models that keep causal attention.

The layout is the Qwen model it started from, as its `hf_compat/modeling_wedlm.py` builds it:
q/k/v biases where `attention_bias` (its default, Qwen2.5's), a per-head RMSNorm of q and k where
`qk_norm` (Qwen3's), an explicit `head_dim` where set. Attention is causal, and the logits are not
shifted: the output at a [MASK] predicts that position's token. Over a partly masked sequence every
mask comes after every token in attention's order (`ModelArgs.masks_last`): WeDLM reorders its
inputs so, each token at its own RoPE position, and a sequence with no mask is read as its base
model reads it.

Its decoding (its engine's `WeDLMDecoder`) is the `wedlm` preset (`engine.wedlm`): a sliding window
with an exact prefix cache; a checkpoint of this family decodes so unless told otherwise. Without
a `mask_token_id` in its config, the mask is token 151665, as its engine assumes.

*Deliberate difference*: its engine builds q/k norms wherever there is no q/k/v bias, its
transformers file wherever `qk_norm` is set; we follow the config's `qk_norm` (the published
checkpoints set both consistently).
"""

from __future__ import annotations

from . import qwen
from .family import ConfigField, DecodingRules, Family, WeightNames

MODEL_TYPE = "wedlm"
MASK_TOKEN_ID = 151665
EOS_TOKEN_ID = 151643

# WeDLM-8B's config.json: Qwen3-8B's sizes with WeDLM's own fields.
REFERENCE_CONFIG = {
    "architectures": ["WeDLMForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_wedlm.WeDLMConfig",
        "AutoModel": "modeling_wedlm.WeDLMModel",
        "AutoModelForCausalLM": "modeling_wedlm.WeDLMForCausalLM",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": EOS_TOKEN_ID,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "mask_token_id": MASK_TOKEN_ID,
    "max_position_embeddings": 32768,
    "max_window_layers": 36,
    "model_type": MODEL_TYPE,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "qk_norm": True,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _check(cfg: dict, where: str) -> None:
    qwen.check_no_rope_scaling(cfg, where)
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: field use_sliding_window=True is not supported")


def _adjust(cfg: dict, values: dict) -> None:
    """Its config's booleans as its modeling file reads them: `attention_bias` true unless set false,
    `qk_norm` false unless set."""
    values["qkv_bias"] = bool(cfg.get("attention_bias", True))
    values["qk_norm"] = bool(cfg.get("qk_norm", False))


FAMILY = Family(
    name="WeDLM",
    model_type=MODEL_TYPE,
    shifted_logits=False,
    reference_config=REFERENCE_CONFIG,
    required=qwen.REQUIRED,
    fields=qwen.config_fields(
        MASK_TOKEN_ID,
        EOS_TOKEN_ID,
        head_size=ConfigField(("head_dim",), default=lambda v: v["dim"] // v["n_heads"], write=()),
        max_seq_len=ConfigField(("max_position_embeddings",), default=32768),
        qkv_bias=ConfigField(("attention_bias",), bool, True),
        qk_norm=ConfigField(("qk_norm",), bool, False),
    ),
    unsupported={"hidden_act": "silu"},
    check=_check,
    adjust=_adjust,
    derived=lambda args: {"head_dim": args.head_dim},  # its modeling file reads it, unset or not
    fixed={"block_size": 1, "masks_last": True},
    weights=WeightNames(
        top=qwen.TOP_WEIGHTS,
        layer=qwen.LAYER_WEIGHTS,
        qk_norm=qwen.QK_NORM_WEIGHTS,
        qkv_bias=qwen.QKV_BIAS_WEIGHTS,
    ),
    rules=DecodingRules(defaults={"unmasking": "wedlm", "cache": "prefix"}, published="wedlm"),
)
