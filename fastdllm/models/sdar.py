"""SDAR (JetAstra/SDAR-*-Chat) and TraDo (Gen-Verse/TraDo-*, RL-trained on SDAR's architecture):
block-diffusion models on the Qwen3 layout.

Qwen3: per-head RMSNorm of q and k before RoPE, no biases, an explicit `head_dim`. Attention is
block-causal in blocks of `block_size` (4 for the released chat models): a block attends to every
earlier block and bidirectionally to itself, so the K/V of a finished block never change and the
cache is exact. No logit shift: the output at position i predicts token i.

Decoding in blocks other than the training block is allowed, as SDAR's own evaluation allows it
(`block_length=8` on a model trained with blocks of 4): attention is then block-causal in the
decoding block, prompt included, exactly as that routine builds its mask. The model never saw that
mask in training, so quality may change.
"""

from __future__ import annotations

from . import qwen
from .family import ConfigField, DecodingRules, Family, WeightNames
from .transformer import ModelArgs

MODEL_TYPE = "sdar"

# SDAR-4B-Chat's config.json.
REFERENCE_CONFIG = {
    "architectures": ["SDARForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_sdar.SDARConfig",
        "AutoModel": "modeling_sdar.SDARModel",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_implementation": "flex_attention",
    "bos_token_id": 151643,
    "debug": False,
    "eos_token_id": 151643,
    "block_size": 4,
    "mask_token_id": 151669,
    "ep_size": 1,
    "fuse_cross_entropy": True,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 32768,
    "max_window_layers": 36,
    "micro_forward": False,
    "model_type": "sdar",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "skip_checkpoint": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.52.4",
    "use_cache": False,
    "use_deepep": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# generation_config.json: SDAR's sampling defaults become ours (`GenerationConfig.for_model`).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k")


def generation_config(args: ModelArgs, base: dict | None = None) -> dict:
    """The generation_config.json a saved SDAR checkpoint carries (SDAR-4B-Chat's sampling, the
    model's own token ids)."""
    cfg = {
        "bos_token_id": args.eos_token_id,
        "do_sample": True,
        "eos_token_id": args.eos_token_id,
        "pad_token_id": args.eos_token_id,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    cfg.update(base or {})
    return cfg


def _check(cfg: dict, where: str) -> None:
    qwen.check_no_rope_scaling(cfg, where)
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: field use_sliding_window=True is not supported")


FAMILY = Family(
    special_tokens={"mask_token_id": "<MASK>", "eos_token_id": "<|endoftext|>"},
    name="SDAR",
    model_type=MODEL_TYPE,
    shifted_logits=False,
    reference_config=REFERENCE_CONFIG,
    required=qwen.REQUIRED + ("block_size",),
    fields=qwen.config_fields(
        151669,
        head_size=ConfigField(("head_dim",), default=lambda v: v["dim"] // v["n_heads"], write=("head_dim",)),
        qkv_bias=ConfigField(("attention_bias",), bool, False),
        block_size=ConfigField(("block_size",)),
    ),
    unsupported={"hidden_act": "silu"},
    check=_check,
    fixed={"qk_norm": True},
    generation_defaults=GENERATION_DEFAULTS,
    generation_config=generation_config,
    weights=WeightNames(
        top=qwen.TOP_WEIGHTS,
        layer=qwen.LAYER_WEIGHTS,
        qk_norm=qwen.QK_NORM_WEIGHTS,
        qkv_bias=qwen.QKV_BIAS_WEIGHTS,
    ),
    rules=DecodingRules(
        any_decoding_block=True,  # SDAR's evaluation builds its mask from the decoding block
        defaults={"unmasking": "quota"},  # its block_diffusion_generate's rule
        proposal="sdar",
    ),
)
