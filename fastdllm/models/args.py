"""`ModelArgs`: the shape of a model, whatever its family (the families translate their configs
into these fields: `models/family.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int  # SwiGLU inner width
    vocab_size: int  # rows of the embedding / output head
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    mask_token_id: int = 0
    eos_token_id: int = 0
    # The logit at i-1 predicts token i (Dream, initialised from an autoregressive model).
    shifted_logits: bool = False
    head_size: int = 0  # the width of one head where a config sets it (Qwen3); 0: dim // n_heads
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    block_size: int = 0  # block-causal attention in blocks of this many positions; 0: bidirectional
    # With block_size 1 (causal): every [MASK] is ordered after every token, so a mask attends to all
    # tokens and the masks before it, a token to no mask (WeDLM's topological reordering).
    masks_last: bool = False
    fused_qkv: bool = False  # one q/k/v projection (LLaDA2's query_key_value), split by heads
    rope_dim: int = 0  # RoPE rotates the first rope_dim dims of each head (partial rotary); 0: all
    # A mixture of experts in every layer from `first_dense_layers` on (0 experts: dense MLPs only).
    n_experts: int = 0
    n_active_experts: int = 0  # experts per token (top-k)
    moe_hidden_dim: int = 0  # SwiGLU width of one expert
    shared_expert_hidden_dim: int = 0  # the always-on (shared) experts' SwiGLU width; 0: none
    first_dense_layers: int = 0
    router_score: str = "sigmoid"  # expert scores from the router logits: "sigmoid" or "softmax"
    router_in_float32: bool = True  # router logits from float32 inputs (else in the model's dtype)
    router_bias: bool = False  # a per-expert bias added to the scores to choose the experts
    bias_in_weights: bool = False  # the chosen experts' weights include that bias (LLaDA-MoE)
    n_expert_groups: int = 1  # group-limited routing: experts in groups, the best groups kept
    active_expert_groups: int = 1
    normalize_expert_weights: bool = True  # chosen experts' scores divided by their sum
    routed_scaling: float = 1.0  # the routed experts' weights times this
    combine_in_float32: bool = True  # the weighted sum of the experts' outputs in float32 (else model dtype)
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i >= self.first_dense_layers
