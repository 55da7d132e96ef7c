"""Run under torchrun (2 ranks, gloo): every family's tiny random model, whole and split by
`fastdllm.models.tp`, on every rank, and its int8 / int4 checkpoints read whole and split; rank 0
writes {family: {"max_logit_diff", "same_tokens", "rows", "quantized", ...}} as JSON to argv[1].
argv[2:]: the families (the conftest fixtures' names). TP_WORKER_HEADS: every model with that many
attention heads (for more ranks than the fixtures have heads); TP_WORKER_BITS: the quantized
checkpoints tried (default "8,4"; int4's groups of 32 columns do not split 4 ways at these widths);
TP_WORKER_DISPATCHES: the expert-parallel dispatches tried (default both)."""

import copy
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fastdllm  # noqa: E402
from fastdllm.models import tp  # noqa: E402
from fastdllm.models.loading import load_model, quantize_checkpoint, save_pretrained  # noqa: E402
from tests import conftest  # noqa: E402

FIXTURES = {
    "tiny_llada": ("llada", dict(seed=1)),
    "tiny_dream": ("dream", dict(seed=2, n_heads=4, n_kv_heads=2)),
    "tiny_sdar": ("sdar", dict(seed=3, n_heads=4, n_kv_heads=2, head_size=16, block_size=4)),
    "tiny_v2": ("fast_dllm_qwen", dict(seed=4, n_heads=4, n_kv_heads=2, block_size=8)),
    "tiny_llada2": ("llada2_moe", dict(seed=5, n_heads=2, n_kv_heads=1, block_size=8)),
    "tiny_llada_moe": ("lladamoe", dict(seed=6, router_bias=True)),
    "tiny_rnd1": ("rnd1", dict(seed=7, n_kv_heads=1)),
    "tiny_wedlm": ("wedlm", dict(seed=8, n_heads=4, n_kv_heads=2, qkv_bias=True)),
    "tiny_nemotron": ("nemotron_labs_diffusion", dict(seed=10, n_heads=4, n_kv_heads=2, head_size=16)),
    # made by transformers' own class (layers of its own: sliding and full, K = V, experts beside
    # a dense MLP); decoded with its published renoising
    "tiny_diffusion_gemma": ("diffusion_gemma", dict(seed=9)),
}


def whole_model(name: str, arch: str, tok, seed: int, folder: Path, rank: int, **kw):
    if arch != "diffusion_gemma":
        return conftest.random_model(arch, tok, seed=seed, **kw)
    from tests.test_diffusion_gemma import make_reference

    made = folder.parent / f"{name}-made"
    if rank == 0:
        make_reference(tok, made, seed=seed)
    dist.barrier()
    return load_model(made, dtype=torch.float32)


def generation_config(model):
    if model.family.rules.noise_canvas:  # its canvas of 8, a few denoising steps
        return fastdllm.GenerationConfig.for_model(model, gen_length=16, max_denoising_steps=6, seed=3)
    return fastdllm.GenerationConfig.for_model(
        model, fastdllm.GenerationConfig(gen_length=16, block_length=8, threshold=0.2, stop_at_eos=False)
    )


REDUCE = dist.all_reduce


def _counted(calls, reduce, *args, **kwargs):
    calls[0] += 1
    return reduce(*args, **kwargs)


