"""LLaDA (GSAI-ML/LLaDA-8B-*): config fields and weight names.

Architecture (LLaDA's `LLaDALlamaBlock`): x += attn_out(attention(q_proj, k_proj, v_proj of attn_norm(x)));
x += ff_out(silu(ff_proj(h)) * up_proj(h)) with h = ff_norm(x); final ln_f and output head ff_out
(or the embedding when `weight_tying`). Full bidirectional attention; logit i predicts token i.
"""

from __future__ import annotations

from .transformer import ModelArgs

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

REQUIRED = ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size", "mask_token_id", "eos_token_id")

# Settings of LLaDA's config that this (Llama-style) implementation does not support.
UNSUPPORTED = {
    "alibi": False,
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "input_emb_norm": False,
    "scale_logits": False,
    "attention_layer_norm": False,
    "rope": True,
}


def args_from_config(cfg: dict, where: str = "config.json") -> ModelArgs:
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"{where}: LLaDA config is missing field(s) {', '.join(missing)}")
    for key, supported in UNSUPPORTED.items():
        if key in cfg and cfg[key] != supported:
            raise ValueError(f"{where}: field {key}={cfg[key]!r} is not supported (only {supported!r})")
    n_heads = int(cfg["n_heads"])
    n_kv_heads = cfg.get("n_kv_heads") or n_heads
    if cfg.get("multi_query_attention"):
        n_kv_heads = 1
    return ModelArgs(
        dim=int(cfg["d_model"]),
        n_layers=int(cfg["n_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(n_kv_heads),
        hidden_dim=int(cfg["mlp_hidden_size"]),
        vocab_size=int(cfg.get("embedding_size") or cfg["vocab_size"]),
        max_seq_len=int(cfg.get("max_sequence_length", 4096)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        qkv_bias=bool(cfg.get("include_qkv_bias") or cfg.get("include_bias")),
        tie_embeddings=bool(cfg.get("weight_tying", False)),
        mask_token_id=int(cfg["mask_token_id"]),
        eos_token_id=int(cfg["eos_token_id"]),
        shifted_logits=SHIFTED_LOGITS,
    )


def config_from_args(args: ModelArgs, base: dict | None = None) -> dict:
    """A complete LLaDA config.json for `args`: every reference field, sizes replaced."""
    cfg = dict(REFERENCE_CONFIG)
    cfg.update(base or {})
    cfg.update(
        d_model=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        mlp_hidden_size=args.hidden_dim,
        mlp_ratio=max(1, round(args.hidden_dim / args.dim)),
        vocab_size=args.vocab_size,
        embedding_size=args.vocab_size,
        max_sequence_length=args.max_seq_len,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.norm_eps,
        include_qkv_bias=args.qkv_bias,
        weight_tying=args.tie_embeddings,
        mask_token_id=args.mask_token_id,
        eos_token_id=args.eos_token_id,
    )
    cfg.setdefault("pad_token_id", args.eos_token_id)
    return cfg


def weight_names(args: ModelArgs) -> dict[str, str]:
    """Our parameter name -> LLaDA checkpoint name."""
    t = "model.transformer"
    names = {"tok_embeddings.weight": f"{t}.wte.weight", "norm.weight": f"{t}.ln_f.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = f"{t}.ff_out.weight"
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}", f"{t}.blocks.{i}"
        names.update(
            {
                f"{ours}.attention_norm.weight": f"{theirs}.attn_norm.weight",
                f"{ours}.ffn_norm.weight": f"{theirs}.ff_norm.weight",
                f"{ours}.attention.wo.weight": f"{theirs}.attn_out.weight",
                f"{ours}.feed_forward.w1.weight": f"{theirs}.ff_proj.weight",
                f"{ours}.feed_forward.w3.weight": f"{theirs}.up_proj.weight",
                f"{ours}.feed_forward.w2.weight": f"{theirs}.ff_out.weight",
            }
        )
        for proj in "qkv":
            names[f"{ours}.attention.w{proj}.weight"] = f"{theirs}.{proj}_proj.weight"
            if args.qkv_bias:
                names[f"{ours}.attention.w{proj}.bias"] = f"{theirs}.{proj}_proj.bias"
    return names
