"""Run d3LLM's own Dream decoding (hao-ai-lab/d3LLM: `d3llm/d3llm_DREAM/d3llm_dream_generate_util.py`,
`generate_multi_block`: `_sample_multi_block`, or `_sample_multi_block_kv_cache` where a config's
`cache_delay_iter` is below 10000) with its own `utils/utils_Dream/model/modeling_dream.py` on a
checkpoint, in an interpreter with transformers 4.49 and torch. argv: the checkout, the checkpoint
folder, a JSON file of {"mask_id", "eos_id", "prompts", "configs"}; prints {"runs": [{"tokens",
"nfe", "idle", "twice"}, ...]} (configs outer, prompts inner). "idle": the forwards that revealed
nothing (`early_stop`). "twice": whether a cached forward found more K/V in
its cache than its committed prefix (a refresh kept them up to a later waiting block), and so
attended some columns twice."""

import json
import sys
import types

checkout, folder, job = sys.argv[1:4]
sys.path.insert(0, checkout)

import early_stop  # noqa: E402  (beside this runner)
import torch  # noqa: E402
from d3llm.d3llm_DREAM import d3llm_dream_generate_util as reference  # noqa: E402
from utils.utils_Dream.model.modeling_dream import DreamModel  # noqa: E402

spec = json.load(open(job))
model = DreamModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
for name in ("generate_multi_block", "_sample_multi_block", "_sample_multi_block_kv_cache", "_prepare_inputs"):
    setattr(model, name, types.MethodType(getattr(reference.DreamGenerationMixin, name), model))
state = {}  # the sequence being decoded (one tensor, changed in place), its forwards' open masks


def open_masks(x) -> int:
    return early_stop.open_masks(x, state["prompt"], spec["mask_id"], spec["eos_id"])


fill_after_eos = reference.handle_early_stop


def recording_early_stop(x, *args, **kwargs):
    state["x"] = x
    return fill_after_eos(x, *args, **kwargs)


reference.handle_early_stop = recording_early_stop
forward = model.forward


def recording_forward(*args, **kwargs):
    if "x" in state:
        state["seen"].append(open_masks(state["x"]))
    cache, at = kwargs.get("past_key_values"), kwargs.get("cache_position")
    if cache is not None and at is not None and cache.get_seq_length() != int(at[0]):
        state["twice"] = True
    return forward(*args, **kwargs)


model.forward = recording_forward
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        state.clear()
        state.update(prompt=len(prompt), seen=[], twice=False)
        with torch.no_grad():
            out, nfe = model.generate_multi_block(
                torch.tensor([prompt]),
                attention_mask=None,
                max_new_tokens=c["gen_length"],
                output_history=False,
                return_dict_in_generate=True,
                steps=c["gen_length"],
                temperature=0.0,
                alg="entropy_threshold",
                threshold=c["threshold"],
                block_size=c["block_length"],
                block_add_threshold=c["block_add_threshold"],
                decoded_token_threshold=c["decoded_token_threshold"],
                cache_delay_iter=c.get("cache_delay_iter", 10000),
                refresh_interval=c.get("refresh_interval", 10000),
                early_stop=c["early_stop"],
            )
        x = out.sequences
        idle = early_stop.idle_forwards(state["seen"], open_masks(x))
        runs.append({"tokens": x[0, len(prompt) :].tolist(), "nfe": int(nfe), "idle": idle, "twice": state["twice"]})
print(json.dumps({"runs": runs}))
