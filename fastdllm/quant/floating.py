"""Floating-point quantized weights: compressed-tensors' `float-quantized` (FP8: llm-compressor's
FP8 and FP8-dynamic schemes) and `nvfp4-pack-quantized` (NVFP4) checkpoints, what vLLM's users run
on one GPU.

A layer's weight stays in its format in memory and is dequantized at each matmul exactly as the
library decompresses it, then cast to the activations' dtype, so its logits are those of the model
holding the library's decompressed weights:
- FP8 (`Float8Weight`): E4M3 values, one byte a weight, one scale per output channel or per tensor
  in the checkpoint's dtype: (values in the scale's dtype) * scale.
- NVFP4 (`NVFP4Weight`): E2M1 values packed two to a byte (the low nibble first), one FP8 E4M3
  scale per group of 16 input columns and one float32 global scale: the values in bfloat16, times
  (scale in bfloat16) / global scale in float32, rounded to bfloat16.

*Deliberate difference*: the schemes' activation quantization (FP8-dynamic per token at run time,
FP8's static scale, NVFP4's FP4 activations) is not applied: activations stay in the model's dtype,
as vLLM runs these checkpoints on GPUs without FP8 or FP4 matmuls (weight-only). `torch._scaled_mm`
on GPUs that have FP8 is not used yet.
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


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # an FP4 code's magnitude by its low three bits


@dataclass
class NVFP4Weight:
    packed: torch.Tensor  # (out, in / 2) uint8: two E2M1 codes a byte, the low nibble first
    scale: torch.Tensor  # (out, in / 16) float8_e4m3fn
    global_scale: torch.Tensor  # (1,) float32
    bits = 4
    group_size = 16

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self, dtype=None) -> torch.Tensor:
        """The (out, in) weight as compressed-tensors decompresses it (bfloat16), in `dtype`."""
        out_f, half = self.packed.shape
        codes = torch.stack([self.packed & 0x0F, self.packed >> 4], -1).reshape(out_f, half * 2)
        magnitude = torch.tensor(E2M1, device=codes.device)[(codes & 7).long()]
        values = torch.where((codes & 8).bool(), -magnitude, magnitude).to(torch.bfloat16)
        scale = self.scale.to(torch.bfloat16) / self.global_scale
        w = (values.to(scale.dtype).view(out_f, -1, 16) * scale[..., None]).view(out_f, -1).to(torch.bfloat16)
        return w.to(dtype or torch.bfloat16)

    def with_scale_dtype(self, dtype) -> NVFP4Weight:
        """Itself: its scales are the checkpoint's, as the library dequantizes with them."""
        return self

    def cut(self, dim: int, segments: list[tuple[int, int]]) -> NVFP4Weight:
        """The rows (dim 0) or input columns (dim 1, on whole groups of 16) in `segments`."""
        if dim == 0:
            rows = torch.cat([torch.arange(a, b) for a, b in segments])
            return NVFP4Weight(self.packed[rows].contiguous(), self.scale[rows].contiguous(), self.global_scale)
        if any(a % 16 or b % 16 for a, b in segments):
            raise ValueError("tp: the split does not fall on NVFP4's groups of 16 input columns")
        packed = torch.cat([self.packed[:, a // 2 : b // 2] for a, b in segments], 1).contiguous()
        scale = torch.cat([self.scale[:, a // 16 : b // 16] for a, b in segments], 1).contiguous()
        return NVFP4Weight(packed, scale, self.global_scale)

    def to(self, device) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))


class FloatingLinear(nn.Module):
    """y = x W^T (+ b) with W held as FP8 or NVFP4 and dequantized per call (its `dequantize`)."""

    def __init__(self, fw: Float8Weight | NVFP4Weight, bias: torch.Tensor | None = None, dtype=None):
        super().__init__()
        self.out_features, self.in_features = fw.shape
        self.bits, self.symmetric = fw.bits, True
        self.group_size = fw.group_size if fw.bits == 4 else self.in_features
        self.kernel = f"{'fp8' if fw.bits == 8 else 'nvfp4'}-dequantize"
        self.parts = tuple(vars(fw))  # the weight's tensors, held as buffers of those names
        for name, tensor in vars(fw).items():
            self.register_buffer(name, tensor)
        self.weight_type = type(fw)
        device = next(iter(vars(fw).values())).device
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device, dtype or torch.float32), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_type(*(getattr(self, name) for name in self.parts)).dequantize(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


QUANTIZED_WEIGHTS = (Float8Weight, NVFP4Weight)  # what `FloatingLinear` computes with
