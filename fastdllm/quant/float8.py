"""FP8 weights: compressed-tensors' `float-quantized` checkpoints (llm-compressor's FP8 and
FP8-dynamic schemes, what vLLM's users run on one GPU).

A layer's weight is held as FP8 E4M3 (one byte a weight) with one scale per output channel or per
tensor, in the checkpoint's scale dtype, and dequantized at each matmul as the library decompresses
it: (values in the scale's dtype) * scale, then cast to the activations' dtype. So its logits are
those of the model with the library's decompressed weights.

*Deliberate difference*: the schemes' activation quantization (FP8-dynamic: per token at run time;
FP8: a static scale) is not applied: activations stay in the model's dtype, as vLLM runs these
checkpoints on GPUs without FP8 matmuls (weight-only). `torch._scaled_mm` on GPUs that have FP8 is
not used yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Float8Weight:
    values: torch.Tensor  # (out, in) float8_e4m3fn
    scale: torch.Tensor  # (out, 1) per output channel, or (1, 1) per tensor, in the checkpoint's dtype
    bits = 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def per_channel(self) -> bool:
        return self.scale.shape[0] == self.values.shape[0] and self.values.shape[0] > 1

    def dequantize(self, dtype=None) -> torch.Tensor:
        """The (out, in) weight as compressed-tensors decompresses it, in `dtype` (default the scale's)."""
        return (self.values.to(self.scale.dtype) * self.scale).to(dtype or self.scale.dtype)

    def with_scale_dtype(self, dtype) -> Float8Weight:
        """Itself: its scale stays the checkpoint's, the dtype the library dequantizes in."""
        return self

    def cut(self, dim: int, segments: list[tuple[int, int]]) -> Float8Weight:
        """The rows (dim 0) or input columns (dim 1) in `segments` (tensor parallelism)."""
        if dim == 0:
            rows = torch.cat([torch.arange(a, b) for a, b in segments])
            return Float8Weight(self.values[rows].contiguous(), self.scale[rows] if self.per_channel else self.scale)
        return Float8Weight(torch.cat([self.values[:, a:b] for a, b in segments], 1).contiguous(), self.scale)

    def to(self, device) -> Float8Weight:
        return Float8Weight(self.values.to(device), self.scale.to(device))


class Float8Linear(nn.Module):
    """y = x W^T (+ b) with W held in FP8 and dequantized per call (`Float8Weight.dequantize`)."""

    kernel = "fp8-dequantize"

    def __init__(self, fw: Float8Weight, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.out_features, self.in_features = fw.shape
        self.bits, self.group_size, self.symmetric = 8, self.in_features, True
        self.register_buffer("weight", fw.values)
        self.register_buffer("weight_scale", fw.scale)
        dtype = dtype or fw.scale.dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(fw.values.device, dtype), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = Float8Weight(self.weight, self.weight_scale).dequantize(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
