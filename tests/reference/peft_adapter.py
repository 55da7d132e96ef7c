"""Make a PEFT LoRA adapter over a family's own modeling file and run it, in an interpreter with
what that file pins and peft: LLaDA's (NVlabs/Fast-dLLM's `llada/model/`, transformers 4.49) or,
with "block_size" in the job, a block-causal checkpoint's own files loaded by transformers (SDAR's,
4.52.4), attending block-causally as its evaluation routine's mask says. argv: the folder holding
LLaDA's `model/` (unused for the other), the checkpoint folder, a JSON file of {"seed", "r",
"alpha", "targets", "inputs": [[ids]], "vocab": k, ["block_size": b]}; prints {"runs":
[{"adapter": {name: [[...]]}, "config": {...}, "logits": [[[...]]], "argmax": [[...]]}]}: the
adapter's tensors and config as PEFT saves them, and per input the wrapped model's logits over the
first k vocabulary entries and its argmax over all. PEFT initialises A at random and B at zero;
B is drawn from the seed so the adapter does something."""

import json
import sys
import tempfile

code, folder, job = sys.argv[1:4]
sys.path.insert(0, code)

import peft  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

spec = json.load(open(job))
torch.manual_seed(spec["seed"])
if "block_size" in spec:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
else:
    from model.modeling_llada import LLaDAModelLM

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
        kwargs = {}
        if "block_size" in spec:  # its evaluation routine's block-causal mask, (1, L, L) of ones and zeros
            blocks = torch.arange(len(ids)) // spec["block_size"]
            kwargs["attention_mask"] = (blocks[None, :] <= blocks[:, None]).float()[None]
            kwargs["position_ids"] = torch.arange(len(ids))[None]
        out = wrapped(input_ids=torch.tensor([ids]), **kwargs).logits[0]
        logits.append(out[:, : spec["vocab"]].tolist())
        argmax.append(out.argmax(-1).tolist())
keep = ("r", "lora_alpha", "target_modules", "peft_type", "use_rslora", "use_dora", "bias", "fan_in_fan_out")
config_out = {k: saved[k] for k in keep if k in saved}
print(json.dumps({"runs": [{"adapter": tensors, "config": config_out, "logits": logits, "argmax": argmax}]}))
