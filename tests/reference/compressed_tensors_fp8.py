"""An FP8 or NVFP4 checkpoint as llm-compressor writes it, made with compressed-tensors' own code (run
in an interpreter that has the library; argv: the source folder, the output folder, and the scheme:
FP8_DYNAMIC, the default, or NVFP4A16).

Every linear layer of the transformer blocks (llm-compressor's `targets=["Linear"]`, the head in
`ignore`) is quantized under the preset: FP8_DYNAMIC, FP8 E4M3 weights with one scale per output
channel from the channel's min/max (activations quantized per token at run time), compressed by
`FloatQuantizationCompressor` (format `float-quantized`); NVFP4A16, FP4 E2M1 weights in groups of 16
with FP8 group scales under a global scale from the tensor's min/max, packed two to a byte by
`NVFP4PackedCompressor` (format `nvfp4-pack-quantized`). config.json gets the `quantization_config`
the library's `QuantizationConfig` serialises. Beside it, `library_dequantized.safetensors` holds
each layer's weight as the library decompresses it."""

import json
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC, NVFP4A16
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")

source, out = Path(sys.argv[1]), Path(sys.argv[2])
name = sys.argv[3] if len(sys.argv) > 3 else "FP8_DYNAMIC"
preset, compressor, ct_format = {
    "FP8_DYNAMIC": (FP8_DYNAMIC, FloatQuantizationCompressor, "float-quantized"),
    "NVFP4A16": (NVFP4A16, NVFP4PackedCompressor, "nvfp4-pack-quantized"),
}[name]
shutil.copytree(source, out, dirs_exist_ok=True)
tensors = load_file(source / "model.safetensors")
scheme = QuantizationScheme(targets=["Linear"], **preset)


def quantized(w):
    """The layer's compressed state, as the preset's observer (min/max) and the compressor make it."""
    if name == "FP8_DYNAMIC":
        scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
        return compressor.compress({"weight": w, "weight_scale": scale.to(w.dtype)}, scheme)
    g = w.float().reshape(w.shape[0], -1, 16)
    global_scale = generate_gparam(w.float().amin().reshape(1), w.float().amax().reshape(1))
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale.to(torch.float32)}
    return compressor.compress(state, scheme)


written, dequantized = {}, {}
for name, w in tensors.items():
    prefix = name.removesuffix(".weight")
    if ".blocks." not in name or w.dim() != 2 or prefix.rsplit(".", 1)[-1] not in LINEAR:
        written[name] = w
        continue
    state = quantized(w)
    written.update({f"{prefix}.{k}": v.contiguous() for k, v in state.items()})
    dequantized[prefix] = compressor.decompress(state, scheme)["weight"].contiguous()
save_file(written, str(out / "model.safetensors"))
save_file(dequantized, str(out / "library_dequantized.safetensors"))
config = json.loads((source / "config.json").read_text())
qc = QuantizationConfig(
    config_groups={"group_0": scheme},
    quant_method="compressed-tensors",
    format=ct_format,
    quantization_status="compressed",
    ignore=["lm_head"],
)
config["quantization_config"] = qc.model_dump(mode="json")
(out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
