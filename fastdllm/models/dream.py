"""Dream (Dream-org/Dream-v0-*-7B): Qwen2 config fields and weight names.

Qwen2 architecture with q/k/v biases and grouped-query attention, bidirectional attention.
Dream was initialised from an autoregressive model and keeps its *shifted* prediction: the
logit at position i-1 predicts token i. `Transformer.packed_logits` (and `logits_for`) hide the
shift, so decoding code always receives "logits for position i".

Numerics, where we deliberately differ: RoPE is applied in float32 for both families (LLaDA's
`rope_full_precision`), while Dream's own code rotates in the model's dtype. In float32 the two
are the same; in bfloat16 our logits differ from Dream's by ~0.9% (relative) and the argmax
agrees on ~97% of positions (measured on random weights), so bf16 Dream decoding is close to,
not token-identical with, the reference.
"""

from __future__ import annotations

from . import qwen
from .family import DecodingRules, Family, WeightNames
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


# generation_config.json: Dream's own loader refuses a folder without it. Its decoding fields that
# name GenerationConfig fields become the checkpoint's defaults (`GenerationConfig.for_model`);
# `steps` belongs to its max_new_tokens and is not carried over (ours defaults to gen_length).
GENERATION_DEFAULTS = ("alg", "alg_temp", "eps", "temperature", "top_p", "top_k")


def generation_config(args: ModelArgs, base: dict | None = None) -> dict:
    """The generation_config.json a saved Dream checkpoint carries (Dream-v0's defaults)."""
    cfg = {
        "alg": "origin",
        "alg_temp": None,
        "eps": 1e-3,
        "steps": 512,
        "max_new_tokens": 512,
        "temperature": 0.0,
        "top_p": None,
        "top_k": None,
        "mask_token_id": args.mask_token_id,
        "bos_token_id": args.eos_token_id,
        "eos_token_id": args.eos_token_id,
        "pad_token_id": args.eos_token_id,
    }
    cfg.update(base or {})
    return cfg


FAMILY = Family(
    special_tokens={"mask_token_id": "<|mask|>", "eos_token_id": "<|endoftext|>"},
    generation_defaults=GENERATION_DEFAULTS,
    generation_config=generation_config,
    name="Dream",
    model_type=MODEL_TYPE,
    shifted_logits=SHIFTED_LOGITS,
    reference_config=REFERENCE_CONFIG,
    required=qwen.REQUIRED,
    fields=qwen.config_fields(DEFAULT_MASK_TOKEN_ID),
    unsupported={"hidden_act": "silu"},
    check=qwen.check_no_rope_scaling,
    fixed={"qkv_bias": True},  # Qwen2: q/k/v always have biases
    weights=WeightNames(
        top=qwen.TOP_WEIGHTS,
        layer=qwen.LAYER_WEIGHTS,
        qkv_bias=qwen.QKV_BIAS_WEIGHTS,
    ),
    rules=DecodingRules(
        block_start_reveals_first=True,
        d3llm_code="dream",
    ),
)
args_from_config = FAMILY.args_from_config
config_from_args = FAMILY.config_from_args
weight_names = FAMILY.weight_names
