"""`QuantizedLinear`: weight-only int8 / int4 linear layers, and swapping them into a model.

Activations (and so the KV cache) stay in the model's dtype; only the weights are integers. Each
layer picks the fastest kernel that runs for its device, dtype and layout when it is built:

- int8, symmetric, one scale per output channel: PyTorch's `_weight_int8pack_mm` (CPU; other
  devices where this torch build has it).
- int4 on CPU, groups of 32-256 columns, output width a multiple of 16: PyTorch's
  `_weight_int4pack_mm_for_cpu` on weights packed once by `_convert_weight_to_int4pack_for_cpu`.
- everything else (CUDA int4, asymmetric int8, grouped int8, shapes a kernel refuses): the
  weight is kept packed (a byte per int8 value, two int4 values per byte) and dequantized to the
  model's dtype inside each call, then one dense matmul. Slower than a fused kernel, but the
  memory saving is the same and the result is the same function.

Why not torchao: its int4 weight-only tensors have no CPU kernel in torchao 0.18 (its plain and
preshuffled formats need the mslk package, plain_int32 has no CPU path, tile-packed needs CUDA)
and its CPU fallback (`IntxWeightOnlyConfig`) keeps a byte per int4 value, so it saves no memory
over int8; on CUDA its int4 path is tinygemm, the kernel behind `torch.ops.aten._weight_int4pack_mm`.
The kernels used here are PyTorch's own, which torchao calls too.

The quantized model stays a plain `Transformer`: every cache, policy, batch, server and eval path
runs unchanged. Embeddings, norms, routers and (unless asked) the output head stay in full
precision; so do a mixture of experts' routed experts (stacked tensors, not linear layers).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .floating import QUANTIZED_WEIGHTS, FloatingLinear
from .weights import GROUP_SIZES, QuantizedWeight, check_bits, pack_nibbles, quantize_weight, unpack_nibbles


@functools.cache
def kernel_runs(kind: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch build runs kernel `kind` ("int8" or "int4") on this device and dtype:
    tried once on a tiny input, so a missing kernel means the fallback, not an error."""
    device = torch.device(device_type)
    try:
        x = torch.ones(1, 64, dtype=dtype, device=device)
        if kind == "int8":
            w = torch.ones(16, 64, dtype=torch.int8, device=device)
            torch._weight_int8pack_mm(x, w, torch.ones(16, dtype=dtype, device=device))
        elif kind == "int4" and device_type == "cpu":
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.ones(16, 64, dtype=torch.int32), 8)
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, torch.ones(2, 16, 2, dtype=dtype))
        else:
            return False
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def kernel_dtype_for(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a quantized layer's kernel computes in: the model's, except float32 on a CPU,
    where PyTorch's int8 and int4 kernels have no vectorised path (on one thread, a 1024 x 256
    layer over 32 rows: 7.1 ms in float32 against 0.25 ms in bfloat16, and 0.21 ms for the dense
    float32 layer; `benchmarks/quantized_kernels.py`). There the activations enter the kernel in
    bfloat16, and its outputs, accumulated in float32 and rounded to bfloat16, come back as
    float32: roundings to 8 bits of mantissa, finer than the weights' own (llama.cpp's Q8_0 and
    Q4_0 products round the activations to 8-bit integers)."""
    if device_type == "cpu" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def dequantize_above_rows(device_type: str, weight_elements: int, kernel_casts: bool) -> int:
    """Rows above which an int8 layer dequantizes its weight for one dense matmul rather than run
    PyTorch's int8 kernel. Dequantizing costs in proportion to the weight, the kernel's loss per
    row in proportion to it too, but a large weight leaves the cache as it dequantizes, so the
    break-even grows with it; with float32 activations (`kernel_casts`: the kernel runs in
    bfloat16) the dense matmul it is weighed against is dearer, and the break-even four times as
    far (`benchmarks/quantized_kernels.py [--dtype float32]` on one CPU thread: at 4096 x 4096 the
    kernel wins at 32 rows and loses at 256 in bfloat16, wins at 256 and loses at 1024 in float32;
    at 512 x 192 it loses from 32 rows in both). On CUDA the kernel loses at every row count (see
    `QuantizedLinear`)."""
    if device_type != "cpu":
        return 0
    return max(32, weight_elements // (32768 if kernel_casts else 131072))


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W held as a `QuantizedWeight` in the buffers its kernel needs
    (`kernel`: "int8", "int4-cpu" or "dequantize").

    PyTorch's int8 kernel is fast for a few rows (a 4096 x 4096 layer on one CPU thread: 1.4 ms
    for one row against 3.1 ms in bf16) and slow for many (133 ms for 256 rows against 40 ms;
    `benchmarks/quantized_kernels.py`), and a diffusion model's forwards carry a block of positions
    per row of the batch; so above `dequantize_above` rows an int8 layer dequantizes its weight and
    runs one dense matmul (79 ms for those 256 rows); where that pays depends on the weight's size
    and the activations' dtype (`dequantize_above_rows`). The int4 CPU kernel's weight layout
    is its own, with no cheap way back to a dense weight, so int4 layers always use the kernel
    (12.7 ms for 32 rows against 7.2 ms in bf16).

    On CUDA the int8 kernel loses at every row count the loop uses: on an H200, replaying the
    default config's schedules on 4 layers of LLaDA-8B's width, one row decoded 99 tokens/s through
    it against 3,015 in bf16 (`benchmarks/gpu_check.py --quant int8`), so there an int8 layer always
    dequantizes."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size = qw.bits, qw.group_size
        self.symmetric = qw.zero is None
        dtype = dtype or qw.scale.dtype
        device = qw.values.device
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)
        self.register_buffer("input_order", qw.input_order)
        n, k = qw.shape
        kernel_dtype = kernel_dtype_for(device.type, dtype)
        # PyTorch's CPU int8 kernel reads bfloat16 inputs 16 columns at a time: a width that is no
        # multiple of 16 crashes the process, so such a layer dequantizes instead
        if (
            qw.bits == 8
            and qw.per_channel
            and qw.zero is None
            and k % 16 == 0
            and kernel_runs("int8", device.type, kernel_dtype)
        ):
            self.kernel = "int8"
            self.register_buffer("qweight", qw.values.contiguous())
            self.register_buffer("scales", qw.scale[:, 0].to(dtype).contiguous())
        elif (
            qw.bits == 4
            and device.type == "cpu"
            and qw.group_size in GROUP_SIZES
            and n % 16 == 0
            and kernel_runs("int4", "cpu", kernel_dtype)
        ):
            self.kernel = "int4-cpu"
            unsigned = (qw.values.to(torch.int32) + 8).contiguous()
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 8))
            # The kernel computes (q - 8) * scale + zero with q unsigned: our zero point in its terms.
            scale = qw.scale.float()
            offset = torch.zeros_like(scale) if qw.zero is None else -qw.zero.float() * scale
            self.register_buffer(
                "scales_and_zeros", torch.stack([scale, offset], -1).transpose(0, 1).to(dtype).contiguous()
            )
        else:
            self.kernel = "dequantize"
            kernel_dtype = dtype
            self.register_buffer("qweight", pack_nibbles(qw.values) if qw.bits == 4 else qw.values.contiguous())
            self.register_buffer("scales", qw.scale.to(dtype).contiguous())
            self.register_buffer("zeros", None if qw.zero is None else qw.zero.contiguous())
        self.dtype, self.kernel_dtype = dtype, kernel_dtype
        self.dequantize_above = dequantize_above_rows(device.type, n * k, kernel_dtype != dtype)
        # The scales in the kernel's dtype, cast once (the model dtype's stay exact for `dequantized`).
        scales = {"int8": "scales", "int4-cpu": "scales_and_zeros"}.get(self.kernel)
        if scales is not None:
            self.register_buffer("kernel_scales", getattr(self, scales).to(kernel_dtype), persistent=False)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, symmetric={self.symmetric}, kernel={self.kernel}"
        )

    def dequantized(self) -> torch.Tensor:
        """The (out, in) weight in the model's dtype, in the order the kernel reads the inputs."""
        if self.kernel == "int8":
            return self.qweight.to(self.dtype) * self.scales[:, None]
        if self.kernel == "int4-cpu":  # through the kernel in the model's dtype: exact, if slow in float32
            eye = torch.eye(self.in_features, dtype=self.dtype, device=self.qweight.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.qweight, self.group_size, self.scales_and_zeros
            ).t()
        q = (unpack_nibbles(self.qweight) if self.bits == 4 else self.qweight).to(self.dtype)
        groups = self.in_features // self.group_size
        q = q.view(self.out_features, groups, self.group_size)
        if self.zeros is not None:
            q = q - self.zeros.to(self.dtype)[..., None]
        return (q * self.scales[..., None]).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "int8" and x2.shape[0] > self.dequantize_above:
            y = F.linear(x2, self.dequantized())
        elif self.kernel == "int8":
            y = torch._weight_int8pack_mm(x2.to(self.kernel_dtype), self.qweight, self.kernel_scales).to(self.dtype)
        elif self.kernel == "int4-cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(self.kernel_dtype), self.qweight, self.group_size, self.kernel_scales
            ).to(self.dtype)
        else:
            y = F.linear(x2, self.dequantized())
        y = y.view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def _apply(self, fn, recurse=True):
        # The int4 CPU layout is the kernel's own: moving it would silently mean something else.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.qweight.device))
        if probe.device != self.qweight.device:
            raise ValueError(
                f"a quantized layer built for {self.qweight.device} cannot move to {probe.device}: "
                f"load with device={str(probe.device)!r} and quantize there"
            )
        if probe.dtype != self.dtype:
            raise ValueError(
                f"a quantized layer computing in {self.dtype} cannot change to {probe.dtype}: "
                f"load with that dtype and quantize then"
            )
        return super()._apply(fn, recurse)


