"""Quantized checkpoint layouts the ecosystem ships, read into and written from `QuantizedWeight`.

**compressed-tensors** (llm-compressor's output, what vLLM loads): config.json's
`quantization_config` has `quant_method: "compressed-tensors"`, a `format` and `config_groups`
of weight schemes. Per quantized linear layer `P`:
- `pack-quantized`: `P.weight_packed` int32 (out, in * bits / 32), values packed along the input
  dimension with the offset 2^(bits-1); `P.weight_scale` (out, groups); `P.weight_shape` (2,);
  asymmetric schemes add `P.weight_zero_point` packed the same way along the output dimension;
  act-order schemes add `P.weight_g_idx`.
- `int-quantized` / `naive-quantized`: `P.weight` int8 (out, in) with `P.weight_scale` (and
  `P.weight_zero_point` int8 when asymmetric).
- `float-quantized` (FP8: llm-compressor's FP8 and FP8_DYNAMIC schemes): `P.weight` float8_e4m3fn
  (out, in) with `P.weight_scale` (out, 1) per channel or (1,) per tensor (`floating.Float8Weight`);
- `nvfp4-pack-quantized` (NVFP4): `P.weight_packed` uint8 (out, in / 2), two FP4 E2M1 codes a byte
  (the low nibble first), `P.weight_scale` float8_e4m3fn (out, in / 16), `P.weight_global_scale`
  float32 (1,) (`floating.NVFP4Weight`); for both, the schemes' activation quantization is not
  applied (`floating`'s docstring).

**GPTQ** (AutoGPTQ / GPTQModel; `quant_method: "gptq"` in config.json or a `quantize_config.json`):
`P.qweight` int32 (in * bits / 32, out) packed along the input dimension, unsigned codes;
`P.qzeros` int32 (groups, out * bits / 32) packed along the output dimension; `P.scales`
(groups, out); `P.g_idx` int32 (in,), each input column's group (act-order when not
in order). `checkpoint_format` "gptq" (the default) stores each zero point minus one, "gptq_v2"
stores it as is. W = (q - z) * s.

Which layers are quantized is read from the tensors themselves (a layer with `weight_packed` or
`qweight` is); the bit width, group size and symmetry are read from the shapes and checked
against the config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .floating import Float8Weight, NVFP4Weight
from .weights import QuantizedWeight, pack_int32, unpack_int32

COMPRESSED_TENSORS = "compressed-tensors"
GPTQ = "gptq"
FORMATS = (COMPRESSED_TENSORS, GPTQ)
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "nvfp4-pack-quantized")


class QuantFormat:
    """A parsed `quantization_config`: which format, and the scheme it declares."""

    def __init__(
        self,
        method: str,
        bits: int | None = None,
        group_size: int | None = None,
        symmetric: bool = True,
        ct_format: str | None = None,
        zero_offset: int = 0,
        desc_act: bool = False,
    ):
        self.method, self.bits, self.group_size, self.symmetric = method, bits, group_size, symmetric
        self.ct_format, self.zero_offset, self.desc_act = ct_format, zero_offset, desc_act

    def __repr__(self):
        return f"QuantFormat({self.method}, bits={self.bits}, group_size={self.group_size}, symmetric={self.symmetric})"


def _fail(where: str, what: str):
    raise ValueError(
        f"{where}: {what}; fastdllm reads weight-only compressed-tensors "
        f"({', '.join(CT_FORMATS)}: int weights, FP8 per channel or tensor, NVFP4 in groups of 16) and GPTQ "
        "(4 or 8 bits) checkpoints"
    )


def read_quant_format(folder: Path, config: dict) -> QuantFormat | None:
    """The checkpoint's quantization (None: not quantized), or a ValueError in one line that says
    what was read and what is supported."""
    qc = config.get("quantization_config")
    where = f"{folder / 'config.json'}: quantization_config"
    if qc is None and (folder / "quantize_config.json").is_file():  # older AutoGPTQ checkpoints
        where = str(folder / "quantize_config.json")
        try:
            qc = {"quant_method": GPTQ, **json.loads((folder / "quantize_config.json").read_text())}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        _fail(where, f"is {type(qc).__name__}, not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == GPTQ:
        bits = qc.get("bits")
        if bits not in (4, 8):
            _fail(where, f"GPTQ bits={bits!r}")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            _fail(where, f"GPTQ checkpoint_format {fmt!r} (only 'gptq' and 'gptq_v2')")
        group = qc.get("group_size", -1)
        return QuantFormat(
            GPTQ,
            bits,
            None if group in (-1, None) else int(group),
            bool(qc.get("sym", True)),
            zero_offset=1 if fmt == "gptq" else 0,
            desc_act=bool(qc.get("desc_act", False)),
        )
    if method == COMPRESSED_TENSORS:
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        schemes = [g for g in groups.values() if isinstance(g, dict)]
        if not schemes:
            _fail(where, "compressed-tensors with no config_groups")
        bits = set()
        for scheme in schemes:
            fmt = scheme.get("format") or fmt
            w = scheme.get("weights") or {}
            fp8 = w.get("type") == "float" and w.get("num_bits") == 8
            fp4 = w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == 16
            # float schemes quantize activations too, which runs weight-only here (`floating`)
            if not (fp8 or fp4) and (scheme.get("input_activations") or scheme.get("output_activations")):
                _fail(where, "activation quantization of int weights (only weight-only schemes run here)")
            if not (fp8 or fp4) and (w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8)):
                _fail(where, f"weights of type {w.get('type')!r} with num_bits {w.get('num_bits')!r}")
            strategies = ("channel", "tensor") if fp8 else ("tensor_group",) if fp4 else ("channel", "group", "tensor")
            if w.get("strategy", "channel") not in strategies:
                _fail(where, f"weight strategy {w.get('strategy')!r}{' for FP8' if fp8 else ''}")
            bits.add(w["num_bits"])
        if fmt not in CT_FORMATS:
            _fail(where, f"compressed-tensors format {fmt!r}")
        if qc.get("sparsity_config"):
            _fail(where, "a sparsity_config")
        return QuantFormat(COMPRESSED_TENSORS, bits.pop() if len(bits) == 1 else None, ct_format=fmt)
    _fail(where, f"quant_method {qc.get('quant_method')!r}")


def is_quantized(fmt: QuantFormat, tensors: set[str], prefix: str) -> bool:
    """Whether the checkpoint holds layer `prefix` (its name without `.weight`) quantized."""
    if fmt.method == GPTQ:
        return f"{prefix}.qweight" in tensors
    return f"{prefix}.weight_packed" in tensors or f"{prefix}.weight_scale" in tensors


def decode(fmt: QuantFormat, get, prefix: str, has) -> QuantizedWeight:
    """Read layer `prefix`'s tensors (`get(name)`, `has(name)`) into a `QuantizedWeight`."""
    if fmt.method == GPTQ:
        return _decode_gptq(fmt, get, prefix, has)
    return _decode_ct(fmt, get, prefix, has)


