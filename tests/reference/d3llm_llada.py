"""Run d3LLM's own `generate_multi_block` (hao-ai-lab/d3LLM: `d3llm/d3llm_LLaDA/
d3llm_llada_generate_util.py`, no cache) with its own `modeling_llada.py` on a checkpoint, in an
interpreter with transformers 4.49 and torch. argv: the checkout, the checkpoint folder, a JSON file
of {"mask_id", "eos_id", "prompts", "configs"}; prints {"runs": [{"tokens", "nfe"}, ...]} (configs
outer, prompts inner)."""

import json
import sys

checkout, folder, job = sys.argv[1:4]
sys.path.insert(0, checkout)
sys.path.insert(0, checkout + "/d3llm/d3llm_LLaDA")

import d3llm_llada_generate_util as reference  # noqa: E402  (the reference's module, from the checkout)
import torch  # noqa: E402
from utils.utils_LLaDA.model.modeling_llada import LLaDAModelLM  # noqa: E402

spec = json.load(open(job))
model = LLaDAModelLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        x, nfe = reference.generate_multi_block(
            model,
            torch.tensor([prompt]),
            max_new_tokens=c["gen_length"],
            block_size=c["block_length"],
            temperature=0.0,
            remasking="low_confidence",
            mask_id=spec["mask_id"],
            threshold=c["threshold"],
            block_add_threshold=c["block_add_threshold"],
            decoded_token_threshold=c["decoded_token_threshold"],
            eos_token_id=spec["eos_id"],
            early_stop=c["early_stop"],
        )
        runs.append({"tokens": x[0, len(prompt) :].tolist(), "nfe": int(nfe)})
print(json.dumps({"runs": runs}))
