"""flash_attn's RMSNorm in plain torch, for running SDAR's modeling file on a CPU."""

import torch


def rms_norm_fn(x, weight, bias=None, eps=1e-6, **kwargs):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
