"""Run SDAR's own evaluation routine (`block_diffusion_generate` of its opencompass model,
huggingface_bd3.py, read from the checkout) with SDAR's modeling file, in an interpreter that has
what SDAR pins (transformers 4.52, einops) and `cpu_shims` on its path (flash_attn's two
functions in plain torch). argv: the SDAR checkout, the checkpoint folder (holding SDAR's modeling
files), a JSON file of {"mask_id", "stop", "prompts", "configs"}; prints {"runs": [{"tokens"}]}.
Greedy as SDAR's code allows it: temperature 1 with top_k 1 samples the argmax, and the confidence
is read from the unfiltered probabilities."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

checkout, folder, job = sys.argv[1:4]
source = Path(checkout, "evaluation/opencompass/opencompass/models/huggingface_bd3.py").read_text()
source = source[source.index("## bd3 generation") : source.index("def forward_add_noise")]  # no opencompass imports
namespace: dict = {}
exec(compile(source, "huggingface_bd3.py", "exec"), namespace)
spec = json.load(open(job))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        ids = torch.tensor([prompt])
        x = namespace["block_diffusion_generate"](
            model,
            None,
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            spec["mask_id"],
            gen_length=c["gen_length"],
            block_length=c["block_length"],
            denoising_steps=c["steps_per_block"],
            temperature=1.0,
            top_k=1,
            top_p=1.0,
            remasking="low_confidence",
            threshold=1.0 if c["threshold"] is None else c["threshold"],
            stopping_criteria_idx=spec["stop"],
        )
        runs.append({"tokens": x[0, len(prompt) :].tolist()})
print(json.dumps({"runs": runs}))
