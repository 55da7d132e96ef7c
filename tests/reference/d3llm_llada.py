"""Run d3LLM's own `generate_multi_block` (hao-ai-lab/d3LLM: `d3llm/d3llm_LLaDA/
d3llm_llada_generate_util.py`, no cache), or `generate_multi_block_kv_cache` where a config gives
`cache_delay_iter` (and `refresh_interval`), with its own `modeling_llada.py` on a checkpoint, in an
interpreter with transformers 4.49 and torch. argv: the checkout, the checkpoint folder, a JSON file
of {"mask_id", "eos_id", "prompts", "configs"}; prints {"runs": [{"tokens", "nfe", "idle"}, ...]}
(configs outer, prompts inner). "idle": the forwards that revealed nothing (`early_stop`), read
where it decides, at each call of its `get_transfer_index_entropy` (once per forward), from the
whole sequence."""

import json
import sys

checkout, folder, job = sys.argv[1:4]
sys.path.insert(0, checkout)
sys.path.insert(0, checkout + "/d3llm/d3llm_LLaDA")

import d3llm_llada_generate_util as reference  # noqa: E402  (the reference's module, from the checkout)
import early_stop  # noqa: E402  (beside this runner)
import torch  # noqa: E402
from utils.utils_LLaDA.model.modeling_llada import LLaDAModelLM  # noqa: E402

spec = json.load(open(job))
seen = []  # per forward: masks before the first EOS in the sequence it decodes


def open_masks(x) -> int:
    return early_stop.open_masks(x, prompt_length, spec["mask_id"], spec["eos_id"])


decide = reference.get_transfer_index_entropy


def recording(logits, temperature, remasking, mask_index, x, *rest):
    seen.append(open_masks(x))
    return decide(logits, temperature, remasking, mask_index, x, *rest)


reference.get_transfer_index_entropy = recording
model = LLaDAModelLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        prompt_length, seen = len(prompt), []
        cached = {k: c[k] for k in ("cache_delay_iter", "refresh_interval") if k in c}
        generate = reference.generate_multi_block_kv_cache if cached else reference.generate_multi_block
        x, nfe = generate(
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
            **cached,
        )
        idle = early_stop.idle_forwards(seen, open_masks(x))
        runs.append({"tokens": x[0, len(prompt) :].tolist(), "nfe": int(nfe), "idle": idle})
print(json.dumps({"runs": runs}))
