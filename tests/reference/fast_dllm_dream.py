"""Run NVlabs/Fast-dLLM's own Dream decoding (`dream/model/generation_utils_block.py`:
`diffusion_generate` with `alg="confidence_threshold"`, its block-wise `_sample` with the prefix
cache or `dual_cache=True`) with its own `dream/model/modeling_dream.py` on a checkpoint, in an
interpreter with transformers 4.49 and torch. argv: the checkout, the checkpoint folder, a JSON file
of {"prompts", "configs"}; prints {"runs": [{"tokens", "nfe"}, ...]} (configs outer, prompts
inner). Its loop returns no forward count: the model's forward calls are counted."""

import json
import sys
import types

checkout, folder, job = sys.argv[1:4]
sys.path.insert(0, checkout + "/dream")

import torch  # noqa: E402
from model.generation_utils_block import DreamGenerationMixin  # noqa: E402
from model.modeling_dream import DreamModel  # noqa: E402

spec = json.load(open(job))
model = DreamModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
model.diffusion_generate = types.MethodType(DreamGenerationMixin.diffusion_generate, model)
model._sample = types.MethodType(DreamGenerationMixin._sample, model)
calls = [0]
forward = model.forward


def counted(*args, **kwargs):
    calls[0] += 1
    return forward(*args, **kwargs)


model.forward = counted
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        ids = torch.tensor([prompt])
        calls[0] = 0
        with torch.no_grad():
            out = model.diffusion_generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=c["gen_length"],
                output_history=False,
                return_dict_in_generate=True,
                steps=c["gen_length"],
                temperature=0.0,
                top_p=None,
                top_k=None,
                alg="confidence_threshold",
                block_length=c["block_length"],
                threshold=c["threshold"],
                dual_cache=c["cache"] == "dual",
            )
        runs.append({"tokens": out.sequences[0, len(prompt) :].tolist(), "nfe": calls[0]})
print(json.dumps({"runs": runs}))
