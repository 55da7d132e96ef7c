"""Run RND1's published decoding (`RND1LM.generate`, which calls `rnd/sampling.py`'s
`diffusion_sample`) with its own modeling file, in an interpreter with the transformers it was
written for (4.57) and torch. argv: the checkout (vz415/RND1 at 520473c, upstream's last merge), a
checkpoint folder, a JSON file of {"logits": [ids...], "prompts", "configs"}; prints {"logits":
[[...]], "runs": [{"tokens", "nfe", "seconds"}, ...]} (configs outer, prompts inner; also the
runner of benchmarks/rnd1_reference.py, which may set "threads").

RND1's config class overwrites every size with Qwen3-30B-A3B's when it is built
(`set_config_defaults`), so a tiny checkpoint cannot go through `from_pretrained`: its config.json's
values are set on the config after construction, the model built from it by RND1's own class, and
the checkpoint's tensors loaded with `strict=True` (every name must be RND1's). A config gives the
answer's length `gen_length`; the reference reserves one more position for its pad, so it is asked
for `gen_length + 1` new tokens (or an infill of that length around a suffix). Each run is seeded
with torch.manual_seed(seed) before `generate`."""

import json
import sys
import time

checkout, folder, job = sys.argv[1:4]
sys.path.insert(0, checkout)

import torch  # noqa: E402
from rnd import RND1LM, RND1Config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

spec = json.load(open(job))
torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
saved = json.load(open(f"{folder}/config.json"))
config = RND1Config()
for key, value in saved.items():
    if key not in ("auto_map", "architectures", "model_type"):
        setattr(config, key, value)
config._attn_implementation = "sdpa"
model = RND1LM(config).to(torch.float32).eval()
model.load_state_dict(load_file(f"{folder}/model.safetensors"), strict=True)

forwards = [0]
forward = model.forward


def counted(*args, **kwargs):
    forwards[0] += 1
    return forward(*args, **kwargs)


model.forward = counted
with torch.no_grad():
    logits = [forward(input_ids=torch.tensor([ids])).logits[0].tolist() for ids in spec["logits"]]
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        ids = torch.tensor([prompt])
        asked = {"max_new_tokens": c["gen_length"] + 1}
        if c.get("suffix"):
            asked = {"suffix_ids": torch.tensor([c["suffix"]]), "infill_length": c["gen_length"] + 1}
        forwards[0] = 0
        torch.manual_seed(c["seed"])
        started = time.perf_counter()
        out = model.generate(
            inputs=ids,
            num_diffusion_steps=c["steps"],
            temperature=c["temperature"],
            greedy=c["temperature"] == 0,
            top_k=c.get("top_k"),
            top_p=c.get("top_p"),
            # its generation config's mask id (151669) wins over the model's: the checkpoint's is passed
            mask_token_id=saved["mask_token_id"],
            **asked,
        )
        seconds = time.perf_counter() - started
        tokens = out[0, len(prompt) : len(prompt) + c["gen_length"]].tolist()
        runs.append({"tokens": tokens, "nfe": forwards[0], "seconds": seconds})
print(json.dumps({"logits": logits, "runs": runs}))
