"""A tiny DiffusionGemma quantized by llm-compressor's own `oneshot` (run in an interpreter that has
llm-compressor and transformers' DiffusionGemma; argv: the scheme, FP8_DYNAMIC or NVFP4A16, the
output folder, and a folder holding the tokenizer to save beside it).

transformers' `DiffusionGemmaForBlockDiffusion` builds the model (weights sharpened, as
`tests/test_diffusion_gemma.py` makes its references); `oneshot` with a `QuantizationModifier` on
every Linear (the head, routers, embeddings and vision tower ignored) quantizes it, unfusing the
mixture of experts into each expert's linear layers as it does for vLLM, and `save_pretrained`
writes it compressed. Then the library decompresses each quantized layer (its compressor for the
checkpoint's format and scheme) into `library_dequantized.safetensors`. The tensors fastdllm does
not read (the vision tower's; the encoder's language model, which fastdllm reads from the decoder's
tensors, but for its layer scalars) are dropped from both files to keep the fixture small."""

import json
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors.torch import load_file, save_file
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

scheme_name, out, tokenizer_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
torch.manual_seed(0)
text = dict(
    vocab_size=832, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=6,
    layer_types=["sliding_attention", "full_attention", "full_attention"], num_experts=4, top_k_experts=2,
    moe_intermediate_size=16, max_position_embeddings=256, pad_token_id=782, eos_token_id=[782, 783],
    bos_token_id=781, final_logit_softcapping=30.0,
)  # fmt: skip
vision = dict(
    model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, head_dim=4,
)  # fmt: skip
model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=8))
with torch.no_grad():
    for name, p in model.named_parameters():
        if "vision" not in name and p.dim() > 1:
            p.mul_(6.0)
base = out.with_name(out.name + "-base")
model.save_pretrained(base)
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(tokenizer_dir / f, base)
model = DiffusionGemmaForBlockDiffusion.from_pretrained(base)
ignore = ["lm_head", "re:.*router.*", "re:.*vision.*", "re:.*embed.*"]
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme_name, ignore=ignore), tokenizer=base)
model.save_pretrained(out, save_compressed=True)
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(tokenizer_dir / f, out)
shutil.rmtree(base)

qc = json.loads((out / "config.json").read_text())["quantization_config"]
(group,) = qc["config_groups"].values()
scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
tensors = {
    k: v
    for k, v in load_file(out / "model.safetensors").items()
    if "vision" not in k and ("encoder.language_model" not in k or k.endswith("layer_scalar"))
}
library = {}
for name in tensors:
    if name.endswith(".weight_scale"):
        prefix = name.removesuffix(".weight_scale")
        local = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
        library[prefix] = compressor.decompress(local, scheme)["weight"].contiguous()
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
save_file(library, str(out / "library_dequantized.safetensors"))
(out / "recipe.yaml").unlink(missing_ok=True)
print(len(library), "quantized layers")
