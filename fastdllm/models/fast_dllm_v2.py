"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, _1.5B): Qwen2.5 adapted to block
diffusion by the Fast-dLLM authors.

Qwen2: q/k/v biases. Attention is block-causal in blocks of `bd_size` (32): a block attends to every
earlier block and bidirectionally to itself, so the cache is exact. The prediction stays shifted as
in the autoregressive model it came from: the output at position j-1 predicts token j, so the
first token of a block is predicted by the last position of the previous one, once that block is
final (the reference reveals it with the forward that commits the finished block; our loop does
it at the block's first step, `block_start_reveals_first`).

Decoding follows `batch_sample`, its evaluation path: sub-blocks of 8 revealed left to right
(`sub_block_length`), in each step every masked position of the current sub-block above the
threshold and always the most confident one (first index on ties), the confidence computed in the
model's dtype (`unmasking.FastDLLMv2Proposal`), a row done after the block in which it revealed a
stop token. *Deliberate differences*: a confidence exactly equal to the threshold passes here (the
threshold rule's >=) and not there (>); and a prompt of exactly one block (32 tokens), which
`batch_sample` skips (its prefill needs more than one block) and then fails on when that row
finishes in its first block, decodes here as any other prompt whose length is a multiple of the
block: its first block's first token from the prompt's last logit.
"""

from __future__ import annotations

from . import qwen
from .family import ConfigField, DecodingRules, Family, WeightNames

MODEL_TYPE = "fast_dllm_qwen"  # "Fast_dLLM_Qwen" in config.json (matched without case)
MASK_TOKEN_ID = 151665  # |<MASK>|, added to the Qwen2.5 vocabulary

# Qwen2.5-7B-Instruct's config.json with the fields Fast-dLLM v2's conversion adds (model_type,
# architectures, auto_map, bd_size).
REFERENCE_CONFIG = {
    "architectures": ["Fast_dLLM_QwenForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
        "AutoModel": "modeling.Fast_dLLM_QwenModel",
        "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
    },
    "attention_dropout": 0.0,
    "bd_size": 32,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "Fast_dLLM_Qwen",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
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

FAMILY = Family(
    special_tokens={"mask_token_id": "|<MASK>|", "eos_token_id": "<|im_end|>"},
    name="Fast-dLLM v2",
    model_type=MODEL_TYPE,
    shifted_logits=True,
    reference_config=REFERENCE_CONFIG,
    required=qwen.REQUIRED,
    fields=qwen.config_fields(
        MASK_TOKEN_ID, default_eos_token_id=151645, block_size=ConfigField(("bd_size",), default=32)
    ),
    unsupported={"hidden_act": "silu"},
    check=qwen.check_no_rope_scaling,
    fixed={"qkv_bias": True},
    weights=WeightNames(
        top=qwen.TOP_WEIGHTS,
        layer=qwen.LAYER_WEIGHTS,
        qkv_bias=qwen.QKV_BIAS_WEIGHTS,
    ),
    rules=DecodingRules(
        block_start_reveals_first=True,
        defaults={"sub_block_length": 8},  # batch_sample's small_block_size
        proposal="fast_dllm_v2",
    ),
)
