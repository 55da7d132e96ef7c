"""compressed-tensors' own packing, run in an interpreter that has the library (argv: a JSON job).

The job names a safetensors file of layers written by fastdllm's encoder, with each layer's
scheme; this decompresses them with the library's `PackedQuantizationCompressor` into
`ours_by_library.safetensors`, and compresses random weights with the library under the same
schemes into `library.safetensors` (what llm-compressor writes), with the library's own
dequantized weights in `library_dequantized.safetensors`."""

import json
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file

job = json.load(open(sys.argv[1]))
out = Path(job["out"])
ours = load_file(job["ours"])
decompressed, written, dequantized = {}, {}, {}
torch.manual_seed(0)
for layer in job["layers"]:
    prefix, args = layer["prefix"], QuantizationArgs(**layer["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    local = {k.removeprefix(prefix + "."): v for k, v in ours.items() if k.startswith(prefix + ".")}
    if local:
        decompressed[prefix] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    w = torch.randn(layer["shape"], dtype=torch.bfloat16)
    group = args.group_size or w.shape[1]
    g = w.float().reshape(w.shape[0], -1, group)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    state = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zp}, scheme
    )
    written.update({f"{prefix}.{k}": v.contiguous() for k, v in state.items()})
    full = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    dequantized[prefix] = full.float().contiguous()
out.mkdir(parents=True, exist_ok=True)
save_file(decompressed, str(out / "ours_by_library.safetensors"))
save_file(written, str(out / "library.safetensors"))
save_file(dequantized, str(out / "library_dequantized.safetensors"))
print(json.dumps({"decompressed": len(decompressed), "written": len(dequantized)}))
