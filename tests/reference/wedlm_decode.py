"""Run WeDLM's published decoder (its engine's `WeDLMDecoder` and `Sampler`, `wedlm/engine/`) with
its own transformers model (`hf_compat/modeling_wedlm.py`), in an interpreter with the transformers
it was written for (4.56/4.57) and torch. argv: the checkout (Tencent/WeDLM), a checkpoint folder, a
JSON file of {"logits": [ids...], "prompts", "configs"} (with "make": {"seed", "config"}, the
checkpoint is first made in the folder by its own classes); prints {"logits": [[...]], "runs":
[{"tokens", "nfe", "seconds"}, ...]} (configs outer, prompts inner).

The engine's model runner needs CUDA (flash-attn's paged kernels, CUDA graphs, NCCL); its decoder
and sampler are plain torch but for the tensors they place on "cuda". So the decoder runs here as
the engine drives it (`initialize_states`, then per step `prepare_decode_inputs` and
`process_decode_outputs`, the scheduler's stop checks on the tokens it returns), its tensors kept
on the CPU, and each step's logits come from the transformers model over the committed tokens
followed by the decoder's reordered window at the decoder's positions (causal attention): what the
engine's paged attention computes from its prefix cache. `nfe` counts the forwards the engine
runs: one for the prompt (prefill), one per decode step. Each run is seeded with
torch.manual_seed(seed) (the sampler draws from the global stream)."""

import json
import sys
import time
import types

checkout, folder, job = sys.argv[1:4]
sys.path.insert(0, checkout)

import torch  # noqa: E402

# the engine's package imports its CUDA model runner on import: load its modules alone
package = types.ModuleType("wedlm")
package.__path__ = [f"{checkout}/wedlm"]
sys.modules["wedlm"] = package

from hf_compat.modeling_wedlm import WeDLMForCausalLM  # noqa: E402
from wedlm.engine import wedlm_decoder  # noqa: E402
from wedlm.engine.sampler import Sampler  # noqa: E402
from wedlm.engine.sequence import Sequence  # noqa: E402
from wedlm.sampling_params import SamplingParams  # noqa: E402


class OnCPU(types.ModuleType):
    """torch, with the decoder's "cuda" tensors made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def device(*args, **kwargs):
        return torch.device("cpu")

    @staticmethod
    def tensor(*args, device=None, pin_memory=False, **kwargs):
        return torch.tensor(*args, **kwargs)


wedlm_decoder.torch = OnCPU("torch")
torch.Tensor.cuda = lambda self, *args, **kwargs: self
BLOCK = 4096  # the engine's default kvcache_block_size
Sequence.block_size = BLOCK

spec = json.load(open(job))
torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
if "make" in spec:  # a checkpoint its own classes make: seeded random weights, saved by transformers
    from hf_compat.configuration_wedlm import WeDLMConfig

    torch.manual_seed(spec["make"]["seed"])
    made = WeDLMForCausalLM(WeDLMConfig(**spec["make"]["config"])).to(torch.float32)
    with torch.no_grad():
        for p in made.parameters():  # sharper than its init, norms off their ones
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.0)).mul_(1.0 if p.dim() == 1 else 8.0)
    made.save_pretrained(folder, safe_serialization=True)
model, info = WeDLMForCausalLM.from_pretrained(
    folder, torch_dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
)
assert not (info["missing_keys"] or info["unexpected_keys"]), info
model.eval()
config = json.load(open(f"{folder}/config.json"))
mask_id, eos = config["mask_token_id"], config["eos_token_id"]


def logits_of(ids, positions):
    # an attention mask of ones, as its `_generate_one_block` passes: without one, transformers reads
    # position ids that go down (a reordered window) as the start of another packed sequence
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
            use_cache=False,
        )
    return out.logits[0]


def decode(prompt, c):
    decoder = wedlm_decoder.WeDLMDecoder(mask_id, BLOCK, c["window_size"], Sampler())
    params = SamplingParams(
        temperature=c["temperature"],
        top_p=c.get("top_p") or 1.0,
        top_k=c.get("top_k") or 0,
        max_tokens=c["gen_length"],
        stop_token_ids=[eos] if c["stop_at_eos"] else [],
        wedlm_entropy_threshold=c["threshold"],
        wedlm_pos_penalty_factor=c["pos_penalty_factor"],
    )
    seq = Sequence(prompt, params)
    seq.block_table = [0]  # one block of the cache: the slots it maps are not read here
    seq.kv_budget = BLOCK - len(seq)  # what the block manager leaves a sequence in that block
    forwards = 1  # the prefill
    decoder.initialize_states([seq])
    while True:
        prepared = decoder.prepare_decode_inputs([seq])
        if prepared is None:
            break
        committed = seq.token_ids[: seq.wedlm_state.current_seq_len]
        ids = committed + prepared.input_ids.tolist()
        positions = list(range(len(committed))) + prepared.positions.tolist()
        logits = logits_of(ids, positions)[len(committed) :]
        forwards += 1
        (tokens,) = decoder.process_decode_outputs([seq], prepared, logits)
        finished = False
        for t in tokens or []:  # the scheduler's postprocess
            seq.append_token(t)
            if t in seq.stop_token_ids or seq.num_completion_tokens >= seq.max_tokens:
                finished = True
                break
        if finished or seq.wedlm_state.is_finished:
            break
    return seq.completion_token_ids, forwards


logits = [logits_of(ids, list(range(len(ids)))).tolist() for ids in spec["logits"]]
runs = []
for c in spec["configs"]:
    for prompt in spec["prompts"]:
        torch.manual_seed(c["seed"])
        started = time.perf_counter()
        tokens, nfe = decode(prompt, c)
        runs.append({"tokens": tokens, "nfe": nfe, "seconds": time.perf_counter() - started})
print(json.dumps({"logits": logits, "runs": runs}))