# ---- which layers, and swapping them -------------------------------------------------------------
def quantizable_linears(model, include_head: bool = False) -> dict[str, nn.Linear]:
    """Our module name -> the linear layers weight-only quantization covers: attention and MLP
    projections (dense layers and shared experts); the output head only when asked. Routers stay
    in full precision (their scores choose the experts), and so does a vision tower (run once per
    image, as llm-compressor's recipes leave it)."""
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name.endswith(".router") or name.startswith("vision.") or (name == "output" and not include_head):
            continue
        found[name] = module
    return found


def choose_group_size(model, bits: int, group_size: int | None, include_head: bool = False) -> int | None:
    """The group size to quantize with: int8 is per output channel (None) unless told; int4
    defaults to 128 columns, or the largest of 64 / 32 that divides every quantized layer's input
    width (one size for the whole model, as the checkpoint formats record it)."""
    widths = {m.in_features for m in quantizable_linears(model, include_head).values()}
    if group_size is not None:
        if group_size not in GROUP_SIZES:
            raise ValueError(
                f"group_size: {group_size} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}"
            )
        bad = sorted(w for w in widths if w % group_size)
        if bad:
            raise ValueError(
                f"group_size: {group_size} does not divide the input width {bad[0]} of this model's layers"
            )
        return group_size
    if bits == 8:
        return None
    for size in (128, 64, 32):
        if all(w % size == 0 for w in widths):
            return size
    raise ValueError(f"group_size: no group size of 128, 64 or 32 divides every layer's input width ({sorted(widths)})")


