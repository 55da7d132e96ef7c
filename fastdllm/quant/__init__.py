"""Weight-only int8 / int4 quantization: at load (`fastdllm.load(..., quantize="int8" | "int4")`),
from checkpoints already quantized (compressed-tensors, GPTQ), and written once by `fastdllm
quantize`. `weights` holds the format-free quantized weight, `linear` the kernels and the layer
swap, `formats` the checkpoint layouts."""

from .linear import QuantizedLinear, describe, install, quantize_model, quantize_weights, weight_bytes
from .weights import QuantizedWeight, quantize_weight

__all__ = [
    "QuantizedLinear",
    "QuantizedWeight",
    "describe",
    "install",
    "quantize_model",
    "quantize_weight",
    "quantize_weights",
    "weight_bytes",
]
