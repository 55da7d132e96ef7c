"""Run a LLaDA reference's own `generate.py` (NVlabs/Fast-dLLM's `llada/`, czg1225/dParallel's
`LLaDA/`: `generate`, `generate_with_prefix_cache`, `generate_with_dual_cache`, with the same
signature) on a checkpoint and prompts, in an interpreter that has the packages the reference pins
(transformers 4.49, einops, numpy): not ours, so it runs in a subprocess. argv: the folder holding
the reference's `generate.py` and `model/`, the checkpoint folder, a JSON file of {"mask_id",
"prompts", "configs"} (a config without "steps" takes one per position); prints {"runs":
[{"tokens", "nfe"}, ...]} (configs outer, prompts inner)."""

import json
import sys

code, folder, job = sys.argv[1:4]
sys.path.insert(0, code)

import generate as reference  # noqa: E402  (the reference's module, from the checkout)
import torch  # noqa: E402
from model.modeling_llada import LLaDAModelLM  # noqa: E402

spec = json.load(open(job))
model = LLaDAModelLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
loops = {
    "none": reference.generate,
    "prefix": reference.generate_with_prefix_cache,
    "dual": reference.generate_with_dual_cache,
}
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        x, nfe = loops[c["cache"]](
            model,
            torch.tensor([prompt]),
            steps=c.get("steps", c["gen_length"]),
            gen_length=c["gen_length"],
            block_length=c["block_length"],
            temperature=0.0,
            remasking="low_confidence",
            mask_id=spec["mask_id"],
            threshold=c["threshold"],
        )
        runs.append({"tokens": x[0, len(prompt) :].tolist(), "nfe": int(nfe)})
print(json.dumps({"runs": runs}))
