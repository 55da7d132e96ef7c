"""Run LLaDA2's published modeling file and its `generate` (the file the LLaDA2.0 checkpoints
ship, `modeling_llada2_moe.py`, with `configuration_llada2_moe.py`, copied into the checkpoint
folder) in an interpreter with a transformers that file imports (4.57). argv: the checkpoint
folder, a JSON file of {"mask_id", "eos_id", "logits": [ids...], "prompts", "configs"} (a config may name
eos_early_stop, and for LLaDA2.1's file editing_threshold and max_post_steps); prints
{"logits": [[...]], "runs": [{"tokens", "seconds", "forwards"}]} (also the benchmarks' runner:
benchmarks/moe_llada2.py).

Logits: one forward of each sequence under the block-causal mask `generate` builds. Runs: the
published `generate` loop with its sampler replaced by the greedy one (the argmax and its softmax
probability): its own sampler draws with `multinomial` even at temperature 0, which no other
sampler can reproduce token for token. The model runs in float32, so generate's bfloat16 mask
(0 / -inf, exact in either dtype) is handed to it as float32."""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

folder, job = sys.argv[1:3]
spec = json.load(open(job))
torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
block = spec["block_length"]
# arguments of the later generates (2.0's eos_early_stop; 2.1's token editing), passed when a config names them
LATER_ARGUMENTS = ("eos_early_stop", "editing_threshold", "max_post_steps")


def greedy(self, logits, temperature=1.0, top_k=0, top_p=1.0):
    probs = logits.float().softmax(-1)
    token = probs.argmax(-1)
    return token, probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)


type(model)._sample_with_temperature_topk_topp = greedy
forward = model.forward


forwards = [0]


def float32_mask_forward(*args, attention_mask=None, **kwargs):
    # generate builds its 0/-inf mask in bfloat16 (the released dtype); these runs are float32
    if attention_mask is not None:
        attention_mask = attention_mask.float()
    forwards[0] += 1
    return forward(*args, attention_mask=attention_mask, **kwargs)


model.forward = float32_mask_forward
out = {"logits": [], "runs": []}
with torch.no_grad():
    for ids in spec["logits"]:
        n = len(ids)
        blocks = (n + block - 1) // block
        mask = torch.tril(torch.ones(blocks, blocks)).repeat_interleave(block, 0).repeat_interleave(block, 1)
        mask = mask[:n, :n].log()[None, None]
        logits = model(torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(n)[None]).logits
        out["logits"].append(logits[0].tolist())
    for c in spec["configs"]:
        for prompt in spec["prompts"]:
            forwards[0], t0 = 0, time.perf_counter()
            x = model.generate(
                inputs=torch.tensor([prompt]),
                temperature=0.0,
                block_length=block,
                steps=c["steps"],
                gen_length=c["gen_length"],
                threshold=c["threshold"],
                eos_id=spec["eos_id"],
                mask_id=spec["mask_id"],
                **{k: c[k] for k in LATER_ARGUMENTS if k in c},
            )
            out["runs"].append({"tokens": x[0].tolist(), "seconds": time.perf_counter() - t0, "forwards": forwards[0]})
print(json.dumps(out))
