"""flash_attn_func in plain torch (SDPA), for running SDAR's modeling file on a CPU in tests/test_reference.py."""

import torch.nn.functional as F


def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
    # (B, L, H, D) layout, as flash_attn's
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def flash_attn_varlen_func(*a, **k):
    raise NotImplementedError
