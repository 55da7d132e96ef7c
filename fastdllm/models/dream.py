"""Dream (Dream-org/Dream-v0-*-7B): Qwen2 config fields and weight names.

Qwen2 architecture with q/k/v biases and grouped-query attention, bidirectional attention.
Dream was initialised from an autoregressive model and keeps its *shifted* prediction: the
logit at position i-1 predicts token i. `Transformer.logits_for` hides the shift, so decoding
code always receives "logits for position i".

Numerics, where we deliberately differ: RoPE is applied in float32 for both families (LLaDA's
`rope_full_precision`), while Dream's own code rotates in the model's dtype. In float32 the two
are the same; in bfloat16 our logits differ from Dream's by ~0.9% (relative) and the argmax
agrees on ~97% of positions (measured on random weights), so bf16 Dream decoding is close to,
not token-identical with, the reference.
"""

from __future__ import annotations

from .family import ConfigField, Family
from .transformer import ModelArgs

SHIFTED_LOGITS = True
MODEL_TYPE = "dream"

REFERENCE_CONFIG = {
    "architectures": ["DreamModel"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_dream.DreamConfig",
        "AutoModel": "modeling_dream.DreamModel",
    },
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "mask_token_id": 151666,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "Dream",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

DEFAULT_MASK_TOKEN_ID = 151666


def _check(cfg: dict, where: str) -> None:
    if cfg.get("rope_scaling"):
        raise ValueError(f"{where}: field rope_scaling={cfg['rope_scaling']!r} is not supported")


# generation_config.json: Dream's own loader refuses a folder without it. Its decoding fields that
# name GenerationConfig fields become the checkpoint's defaults (`GenerationConfig.for_model`);
# `steps` belongs to its max_new_tokens and is not carried over (ours defaults to gen_length).
GENERATION_DEFAULTS = ("alg", "alg_temp", "eps", "temperature", "top_p", "top_k")


def generation_config(args: ModelArgs, base: dict | None = None) -> dict:
    """The generation_config.json a saved Dream checkpoint carries (Dream-v0's defaults)."""
    cfg = {"alg": "origin", "alg_temp": None, "eps": 1e-3, "steps": 512, "max_new_tokens": 512,
           "temperature": 0.0, "top_p": None, "top_k": None, "mask_token_id": args.mask_token_id,
           "bos_token_id": args.eos_token_id, "eos_token_id": args.eos_token_id, "pad_token_id": args.eos_token_id}
    cfg.update(base or {})
    return cfg


FAMILY = Family(
    generation_defaults=GENERATION_DEFAULTS,
    generation_config=generation_config,
    block_start_reveals_first=True,
    name="Dream",
    model_type=MODEL_TYPE,
    shifted_logits=SHIFTED_LOGITS,
    reference_config=REFERENCE_CONFIG,
    required=("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"),
    fields={
        "dim": ConfigField(("hidden_size",)),
        "n_layers": ConfigField(("num_hidden_layers",), write=("num_hidden_layers", "max_window_layers")),
        "n_heads": ConfigField(("num_attention_heads",)),
        "n_kv_heads": ConfigField(("num_key_value_heads",), default=lambda v: v["n_heads"]),
        "hidden_dim": ConfigField(("intermediate_size",)),
        "vocab_size": ConfigField(("vocab_size",)),
        "max_seq_len": ConfigField(("max_position_embeddings",), default=4096),
        "rope_theta": ConfigField(("rope_theta",), float, 10000.0),
        "norm_eps": ConfigField(("rms_norm_eps",), float, 1e-6),
        "tie_embeddings": ConfigField(("tie_word_embeddings",), bool, False),
        "mask_token_id": ConfigField(("mask_token_id",), default=DEFAULT_MASK_TOKEN_ID),
        "eos_token_id": ConfigField(("eos_token_id",), default=151643),
    },
    unsupported={"hidden_act": "silu"},
    check=_check,
    fixed={"qkv_bias": True},  # Qwen2: q/k/v always have biases
    top_weights={"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"},
    layer_weights={
        "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.attention.w{p}.weight": "model.layers.{i}.self_attn.{p}_proj.weight",
        "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
        "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
        "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    },
    qkv_bias_weights={"layers.{i}.attention.w{p}.bias": "model.layers.{i}.self_attn.{p}_proj.bias"},
)
args_from_config = FAMILY.args_from_config
config_from_args = FAMILY.config_from_args
weight_names = FAMILY.weight_names

