"""Run the `generate` of the modeling file Fast-dLLM v2's checkpoints ship (`modeling.py`,
`configuration.py`) with `use_block_cache=True`, in an interpreter with what it pins (transformers
4.53.1, einops). argv: the folder holding those two files, the checkpoint folder, a JSON file of
{"mask_id", "stop", "block_length", "prompts", "configs": [{"blocks", "threshold",
"sub_block_length", "fresh_block_cache"}]}; prints {"runs": [{"tokens"}]} (configs outer, prompts
inner): the answer tokens, greedy (temperature 0).

`fresh_block_cache`: the loop with one line added, which empties its block cache when a block
starts. As published the block cache outlives its block, so the first sub-block of every later
block attends to the previous block's K/V in place of its own (see fastdllm's SubBlockCache); with
one block ("blocks": 1) the published loop runs unchanged."""

import inspect
import json
import shutil
import sys
import textwrap

import torch

reference, folder, job = sys.argv[1:4]
for name in ("configuration.py", "modeling.py"):
    shutil.copy(f"{reference}/{name}", f"{folder}/{name}")

from transformers import AutoModelForCausalLM  # noqa: E402

spec = json.load(open(job))
# through config.json's auto_map, as a user loads the checkpoint (modeling.py imports .configuration)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
modeling = sys.modules[type(model).__module__]
published = type(model).generate
source = textwrap.dedent(inspect.getsource(published))
opening = "x_t = x_init.clone()"
assert source.count(opening) == 1
namespace = dict(vars(modeling))
exec(source.replace(opening, opening + "; block_past_key_values = None"), namespace)
fresh = namespace["generate"]
runs = []
for c in spec["configs"]:
    loop = fresh if c["fresh_block_cache"] else published
    for prompt in spec["prompts"]:
        out = loop(
            model,
            torch.tensor([prompt]),
            max_new_tokens=c["blocks"] * spec["block_length"],
            mask_id=spec["mask_id"],
            threshold=c["threshold"],
            small_block_size=c["sub_block_length"],
            block_size=spec["block_length"],
            stop_token=spec["stop"],
            temperature=0,
            use_block_cache=True,
        )
        runs.append({"tokens": out[0][0, len(prompt) :].tolist()})
print(json.dumps({"runs": runs}))
