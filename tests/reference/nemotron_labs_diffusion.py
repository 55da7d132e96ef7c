"""Run Nemotron-Labs-Diffusion's remote code (`modeling_nemotron_labs_diffusion.py` and
`configuration_nemotron_labs_diffusion.py`, as its Hugging Face checkpoints ship them) on a
checkpoint, in an interpreter with transformers >= 5.0 and torch. argv: a folder holding those files
(and its `modeling_ministral.py` where one has it; else `nemotron_ministral.py` beside this file
stands in for it), a checkpoint folder, a JSON file of {"logits": [[ids, k], ...], "prompts",
"configs"}; prints {"logits": [{"causal", "canvas"}, ...], "runs": [{"tokens", "nfe", "accepts"},
...]} (configs outer, prompts inner).

"logits": per sequence, the causal pass's logits of every position, and the logits of its columns
from k on computed bidirectionally against the causal cache of its first k (a block being
decoded). "configs": {"mode": "ar" | "diffusion" | "linear_spec", "gen_length", "seed",
"temperature", "stop_at_eos", and per mode "block_length", "threshold"; a thinking budget:
"max_thinking_tokens", "end_think_token_id"}: `ar_generate`,
`generate` (causal context) and `linear_spec_generate`, each run seeded with
torch.manual_seed(seed) (they draw from the global stream); without stop_at_eos the EOS id given
is -1 (their `eos_token_id=None` falls back to the config's). "tokens": the answer after the prompt;
"nfe": the forwards each counts; "accepts": LinearSpec's accepted tokens per verification.

With "adapter": {"seed", "r", "alpha", "targets"}, a PEFT LoRA adapter over the model (B drawn
from the seed, so that it does something) wraps it for every run, as its `linear_spec_lora` does
(`linear_spec_generate` turns it on for drafts only); the first of "runs" is then {"adapter":
{"tensors": {name: [...]}, "config": {...}}}, as PEFT saved it."""

import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

checkout, folder, job = sys.argv[1:4]
package = Path(tempfile.mkdtemp()) / "nemotron_reference"
package.mkdir()
(package / "__init__.py").write_text("")
for name in ("modeling_nemotron_labs_diffusion.py", "configuration_nemotron_labs_diffusion.py"):
    shutil.copy(Path(checkout, name), package / name)
backbone = Path(checkout, "modeling_ministral.py")
shutil.copy(
    backbone if backbone.exists() else Path(__file__).with_name("nemotron_ministral.py"),
    package / "modeling_ministral.py",
)
sys.path.insert(0, str(package.parent))
modeling = importlib.import_module("nemotron_reference.modeling_nemotron_labs_diffusion")
configuration = importlib.import_module("nemotron_reference.configuration_nemotron_labs_diffusion")

config = configuration.NemotronLabsDiffusionConfig.from_pretrained(folder)
model, info = modeling.NemotronLabsDiffusionModel.from_pretrained(
    folder, config=config, dtype=torch.float32, output_loading_info=True
)
missing = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
assert not missing, missing
model.eval()
spec = json.load(open(job))
made = []
if "adapter" in spec:
    import peft
    from safetensors.torch import load_file

    a = spec["adapter"]
    torch.manual_seed(a["seed"])
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=a["r"], lora_alpha=a["alpha"], target_modules=a["targets"]))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape) * 0.5)
    saved = Path(tempfile.mkdtemp())
    wrapped.save_pretrained(str(saved))
    tensors = {k: v.tolist() for k, v in load_file(str(saved / "adapter_model.safetensors")).items()}
    made.append({"adapter": {"tensors": tensors, "config": json.loads((saved / "adapter_config.json").read_text())}})
    model = wrapped.base_model.model.eval()


def causal(flag: bool) -> None:
    for layer in model.encoder.layers:
        layer.self_attn.diffusion_lm = not flag


logits = []
with torch.no_grad():
    for ids, k in spec.get("logits", []):
        x = torch.tensor([ids])
        causal(True)
        whole = model.diffusion_head(model.encoder(input_ids=x, use_cache=False).last_hidden_state)[0]
        cache = model.encoder(input_ids=x[:, :k], use_cache=True).past_key_values
        causal(False)
        canvas = model.diffusion_head(
            model.encoder(input_ids=x[:, k:], past_key_values=cache, use_cache=False).last_hidden_state
        )[0]
        logits.append({"causal": whole.tolist(), "canvas": canvas.tolist()})

accepts = []
crop = modeling._crop_dynamic_cache


def counting_crop(cache, length):
    """LinearSpec crops the cache after each verification to what it accepted: count it. Its
    `crop(length)` keeps `length` positions, as transformers' caches did before 5.x, where a
    positive count is refused and a negative one removes that many: crop so there."""
    seen = cache.get_seq_length()
    accepts.append(length - (seen - block_length))
    try:
        crop(cache, length)
    except ValueError:
        cache.crop(length - seen)


modeling._crop_dynamic_cache = counting_crop
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        x = torch.tensor([prompt])
        eos = config.eos_token_id if c.get("stop_at_eos", True) else -1
        torch.manual_seed(c.get("seed", 0))
        accepts.clear()
        block_length = c.get("block_length", 1)
        budget = {k: c[k] for k in ("max_thinking_tokens", "end_think_token_id") if k in c}
        if c["mode"] == "ar":
            out, nfe = model.ar_generate(
                x, max_new_tokens=c["gen_length"], temperature=c["temperature"], eos_token_id=eos, **budget
            )
        elif c["mode"] == "diffusion":
            out, nfe = model.generate(
                x,
                max_new_tokens=c["gen_length"],
                block_length=c["block_length"],
                threshold=c.get("threshold"),
                temperature=c["temperature"],
                eos_token_id=eos,
                **budget,
            )
        else:
            out, nfe = model.linear_spec_generate(
                x,
                max_new_tokens=c["gen_length"],
                block_length=c["block_length"],
                temperature=c["temperature"],
                threshold=c.get("threshold") or 0.0,
                eos_token_id=eos,
                **budget,
            )
        runs.append({"tokens": out[0, len(prompt) :].tolist(), "nfe": int(nfe), "accepts": list(accepts)})
print(json.dumps({"logits": logits, "runs": made + runs}))
