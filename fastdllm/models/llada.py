"""LLaDA (GSAI-ML/LLaDA-8B-*): config fields and weight names.

Architecture (LLaDA's `LLaDALlamaBlock`): x += attn_out(attention(q_proj, k_proj, v_proj of attn_norm(x)));
x += ff_out(silu(ff_proj(h)) * up_proj(h)) with h = ff_norm(x); final ln_f and output head ff_out
(or the embedding when `weight_tying`). Full bidirectional attention; logit i predicts token i.
"""

from __future__ import annotations

from .family import ConfigField, Family, WeightNames

SHIFTED_LOGITS = False
MODEL_TYPE = "llada"

# Every field of LLaDA-8B-Instruct's config.json, with its value there. A checkpoint we write
# carries all of them (with its own sizes) so that any LLaDA-compatible loader can read it.
REFERENCE_CONFIG = {
    "_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModel": "modeling_llada.LLaDAModelLM",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 4096,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "eos_token_id": 126081,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.2",
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
}

FAMILY = Family(
    special_tokens={"mask_token_id": "<|mdm_mask|>", "eos_token_id": "<|endoftext|>"},
    name="LLaDA",
    model_type=MODEL_TYPE,
    shifted_logits=SHIFTED_LOGITS,
    reference_config=REFERENCE_CONFIG,
    required=("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size", "mask_token_id", "eos_token_id"),
    fields={
        "dim": ConfigField(("d_model",)),
        "n_layers": ConfigField(("n_layers",)),
        "n_heads": ConfigField(("n_heads",)),
        "n_kv_heads": ConfigField(("n_kv_heads",), default=lambda v: v["n_heads"]),
        "hidden_dim": ConfigField(("mlp_hidden_size",)),
        "vocab_size": ConfigField(("embedding_size", "vocab_size"), write=("vocab_size", "embedding_size")),
        "max_seq_len": ConfigField(("max_sequence_length",), default=4096),
        "rope_theta": ConfigField(("rope_theta",), float, 10000.0),
        "norm_eps": ConfigField(("rms_norm_eps",), float, 1e-5),
        "qkv_bias": ConfigField(("include_qkv_bias", "include_bias"), bool, False, write=("include_qkv_bias",)),
        "tie_embeddings": ConfigField(("weight_tying",), bool, False),
        "mask_token_id": ConfigField(("mask_token_id",)),
        "eos_token_id": ConfigField(("eos_token_id",)),
    },
    unsupported={
        "alibi": False,
        "block_type": "llama",
        "layer_norm_type": "rms",
        "activation_type": "silu",
        "input_emb_norm": False,
        "scale_logits": False,
        "attention_layer_norm": False,
        "rope": True,
    },
    adjust=lambda cfg, v: v.update(n_kv_heads=1) if cfg.get("multi_query_attention") else None,
    derived=lambda a: {"mlp_ratio": max(1, round(a.hidden_dim / a.dim))},
    weights=WeightNames(
        top={
            "tok_embeddings.weight": "model.transformer.wte.weight",
            "norm.weight": "model.transformer.ln_f.weight",
            "output.weight": "model.transformer.ff_out.weight",
        },
        layer={
            "layers.{i}.attention_norm.weight": "model.transformer.blocks.{i}.attn_norm.weight",
            "layers.{i}.ffn_norm.weight": "model.transformer.blocks.{i}.ff_norm.weight",
            "layers.{i}.attention.w{p}.weight": "model.transformer.blocks.{i}.{p}_proj.weight",
            "layers.{i}.attention.wo.weight": "model.transformer.blocks.{i}.attn_out.weight",
            "layers.{i}.feed_forward.w1.weight": "model.transformer.blocks.{i}.ff_proj.weight",
            "layers.{i}.feed_forward.w3.weight": "model.transformer.blocks.{i}.up_proj.weight",
            "layers.{i}.feed_forward.w2.weight": "model.transformer.blocks.{i}.ff_out.weight",
        },
        qkv_bias={"layers.{i}.attention.w{p}.bias": "model.transformer.blocks.{i}.{p}_proj.bias"},
    ),
)
args_from_config = FAMILY.args_from_config
config_from_args = FAMILY.config_from_args
weight_names = FAMILY.weight_names
