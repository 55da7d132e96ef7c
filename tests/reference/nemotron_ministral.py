"""The backbone Nemotron-Labs-Diffusion's remote code imports as `.modeling_ministral`, rebuilt from
transformers' own Ministral3 (transformers >= 5.0), for `nemotron_labs_diffusion.py` to run the
remote `modeling_nemotron_labs_diffusion.py` where its `modeling_ministral.py` is not at hand.

It is transformers' `Ministral3Model` (its RMSNorm, MLP, YaRN rotary embedding, `apply_rotary_pos_emb`,
`repeat_kv` and Llama-4 query scale, used as they are) with what the remote code asks of it, as
its calls and its model card describe them:

- each layer's attention is `config.attn_class` (default `Ministral3Attention`) and carries a
  `diffusion_lm` flag (from `config.diffusion_lm`), which the remote decoders flip per pass: True
  attends bidirectionally (no mask), False causally (each query sees the keys up to its own
  position, the cache's included);
- `forward` takes `past_key_values`, `use_cache`, `use_causal_mask`, `cache_position` and
  `is_training`; with a cache and `use_cache=False` the cache is read (its keys before the new ones)
  and not written, with `use_cache=True` the new keys are appended;
- its output has `last_hidden_state` and `past_key_values`.

`use_causal_mask` is accepted and not read: the causal mask follows the layer's `diffusion_lm`
(every remote call that passes `use_causal_mask=True` has turned `diffusion_lm` off, and
`ar_generate`, which passes no mask, has too). `is_training` (the block-diffusion training
layout) is refused."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.ministral3.modeling_ministral3 import (
    Ministral3MLP,
    Ministral3PreTrainedModel,
    Ministral3RMSNorm,
    Ministral3RotaryEmbedding,
    apply_rotary_pos_emb,
    get_llama_4_attn_scale,
    repeat_kv,
)


def _get_llama_4_attn_scale(positions, beta, original_max_position_embeddings):
    """The scale the remote code's flex attention imports under this name."""
    return get_llama_4_attn_scale(positions.view(1, -1), beta, original_max_position_embeddings)[0, 0, :, 0][:, None]


class Ministral3Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.diffusion_lm = bool(getattr(config, "diffusion_lm", False))
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, position_ids, past_key_values=None, use_cache=False):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rope = self.config.rope_parameters
        q = q * get_llama_4_attn_scale(
            position_ids, rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        ).to(q.dtype)
        if past_key_values is not None:
            if use_cache:
                k, v = past_key_values.update(k, v, self.layer_idx)
            elif (
                len(past_key_values.layers) > self.layer_idx and past_key_values.layers[self.layer_idx].keys is not None
            ):
                layer = past_key_values.layers[self.layer_idx]
                k, v = torch.cat([layer.keys, k], dim=-2), torch.cat([layer.values, v], dim=-2)
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)
        mask = None
        if not self.diffusion_lm:
            queries, keys = q.shape[-2], k.shape[-2]
            offset = keys - queries
            mask = torch.arange(keys)[None, :] <= torch.arange(offset, keys)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out), None


class Ministral3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = getattr(config, "attn_class", None) or Ministral3Attention
        self.self_attn = self.self_attn(config, layer_idx)
        self.mlp = Ministral3MLP(config)
        self.input_layernorm = Ministral3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Ministral3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, position_embeddings, position_ids, past_key_values, use_cache):
        attended, _ = self.self_attn(
            self.input_layernorm(h), position_embeddings, position_ids, past_key_values, use_cache
        )
        h = h + attended
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor
    past_key_values: DynamicCache | None = None


class Ministral3Model(Ministral3PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(Ministral3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Ministral3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Ministral3RotaryEmbedding(config=config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        use_causal_mask=False,
        cache_position=None,
        is_training=False,
        inputs_embeds=None,
        **kwargs,
    ):
        if is_training:
            raise ValueError("is_training: the training layout is not rebuilt here")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask: padding is not rebuilt here")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(h.shape[1], device=h.device) + seen)[None]
        embeddings = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, embeddings, position_ids, past_key_values, use_cache)
        return EncoderOutput(self.norm(h), past_key_values)
