"""A quantized weight as data, independent of any checkpoint format or kernel.

`QuantizedWeight` holds a linear layer's (out, in) weight as b-bit integers per group of
`group_size` input columns: W[o, i] = (values[o, i] - zero[o, g]) * scale[o, g] with g = i //
group_size, `values` and `zero` in the signed range [-2^(b-1), 2^(b-1)) (zero None: symmetric,
all zeros 0). `input_order` (GPTQ's act-order checkpoints) says that input column j of `values`
is column input_order[j] of the layer: the kernels permute the activations once per call.

Checkpoint formats (`formats.py`) read into it and write from it; the kernels (`linear.py`) are
built from it. So quantizing at load and writing a checkpoint then loading it meet in the same
object and give the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class QuantizedWeight:
    values: torch.Tensor  # (out, in) int8, signed range of `bits`
    scale: torch.Tensor  # (out, groups) in the model's dtype
    zero: torch.Tensor | None  # (out, groups) int8 in the signed range, or None (symmetric)
    bits: int
    group_size: int  # = in_features for one group per output channel
    input_order: torch.Tensor | None = None  # (in,) long

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.values.shape[1]

    def dequantize(self, dtype=None) -> torch.Tensor:
        """The (out, in) weight in `dtype` (default the scale's), in the layer's own column order."""
        dtype = dtype or self.scale.dtype
        q = self.values.float()
        if self.zero is not None:
            q = q - self.zero.float().repeat_interleave(self.group_size, dim=1)
        w = q * self.scale.float().repeat_interleave(self.group_size, dim=1)
        if self.input_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_order, w)
        return w.to(dtype)

    def cut(self, dim: int, segments: list[tuple[int, int]]) -> QuantizedWeight:
        """The rows (dim 0) or input columns (dim 1) in `segments`, as tensor parallelism keeps
        them: a column cut keeps whole scale groups (a per-channel scale serves the row's part),
        in the layer's own column order."""
        if dim == 0:
            rows = torch.cat([torch.arange(a, b) for a, b in segments])

            def pick(t):
                return None if t is None else t[rows].contiguous()

            return QuantizedWeight(
                pick(self.values), pick(self.scale), pick(self.zero), self.bits, self.group_size, self.input_order
            )
        if self.input_order is not None:
            raise ValueError("tp: a layer whose columns the checkpoint reorders (act-order) is not split by columns")
        width = sum(b - a for a, b in segments)
        if self.per_channel:
            values = torch.cat([self.values[:, a:b] for a, b in segments], 1).contiguous()
            return QuantizedWeight(values, self.scale, self.zero, self.bits, width)
        g = self.group_size
        if any(a % g or b % g for a, b in segments):
            raise ValueError(f"tp: the split does not fall on the quantization groups of {g} input columns")
        values = torch.cat([self.values[:, a:b] for a, b in segments], 1).contiguous()

        def groups(t):
            return None if t is None else torch.cat([t[:, a // g : b // g] for a, b in segments], 1).contiguous()

        return QuantizedWeight(values, groups(self.scale), groups(self.zero), self.bits, g)

    def with_scale_dtype(self, dtype) -> QuantizedWeight:
        """The same weight, its scale in `dtype` (the model's, which the kernels compute in)."""
        self.scale = self.scale.to(dtype)
        return self

    def to(self, device) -> QuantizedWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(
            self.values.to(device),
            self.scale.to(device),
            move(self.zero),
            self.bits,
            self.group_size,
            move(self.input_order),
        )


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits: {bits!r} is not supported; use 8 or 4")
    return bits


def quantize_weight(
    weight: torch.Tensor, bits: int, group_size: int | None = None, scale_dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """Symmetric round-to-nearest: per output channel (`group_size` None) or per group of
    `group_size` input columns. scale = max|w| / (2^(b-1) - 1) over the group, rounded to
    `scale_dtype` (default the weight's) *before* the values are computed from it, so the values
    are exactly what the stored scale reproduces; values = round(w / scale), which stays within
    +-(2^(b-1) - 1) (the most negative code is never used, so nothing is clipped)."""
    check_bits(bits)
    out_f, in_f = weight.shape
    group_size = in_f if group_size is None else group_size
    if in_f % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the layer's input width {in_f}")
    w = weight.detach().float().reshape(out_f, in_f // group_size, group_size)
    qmax = 2 ** (bits - 1) - 1
    scale = (w.abs().amax(-1) / qmax).clamp_(min=torch.finfo(torch.float32).tiny)
    scale = scale.to(scale_dtype or weight.dtype)
    values = torch.round(w / scale.float()[..., None]).clamp_(-qmax, qmax).to(torch.int8)
    return QuantizedWeight(values.reshape(out_f, in_f), scale, None, bits, group_size)


# ---- bit packing shared by the formats and the kernels --------------------------------------------
def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Signed `bits`-bit integers (int8) packed into int32 along `dim` (0 or 1), 32 // bits per
    word, element j of a word at bits [j * bits, (j + 1) * bits), stored with the offset
    2^(bits-1) (so unsigned): the layout of compressed-tensors' pack-quantized weights."""
    per = 32 // bits
    v = (values.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    if cols % per:
        v = torch.nn.functional.pad(v, (0, per - cols % per))
    v = v.reshape(rows, -1, per) << (torch.arange(per, device=v.device) * bits)
    words = v.sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, length: int, dim: int, offset: int | None = None) -> torch.Tensor:
    """The inverse of `pack_int32`: `length` elements along `dim`, as int8, minus `offset`
    (default 2^(bits-1); GPTQ's unsigned codes use the same)."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        w = w.t()
    shifts = torch.arange(per, device=w.device) * bits
    v = (w[..., None] >> shifts) & ((1 << bits) - 1)
    v = v.reshape(w.shape[0], -1)[:, :length]
    v = v - ((1 << (bits - 1)) if offset is None else offset)
    return (v.t() if dim == 0 else v).to(torch.int8).contiguous()


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Signed int4 values (out, in) as bytes (out, in / 2): column 2j in the low nibble."""
    u = (values.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int8) - 8