def quantize_weights(
    model, bits: int, group_size: int | None = None, include_head: bool = False
) -> dict[str, QuantizedWeight]:
    """Our module name -> its weight quantized (round to nearest, symmetric; `weights.quantize_weight`)."""
    check_bits(bits)
    size = choose_group_size(model, bits, group_size, include_head)
    return {
        name: quantize_weight(m.weight, bits, size, scale_dtype=m.weight.dtype)
        for name, m in quantizable_linears(model, include_head).items()
    }


def install(
    model,
    weights: dict[str, QuantizedWeight],
    *,
    device=None,
    dtype=None,
    biases: dict[str, torch.Tensor | None] | None = None,
):
    """Replace each named linear layer by a `QuantizedLinear` of its quantized weight, built on
    `device` and computing in `dtype` (default: the replaced layer's), with `biases[name]`
    (default: the replaced layer's bias). Returns the model."""
    for name, qw in weights.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        bias = biases.get(name) if biases is not None else old.bias
        layer = FloatingLinear if isinstance(qw, QUANTIZED_WEIGHTS) else QuantizedLinear
        new = layer(qw.to(device or old.weight.device), bias, dtype=dtype or old.weight.dtype)
        new._forward_hooks.update(old._forward_hooks)  # e.g. tensor parallelism's all-reduce
        setattr(parent, attr, new)
    if weights:
        model._compiled_layers = None  # compiled layers closed over the old modules
        model.quantization = describe(model)
    return model


def quantize_model(model, bits: int, group_size: int | None = None, include_head: bool = False):
    """Weight-only quantization of `model` in place (see the module docstring); returns it."""
    return install(model, quantize_weights(model, bits, group_size, include_head))


def describe(model) -> dict | None:
    """bits, group sizes ("channel": one scale per output channel), symmetric, kernels and layer count of
    a quantized model (None if it is not)."""
    layers = [m for m in model.modules() if isinstance(m, (QuantizedLinear, FloatingLinear))]
    if not layers:
        return None
    return {
        "bits": sorted({m.bits for m in layers}),
        "group_size": sorted({m.group_size for m in layers if m.group_size != m.in_features}) or "channel",
        "symmetric": all(m.symmetric for m in layers),
        "kernels": sorted({m.kernel for m in layers}),
        "layers": len(layers),
    }


def weight_bytes(model) -> dict:
    """Resident bytes of the weights: all of them, and the linear layers' share (quantized or not)
    that quantization acts on. Non-persistent buffers (RoPE tables) are not weights."""
    persistent = {name for name, _ in model.named_buffers() if name.rsplit(".", 1)[-1] not in ("rope_cos", "rope_sin")}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name in persistent)
    linear = 0
    for name, module in model.named_modules():
        if (
            isinstance(module, (nn.Linear, QuantizedLinear, FloatingLinear))
            and not name.endswith(".router")
            and name != "output"
        ):
            linear += sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
    return {"weight_bytes": total, "linear_weight_bytes": linear}
