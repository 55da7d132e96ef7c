"""The Qwen2 / Qwen3 checkpoint layout, shared by every Qwen-based family (Dream, Fast-dLLM v2,
SDAR): its config fields and weight names. Qwen2 has q/k/v biases; Qwen3 has none, an explicit
`head_dim` and a per-head RMSNorm of q and k."""

from __future__ import annotations

from .family import ConfigField


def config_fields(
    default_mask_token_id: int, default_eos_token_id: int = 151643, norm_eps: float = 1e-6, **more: ConfigField
) -> dict[str, ConfigField]:
    fields = {
        "dim": ConfigField(("hidden_size",)),
        "n_layers": ConfigField(("num_hidden_layers",), write=("num_hidden_layers", "max_window_layers")),
        "n_heads": ConfigField(("num_attention_heads",)),
        "n_kv_heads": ConfigField(("num_key_value_heads",), default=lambda v: v["n_heads"]),
        "hidden_dim": ConfigField(("intermediate_size",)),
        "vocab_size": ConfigField(("vocab_size",)),
        "max_seq_len": ConfigField(("max_position_embeddings",), default=4096),
        "rope_theta": ConfigField(("rope_theta",), float, 10000.0),
        "norm_eps": ConfigField(("rms_norm_eps",), float, norm_eps),
        "tie_embeddings": ConfigField(("tie_word_embeddings",), bool, False),
        "mask_token_id": ConfigField(("mask_token_id",), default=default_mask_token_id),
        "eos_token_id": ConfigField(("eos_token_id",), default=default_eos_token_id),
    }
    fields.update(more)
    return fields


REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")

TOP_WEIGHTS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

LAYER_WEIGHTS = {
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.attention.w{p}.weight": "model.layers.{i}.self_attn.{p}_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
}

QK_NORM_WEIGHTS = {  # Qwen3
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}

QKV_BIAS_WEIGHTS = {"layers.{i}.attention.w{p}.bias": "model.layers.{i}.self_attn.{p}_proj.bias"}


def check_no_rope_scaling(cfg: dict, where: str) -> None:
    if cfg.get("rope_scaling"):
        raise ValueError(f"{where}: field rope_scaling={cfg['rope_scaling']!r} is not supported")
