"""Run Fast-dLLM v2's own `batch_sample` (its `v2/generation_functions.py`) with the modeling file
its checkpoints ship (`modeling.py`, `configuration.py`), in an interpreter with what it pins
(transformers 4.53.1, einops). argv: the folder holding those three files, the checkpoint folder,
a JSON file of {"mask_id", "stop", "pad", "block_length", "prompts", "configs"}; prints
{"runs": [{"tokens"}]} (configs outer, prompts inner), greedy (temperature 0)."""

import json
import shutil
import sys
import types

import torch

reference, folder, job = sys.argv[1:4]
for name in ("configuration.py", "modeling.py", "generation_functions.py"):
    shutil.copy(f"{reference}/{name}", f"{folder}/{name}")
sys.path.insert(0, folder)  # modeling.py imports `configuration` by its plain name

import generation_functions  # noqa: E402
from modeling import Fast_dLLM_QwenForCausalLM  # noqa: E402

spec = json.load(open(job))
model = Fast_dLLM_QwenForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
model.batch_sample = types.MethodType(generation_functions.Fast_dLLM_QwenForCausalLM.batch_sample, model)
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        out = model.batch_sample(
            torch.tensor([prompt]),
            types.SimpleNamespace(pad_token_id=spec["pad"]),
            block_size=spec["block_length"],
            max_new_tokens=c["gen_length"],
            small_block_size=c["sub_block_length"],
            min_len=len(prompt),
            seq_len=torch.tensor([len(prompt)]),
            mask_id=spec["mask_id"],
            threshold=c["threshold"],
            stop_token=spec["stop"],
            top_p=0.95,
            temperature=0.0,
        )
        runs.append({"tokens": out[0][len(prompt) :].tolist()})
print(json.dumps({"runs": runs}))