def _group_size(in_f: int, groups: int, where: str) -> int:
    if groups < 1 or in_f % groups:
        raise ValueError(f"{where}: {groups} scale groups do not divide the input width {in_f}")
    return in_f // groups


def _decode_ct(fmt, get, prefix, has) -> QuantizedWeight | Float8Weight | NVFP4Weight:
    scale = get(f"{prefix}.weight_scale")
    if fmt.ct_format == "float-quantized":
        values = get(f"{prefix}.weight")
        if values.dtype != torch.float8_e4m3fn or values.dim() != 2:
            raise ValueError(f"{prefix}.weight: {values.dtype} {tuple(values.shape)} in an FP8 checkpoint")
        scale = scale.reshape(-1, 1)
        if scale.shape[0] not in (1, values.shape[0]):
            raise ValueError(f"{prefix}.weight_scale: {scale.shape[0]} scales for {values.shape[0]} output channels")
        return Float8Weight(values, scale)
    if fmt.ct_format == "nvfp4-pack-quantized":
        packed, global_scale = get(f"{prefix}.weight_packed"), get(f"{prefix}.weight_global_scale")
        if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{prefix}: {packed.dtype} codes with {scale.dtype} scales in an NVFP4 checkpoint")
        if scale.shape != (packed.shape[0], packed.shape[1] * 2 // 16):
            raise ValueError(f"{prefix}.weight_scale: {tuple(scale.shape)} for codes {tuple(packed.shape)}")
        return NVFP4Weight(packed, scale, global_scale.reshape(1).float())
    if has(f"{prefix}.weight_packed"):
        packed = get(f"{prefix}.weight_packed")
        out_f, in_f = (int(v) for v in get(f"{prefix}.weight_shape").tolist())
        bits = packed.shape[1] * 32 // in_f
        if bits not in (4, 8) or packed.shape[0] != out_f:
            raise ValueError(
                f"{prefix}.weight_packed: shape {tuple(packed.shape)} is not a 4- or 8-bit packing "
                f"of weight_shape {(out_f, in_f)}"
            )
        values = unpack_int32(packed, bits, in_f, dim=1)
    else:
        values = get(f"{prefix}.weight")
        if values.dtype != torch.int8:
            raise ValueError(f"{prefix}.weight: {values.dtype} in an int-quantized checkpoint (expected int8)")
        (out_f, in_f), bits = values.shape, fmt.bits or 8
    if fmt.bits is not None and bits != fmt.bits:
        raise ValueError(f"{prefix}: {bits}-bit weights, but quantization_config says {fmt.bits}")
    if scale.dim() == 0 or scale.numel() == 1:  # one scale for the tensor
        scale = scale.reshape(1, 1).expand(out_f, 1)
    scale = scale.reshape(out_f, -1)
    group_size = _group_size(in_f, scale.shape[1], prefix)
    zero = None
    if has(f"{prefix}.weight_zero_point"):
        z = get(f"{prefix}.weight_zero_point")
        zero = unpack_int32(z, bits, out_f, dim=0) if z.dtype == torch.int32 else z.to(torch.int8)
        zero = zero.reshape(out_f, -1)
        if not zero.any():
            zero = None
    return _weight(values, scale, zero, bits, group_size, get, has, f"{prefix}.weight_g_idx", prefix)


def _weight(values, scale, zero, bits, group_size, get, has, g_idx_name: str, where: str) -> QuantizedWeight:
    """The decoded layer, its columns put in group order when the checkpoint's g_idx shuffles them."""
    order = _order_from_groups(get(g_idx_name), group_size, where) if has(g_idx_name) else None
    if order is not None:
        values = values[:, order]
    return QuantizedWeight(
        values.contiguous(), scale.contiguous(), None if zero is None else zero.contiguous(), bits, group_size, order
    )


def _order_from_groups(g_idx: torch.Tensor, group_size: int, where: str) -> torch.Tensor | None:
    """The column order that makes each group contiguous (None when it already is)."""
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(len(g_idx)) // group_size):
        return None
    order = torch.argsort(g_idx, stable=True)
    counts = torch.bincount(g_idx, minlength=len(g_idx) // group_size)
    if not bool((counts == group_size).all()):
        raise ValueError(f"{where}: g_idx does not give every group {group_size} columns")
    return order


def _decode_gptq(fmt, get, prefix, has) -> QuantizedWeight:
    qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    bits = fmt.bits
    out_f = qweight.shape[1]
    in_f = qweight.shape[0] * 32 // bits
    if has(f"{prefix}.g_idx"):
        g_idx = get(f"{prefix}.g_idx")
        in_f = len(g_idx)
    groups = scales.shape[0]
    group_size = _group_size(in_f, groups, prefix)
    if fmt.group_size is not None and group_size != fmt.group_size:
        raise ValueError(f"{prefix}: groups of {group_size} columns, but quantization_config says {fmt.group_size}")
    half = 1 << (bits - 1)
    # Unsigned codes to the signed range: q - 2^(b-1); the zero point likewise.
    values = unpack_int32(qweight, bits, in_f, dim=0, offset=half).t()
    zero = unpack_int32(qzeros, bits, out_f, dim=1, offset=0).to(torch.int16) + fmt.zero_offset - half
    zero = zero.t().to(torch.int8)
    if not zero.any():
        zero = None
    return _weight(values, scales.t(), zero, bits, group_size, get, has, f"{prefix}.g_idx", prefix)


# ---- writing ---------------------------------------------------------------------------------------
def encode(method: str, qw: QuantizedWeight, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized layer."""
    if qw.input_order is not None:
        raise ValueError(f"{prefix}: writing act-order weights is not supported")
    out_f, in_f = qw.shape
    if method == COMPRESSED_TENSORS:
        tensors = {
            f"{prefix}.weight_packed": pack_int32(qw.values, qw.bits, dim=1),
            f"{prefix}.weight_scale": qw.scale.contiguous(),
            f"{prefix}.weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
        }
        if qw.zero is not None:
            tensors[f"{prefix}.weight_zero_point"] = pack_int32(qw.zero, qw.bits, dim=0)
        return tensors
    if method == GPTQ:
        half = 1 << (qw.bits - 1)
        zero = qw.zero.to(torch.int16) if qw.zero is not None else torch.zeros(qw.scale.shape, dtype=torch.int16)
        stored_zero = (zero + half - 1).to(torch.int16)  # gptq (v1) stores z - 1, unsigned
        groups = qw.scale.shape[1]
        return {
            f"{prefix}.qweight": pack_int32(qw.values.t(), qw.bits, dim=0),
            f"{prefix}.qzeros": _pack_unsigned(stored_zero.t(), qw.bits),
            f"{prefix}.scales": qw.scale.t().contiguous(),
            f"{prefix}.g_idx": (torch.arange(in_f) // (in_f // groups)).to(torch.int32),
        }
    raise ValueError(f"format: {method!r} is not one of {', '.join(FORMATS)}")


def _pack_unsigned(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes packed along the last dimension (GPTQ's qzeros)."""
    return pack_int32((codes - (1 << (bits - 1))).to(torch.int8), bits, dim=1)


def quantization_config(method: str, bits: int, group_size: int | None, ignore: list[str]) -> dict:
    """config.json's `quantization_config` for weights written by `encode` (symmetric, round to
    nearest), as the format's own tools write it."""
    if method == COMPRESSED_TENSORS:
        weights = {
            "num_bits": bits,
            "type": "int",
            "symmetric": True,
            "dynamic": False,
            "actorder": None,
            "block_structure": None,
            "observer": "minmax",
            "observer_kwargs": {},
            "strategy": "channel" if group_size is None else "group",
            "group_size": group_size,
        }
        return {
            "quant_method": COMPRESSED_TENSORS,
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "format": "pack-quantized",
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ignore,
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "global_compression_ratio": None,
        }
    if method == GPTQ:
        return {
            "quant_method": GPTQ,
            "bits": bits,
            "group_size": -1 if group_size is None else group_size,
            "sym": True,
            "desc_act": False,
            "checkpoint_format": "gptq",
            "lm_head": False,
            "damp_percent": 0.0,
            "true_sequential": True,
        }
    raise ValueError(f"format: {method!r} is not one of {', '.join(FORMATS)}")
