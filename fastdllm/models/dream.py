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

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
DEFAULT_MASK_TOKEN_ID = 151666


def args_from_config(cfg: dict, where: str = "config.json") -> ModelArgs:
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"{where}: Dream config is missing field(s) {', '.join(missing)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: field hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("rope_scaling"):
        raise ValueError(f"{where}: field rope_scaling={cfg['rope_scaling']!r} is not supported")
    n_heads = int(cfg["num_attention_heads"])
    return ModelArgs(
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        hidden_dim=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mask_token_id=int(cfg.get("mask_token_id", DEFAULT_MASK_TOKEN_ID)),
        eos_token_id=int(cfg.get("eos_token_id", 151643)),
        shifted_logits=SHIFTED_LOGITS,
    )


def config_from_args(args: ModelArgs, base: dict | None = None) -> dict:
    cfg = dict(REFERENCE_CONFIG)
    cfg.update(base or {})
    cfg.update(
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        max_window_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        intermediate_size=args.hidden_dim,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        mask_token_id=args.mask_token_id,
        eos_token_id=args.eos_token_id,
    )
    return cfg


def weight_names(args: ModelArgs) -> dict[str, str]:
    """Our parameter name -> Dream (Qwen2) checkpoint name."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        names.update(
            {
                f"{ours}.attention_norm.weight": f"{theirs}.input_layernorm.weight",
                f"{ours}.ffn_norm.weight": f"{theirs}.post_attention_layernorm.weight",
                f"{ours}.attention.wo.weight": f"{theirs}.self_attn.o_proj.weight",
                f"{ours}.feed_forward.w1.weight": f"{theirs}.mlp.gate_proj.weight",
                f"{ours}.feed_forward.w3.weight": f"{theirs}.mlp.up_proj.weight",
                f"{ours}.feed_forward.w2.weight": f"{theirs}.mlp.down_proj.weight",
            }
        )
        for proj in "qkv":
            names[f"{ours}.attention.w{proj}.weight"] = f"{theirs}.self_attn.{proj}_proj.weight"
            names[f"{ours}.attention.w{proj}.bias"] = f"{theirs}.self_attn.{proj}_proj.bias"
    return names
