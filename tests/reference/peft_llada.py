"""Make a PEFT LoRA adapter over LLaDA's own modeling file (NVlabs/Fast-dLLM's `llada/model/`)
and run it, in an interpreter with what that file pins (transformers 4.49) and peft. argv: the
folder holding `model/`, the checkpoint folder, a JSON file of {"seed", "r", "alpha", "targets",
"inputs": [[ids]], "vocab": k}; prints {"runs": [{"adapter": {name: [[...]]}, "config": {...},
"logits": [[[...]]], "argmax": [[...]]}]}: the adapter's tensors and config as PEFT saves them, and
per input the wrapped model's logits over the first k vocabulary entries and its argmax over all.
PEFT initialises A at random and B at zero; B is drawn from the seed so the adapter does something."""

import json
import sys
import tempfile

code, folder, job = sys.argv[1:4]
sys.path.insert(0, code)

import peft  # noqa: E402
import torch  # noqa: E402
from model.modeling_llada import LLaDAModelLM  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

spec = json.load(open(job))
torch.manual_seed(spec["seed"])
model = LLaDAModelLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
config = peft.LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=spec["targets"])
wrapped = peft.get_peft_model(model, config)
with torch.no_grad():
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape) * 0.05)
wrapped.eval()
with tempfile.TemporaryDirectory() as tmp:
    wrapped.save_pretrained(tmp)
    tensors = {k: v.tolist() for k, v in load_file(f"{tmp}/adapter_model.safetensors").items()}
    saved = json.load(open(f"{tmp}/adapter_config.json"))
logits, argmax = [], []
with torch.no_grad():
    for ids in spec["inputs"]:
        out = wrapped(input_ids=torch.tensor([ids])).logits[0]
        logits.append(out[:, : spec["vocab"]].tolist())
        argmax.append(out.argmax(-1).tolist())
keep = ("r", "lora_alpha", "target_modules", "peft_type", "use_rslora", "use_dora", "bias", "fan_in_fan_out")
config_out = {k: saved[k] for k in keep if k in saved}
print(json.dumps({"runs": [{"adapter": tensors, "config": config_out, "logits": logits, "argmax": argmax}]}))
