"""Run dParallel's own Dream decoding (`Dream/model/generation_utils_semiar.py`: `diffusion_generate`
with `alg="entropy_threshold"`, its block-wise `_sample`) with its own `modeling_dream.py` on a
checkpoint, in an interpreter with transformers 4.49 and torch. argv: the checkout, the checkpoint
folder, a JSON file of {"prompts", "configs"}; prints {"runs": [{"tokens", "nfe"}, ...]} (configs
outer, prompts inner)."""

import json
import sys
import types

checkout, folder, job = sys.argv[1:4]
sys.path.insert(0, checkout + "/Dream")

import torch  # noqa: E402
from model.generation_utils_semiar import DreamGenerationMixin  # noqa: E402
from model.modeling_dream import DreamModel  # noqa: E402

spec = json.load(open(job))
model = DreamModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
model.diffusion_generate = types.MethodType(DreamGenerationMixin.diffusion_generate, model)
model._sample = types.MethodType(DreamGenerationMixin._sample, model)
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out, nfe = model.diffusion_generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=c["gen_length"],
                output_history=False,
                return_dict_in_generate=True,
                steps=c["gen_length"],
                temperature=0.0,
                top_p=None,
                top_k=None,
                alg="entropy_threshold",
                block_length=c["block_length"],
                threshold=c["threshold"],
            )
        runs.append({"tokens": out.sequences[0, len(prompt) :].tolist(), "nfe": int(nfe)})
print(json.dumps({"runs": runs}))
