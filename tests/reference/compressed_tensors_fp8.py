"""An FP8 checkpoint as llm-compressor writes it, made with compressed-tensors' own code (run in an
interpreter that has the library; argv: the source folder, the output folder).

Every linear layer of the transformer blocks (llm-compressor's `targets=["Linear"]`, the head in
`ignore`) is quantized under the FP8_DYNAMIC preset (FP8 E4M3 weights with one scale per output
channel from the channel's min/max, activations quantized per token at run time), compressed by the
library's `FloatQuantizationCompressor` (format `float-quantized`), and config.json gets the
`quantization_config` the library's `QuantizationConfig` serialises. Beside it,
`library_dequantized.safetensors` holds each layer's weight as the library decompresses it."""

import json
import shutil
import sys
from pathlib import Path

from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")

source, out = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(source, out, dirs_exist_ok=True)
tensors = load_file(source / "model.safetensors")
scheme = QuantizationScheme(targets=["Linear"], **FP8_DYNAMIC)
written, dequantized = {}, {}
for name, w in tensors.items():
    prefix = name.removesuffix(".weight")
    if ".blocks." not in name or w.dim() != 2 or prefix.rsplit(".", 1)[-1] not in LINEAR:
        written[name] = w
        continue
    scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
    state = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype)}, scheme)
    written.update({f"{prefix}.{k}": v.contiguous() for k, v in state.items()})
    dequantized[prefix] = FloatQuantizationCompressor.decompress(state, scheme)["weight"].contiguous()
save_file(written, str(out / "model.safetensors"))
save_file(dequantized, str(out / "library_dequantized.safetensors"))
config = json.loads((source / "config.json").read_text())
qc = QuantizationConfig(
    config_groups={"group_0": scheme},
    quant_method="compressed-tensors",
    format="float-quantized",
    quantization_status="compressed",
    ignore=["lm_head"],
)
config["quantization_config"] = qc.model_dump(mode="json")
(out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