def main():
    out_path, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    rank, world = tp.init(int(os.environ["WORLD_SIZE"]))
    tok = conftest.build_tokenizer()
    results = {}
    for name in names:
        arch, kw = FIXTURES[name]
        seed = kw.pop("seed")
        if "TP_WORKER_HEADS" in os.environ:  # more ranks than the fixtures' heads: more heads
            kw["n_heads"] = int(os.environ["TP_WORKER_HEADS"])
        folder = Path(out_path).parent / name
        whole = whole_model(name, arch, tok, seed, folder, rank, **kw)
        split = tp.apply(copy.deepcopy(whole), rank, world)
        if rank == 0:
            save_pretrained(whole, folder, tok, dtype=torch.float32)
        dist.barrier()
        read = load_model(folder, dtype=torch.float32, tp=(rank, world))  # the rank's parts alone
        read_equal = all(torch.equal(a, b) for a, b in zip(read.state_dict().values(), split.state_dict().values()))
        ids = torch.tensor([tok.encode("Question: Tom has 5 apples and buys 3 more. How many?")])
        calls = [0]
        dist.all_reduce = functools.partial(_counted, calls, REDUCE)
        with torch.no_grad():
            diff = (whole(ids) - split(ids)).abs().max().item()
        dist.all_reduce = REDUCE
        config = generation_config(whole)
        prompts = [tok.encode("Question: 1 + 1"), tok.encode("Question: Tom has 5 apples and buys 3 more.")]
        alone = fastdllm.generate(whole, prompts, config=config).sequences
        shared = fastdllm.generate(split, prompts, config=config).sequences
        quantized = {}
        bits_tried = [int(b) for b in os.environ.get("TP_WORKER_BITS", "8,4").split(",")]
        for bits in bits_tried:  # a quantized checkpoint: each rank reads its part of every layer
            qfolder = Path(out_path).parent / f"{name}-int{bits}"
            if rank == 0:
                quantize_checkpoint(folder, qfolder, bits, group_size=None if bits == 8 else 32)
            dist.barrier()
            q_whole = load_model(qfolder, dtype=torch.float32)
            q_split = load_model(qfolder, dtype=torch.float32, tp=(rank, world))
            with torch.no_grad():
                q_logits = q_whole(ids)
                q_diff = (q_logits - q_split(ids)).abs().max().item()
            same = torch.equal(
                fastdllm.generate(q_whole, prompts, config=config).sequences,
                fastdllm.generate(q_split, prompts, config=config).sequences,
            )
            quantized[f"int{bits}"] = {
                "max_logit_diff": q_diff,
                "max_logit": q_logits.abs().max().item(),
                "same_tokens": bool(same),
            }
        experts = {}
        dispatches = os.environ.get("TP_WORKER_DISPATCHES", "all-reduce,all-to-all").split(",")
        # expert parallelism where the family takes it (DiffusionGemma refuses it by name)
        for dispatch in dispatches if whole.args.n_experts and not hasattr(whole, "tp_cuts") else ():
            # expert parallelism: whole routed experts per rank, split in memory and read alone
            ep_split = tp.apply(copy.deepcopy(whole), rank, world, ep=world, dispatch=dispatch)
            ep_read = load_model(folder, dtype=torch.float32, tp=(rank, world), ep=world, ep_dispatch=dispatch)
            counts = {"all_reduce": [0], "all_to_all_single": [0]}
            real = {op: getattr(dist, op) for op in counts}
            for op in counts:
                setattr(dist, op, functools.partial(_counted, counts[op], real[op]))
            with torch.no_grad():
                ep_diff = (whole(ids) - ep_read(ids)).abs().max().item()
            for op in counts:
                setattr(dist, op, real[op])
            experts[dispatch] = {
                "max_logit_diff": ep_diff,
                "same_tokens": bool(torch.equal(alone, fastdllm.generate(ep_read, prompts, config=config).sequences)),
                "read_parts_equal": all(
                    torch.equal(a, b) for a, b in zip(ep_read.state_dict().values(), ep_split.state_dict().values())
                ),
                "experts_per_rank": ep_read.layers[-1].feed_forward.w1.shape[0],
                "collectives_per_layer": {op: c[0] / whole.args.n_layers for op, c in counts.items()},
                "moe_layer_share": sum(map(whole.args.is_moe_layer, range(whole.args.n_layers))) / whole.args.n_layers,
            }
        results[name] = {
            "experts": experts,
            "quantized": quantized,
            "max_logit_diff": diff,
            "same_tokens": bool(torch.equal(alone, shared)),
            "rows": len(prompts),
            "heads_per_rank": split.args.n_heads,
            "kv_heads_per_rank": split.args.n_kv_heads,
            "all_reduces_per_layer": calls[0] / whole.args.n_layers,
            "read_parts_equal": read_equal and set(read.state_dict()) == set(split.state_dict()),
            "weight_bytes": sum(t.numel() * t.element_size() for t in whole.parameters()),
            "weight_bytes_per_rank": sum(t.numel() * t.element_size() for t in split.parameters()),
        }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        # every rank decoded the same tokens as rank 0
        results["ranks_agree"] = all(g == gathered[0] for g in gathered)
        Path(out_path).write_text(json.dumps(results))
    # Leave together: a rank whose peer tore its process group down while it was still writing can
    # abort at exit on a loaded machine.
    dist.barrier()


if __name__ == "__main__":
    main()
