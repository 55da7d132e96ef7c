"""LLaDA2 (mixture of experts): where a forward's time goes, how fast many experts load, and our
loop against the published generate on the same checkpoint.

    python benchmarks/moe_llada2.py [--threads 2] [--out FILE]
        [--reference-python PY --reference-files DIR]   # the published generate (transformers 4.57)
        [--batch N] [--twin llada2-arith]

1. Routing and dispatch share of a forward at batch 1 (one block of 32 tokens against a cached
   prefix of 256, bfloat16): on a model of LLaDA2.0-mini's width (dim 2048, 256 experts of 512,
   top-8 in 4 of 8 groups, one shared expert, 16 heads of 128 with 4 KV heads), one MoE layer,
   random weights; and on the small benchmark checkpoint below (with --twin, on it too: its block
   of 4 against a prefix of 72, a 0-shot prompt's length). Router = `moe.route`; dispatch =
   sorting the (token, expert) pairs, gathering, offsets, scattering back and the weighted sum;
   experts = the grouped matmuls and the shared experts' MLP; the rest of the forward is
   attention, norms and the head.
2. Loading a checkpoint with 64 experts per layer (sharded safetensors, one tensor per expert).
3. Our loop (exact block cache) against the published `generate` (the whole window at every step)
   on random checkpoints in the real layout (small: dim 256, 4 layers; wide: dim 1024, 2 layers),
   float32, batch 1, gen length 256, block 32,
   32 steps per block, threshold 0.95, greedy: tokens/s, forwards, tokens per forward. Needs the
   published modeling files and an interpreter with the transformers they import. With --batch N,
   N prompts: the published generate takes one at a time; ours one at a time and in one batch.
   With --twin, on that trained checkpoint instead (llada2-arith: the first N held-out arith
   questions as the user message, its own block of 4, 4 steps per block, threshold 0.95).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import fastdllm
import fastdllm.models.moe as moe
from fastdllm import GenerationConfig
from fastdllm.embedded.recipe import build_tokenizer
from fastdllm.engine.kv.pages import PagedKVCache
from fastdllm.evaluation.tasks import arith
from fastdllm.models import Transformer
from fastdllm.models.llada2 import FAMILY
from fastdllm.models.loading import resolve_model_path, save_pretrained
from fastdllm.models.transformer import ModelArgs

MINI = dict(
    dim=2048,
    n_heads=16,
    n_kv_heads=4,
    head_size=128,
    rope_dim=64,
    hidden_dim=5120,
    n_experts=256,
    n_active_experts=8,
    moe_hidden_dim=512,
    shared_expert_hidden_dim=512,
    n_expert_groups=8,
    active_expert_groups=4,
    routed_scaling=2.5,
)
# wider: each forward is compute, not per-op overhead (the published loop's whole windows cost more)
WIDE = dict(
    dim=1024,
    n_heads=8,
    n_kv_heads=2,
    head_size=128,
    rope_dim=64,
    hidden_dim=2048,
    n_experts=16,
    n_active_experts=4,
    moe_hidden_dim=512,
    shared_expert_hidden_dim=512,
    n_expert_groups=4,
    active_expert_groups=2,
    routed_scaling=2.5,
)
SMALL = dict(
    dim=256,
    n_heads=4,
    n_kv_heads=2,
    head_size=64,
    rope_dim=32,
    hidden_dim=512,
    n_experts=16,
    n_active_experts=4,
    moe_hidden_dim=128,
    shared_expert_hidden_dim=128,
    n_expert_groups=4,
    active_expert_groups=2,
    routed_scaling=2.5,
)


def model_of(
    sizes: dict,
    layers: int,
    first_dense: int,
    vocab: int,
    dtype,
    seed: int = 0,
    mask_token_id: int = 0,
    eos_token_id: int = 1,
) -> Transformer:
    args = ModelArgs(
        **sizes,
        n_layers=layers,
        first_dense_layers=first_dense,
        vocab_size=vocab,
        max_seq_len=4096,
        block_size=32,
        mask_token_id=mask_token_id,
        eos_token_id=eos_token_id,
        **FAMILY.fixed,
        qk_norm=True,
    )
    torch.manual_seed(seed)
    model = Transformer(args, family=FAMILY)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0, 0.01)
    return model.to(dtype).eval().requires_grad_(False)


def time_shares(model: Transformer, prefix: int = 256, block: int = 32, reps: int = 5) -> dict:
    """Seconds per forward of one block against a cached prefix, and the router's, dispatch's and
    experts' parts of it."""
    spent = {"router": 0.0, "experts": 0.0, "moe": 0.0}
    route, linear, forward = moe.route, moe.expert_linear, moe.MoEFeedForward.forward

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[key] += time.perf_counter() - t0
            return out

        return wrapper

    x = torch.randint(0, model.args.vocab_size - 2, (1, prefix + block))
    end = prefix + block
    cache = PagedKVCache.for_rows(model, 1, end)
    model.packed_logits(x, [(0, 0, end, end, prefix)], cache)  # fills the cache (and warms up)
    moe.route, moe.expert_linear = timed("router", route), timed("experts", linear)
    moe.MoEFeedForward.forward = timed("moe", forward)
    shared = [m.shared for m in model.modules() if isinstance(m, moe.MoEFeedForward) and m.shared is not None]
    for mlp in shared:  # the shared experts' MLP is expert compute, not dispatch
        mlp.forward = timed("experts", mlp.forward)
    try:
        for k in spent:
            spent[k] = 0.0
        t0 = time.perf_counter()
        for _ in range(reps):
            model.packed_logits(x, [(0, prefix, end, end, prefix)], cache)
        total = (time.perf_counter() - t0) / reps
    finally:
        moe.route, moe.expert_linear, moe.MoEFeedForward.forward = route, linear, forward
        for mlp in shared:
            del mlp.forward
    router, experts = spent["router"] / reps, spent["experts"] / reps
    dispatch = spent["moe"] / reps - router - experts
    return {
        "forward_s": total,
        "router_s": router,
        "dispatch_s": dispatch,
        "experts_s": experts,
        "router_and_dispatch_share": (router + dispatch) / total,
    }


def load_time(tmp: Path, tokenizer) -> dict:
    model = model_of(
        dict(SMALL, n_experts=64, n_active_experts=8, n_expert_groups=8, active_expert_groups=4),
        8,
        1,
        896,
        torch.bfloat16,
        mask_token_id=tokenizer.token_to_id("<|mdm_mask|>"),
        eos_token_id=tokenizer.eos_token_id,
    )
    folder = save_pretrained(model, tmp / "experts64", tokenizer, dtype=torch.bfloat16, max_shard_bytes=20_000_000)
    tensors = sum(1 for _ in folder.glob("*.safetensors"))
    t0 = time.perf_counter()
    fastdllm.load(folder)
    seconds = time.perf_counter() - t0
    n = sum(len(v) if isinstance(v, tuple) else 1 for v in FAMILY.weight_names(model.args).values())
    return {
        "experts_per_layer": 64,
        "layers": 8,
        "checkpoint_tensors": n,
        "shards": tensors,
        "load_s": seconds,
        "bytes": sum(p.numel() * 2 for p in model.parameters()),
    }


def random_checkpoint(tmp: Path, tokenizer, sizes: dict, layers: int) -> Path:
    model = model_of(
        sizes,
        layers,
        1,
        832,
        torch.float32,
        mask_token_id=tokenizer.token_to_id("<|mdm_mask|>"),
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_pretrained(model, tmp / "random", tokenizer, dtype=torch.float32)


QUESTIONS = [
    "Tom has 5 apples. He buys 3 more. How many apples?",
    "What is 9 times 7?",
    "A box holds 12 pencils. How many pencils are in 4 boxes?",
    "Eva earns 12 dollars an hour.",
    "Sam had 20 cards and gave away 6.",
    "How many legs do 3 cats have?",
    "Mia reads 8 pages a day for a week.",
    "What is half of 50?",
]


def against_published(
    folder: Path, python: str, files: str, batch: int = 1, questions=QUESTIONS, threshold: float = 0.95
) -> dict:
    """Ours against the published generate on `batch` prompts (chat-formatted `questions`, cycled)
    to the checkpoint in `folder`, in its own blocks (the published generate's `block_length`):
    the published one takes a prompt at a time; ours is timed one at a time and, with batch > 1,
    on all of them in one batch."""
    for name in ("configuration_llada2_moe.py", "modeling_llada2_moe.py"):
        shutil.copy(Path(files, name), folder / name)
    model, tok = fastdllm.load(folder, dtype="float32")
    block = model.args.block_size
    prompts = [tok.encode_chat([{"role": "user", "content": questions[i % len(questions)]}]) for i in range(batch)]
    script = Path(__file__).parents[1] / "tests" / "reference" / "llada2_moe.py"
    job = {
        "prompts": prompts,
        "logits": [],
        "configs": [{"gen_length": 256, "steps": block, "threshold": threshold}],
        "block_length": block,
        "eos_id": model.args.eos_token_id,
        "mask_id": model.mask_token_id,
        "threads": torch.get_num_threads(),
    }
    (folder / "job.json").write_text(json.dumps(job))
    out = subprocess.run(
        [python, str(script), str(folder), str(folder / "job.json")], capture_output=True, text=True, timeout=3600
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    theirs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
    model.stop_token_ids = [model.args.eos_token_id]  # the published loop stops at eos_id alone
    config = GenerationConfig.for_model(
        model, GenerationConfig(gen_length=256, block_length=block, steps=256, threshold=threshold)
    )
    fastdllm.generate(model, [prompts[0]], config=config)  # warm-up

    def first_difference(mine: list[int], ref: list[int]) -> int | None:
        """Where a row first differs from the published tokens (None: nowhere)."""
        mine = mine[: len(ref)]
        return next(
            (i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None if len(mine) == len(ref) else len(mine)
        )

    seconds, forwards, differences = 0.0, 0, []
    for prompt, ref in zip(prompts, theirs):
        t0 = time.perf_counter()
        ours = fastdllm.generate(model, [prompt], config=config)
        seconds += time.perf_counter() - t0
        forwards += ours.nfe
        differences.append(first_difference(ours.sequences[0].tolist(), ref["tokens"]))
    same = all(d is None for d in differences)
    published = sum(r["seconds"] for r in theirs)
    result = {
        "prompts": batch,
        "block": block,
        "published": {
            "seconds": published,
            "forwards": sum(r["forwards"] for r in theirs),
            "tokens": sum(len(r["tokens"]) for r in theirs),
        },
        "ours": {"seconds": seconds, "forwards": forwards},
        "same_tokens": same,
        "first_difference": differences,
        "speedup": published / seconds,
    }
    if batch > 1:
        t0 = time.perf_counter()
        together = fastdllm.generate(model, prompts, config=config)
        batched = time.perf_counter() - t0
        batched_differences = [
            first_difference(together.sequences[i].tolist(), r["tokens"]) for i, r in enumerate(theirs)
        ]
        result.update(
            {
                "ours_batched": {"seconds": batched, "forwards": together.nfe},
                "same_tokens_batched": all(d is None for d in batched_differences),
                "first_difference_batched": batched_differences,
                "speedup_batched": published / batched,
            }
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reference-python", default=None)
    p.add_argument("--reference-files", default=None)
    p.add_argument("--batch", type=int, default=1, help="prompts of the comparison with the published generate")
    p.add_argument(
        "--twin",
        default=None,
        help="compare on this trained checkpoint (llada2-arith: held-out arith "
        "problems, its own block) instead of the random ones",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    results = {}
    shapes = [
        (
            name,
            lambda sizes=sizes, layers=layers: model_of(
                sizes, layers, 0 if layers == 1 else 1, 4096 if layers == 1 else 832, torch.bfloat16
            ),
            {},
        )
        for name, sizes, layers in (
            ("LLaDA2.0-mini width, 1 MoE layer", MINI, 1),
            ("small (dim 256, 16 experts)", SMALL, 4),
        )
    ]
    if args.twin:  # its own block against a prompt's length of prefix
        shapes.append((args.twin, lambda: fastdllm.load(args.twin, dtype="bfloat16")[0], dict(prefix=72, block=4)))
    for name, build, where in shapes:
        model = build()
        r = time_shares(model, **where)
        results[name] = r
        print(
            f"{name:<36} forward {1000 * r['forward_s']:8.1f} ms  router {1000 * r['router_s']:6.2f} ms  "
            f"dispatch {1000 * r['dispatch_s']:6.2f} ms  experts {1000 * r['experts_s']:7.1f} ms  "
            f"router+dispatch {100 * r['router_and_dispatch_share']:4.1f}%",
            flush=True,
        )
        del model
    with tempfile.TemporaryDirectory() as tmp:
        r = results["load"] = load_time(Path(tmp), tokenizer)
        print(
            f"load: {r['checkpoint_tensors']} tensors ({r['experts_per_layer']} experts x {r['layers']} layers, "
            f"{r['bytes'] / 1e6:.0f} MB, {r['shards']} shards) in {r['load_s']:.2f} s",
            flush=True,
        )
        if args.reference_python and args.reference_files:
            runs = [
                (key, lambda d, sizes=sizes, layers=layers: random_checkpoint(d, tokenizer, sizes, layers), QUESTIONS)
                for key, sizes, layers in (("small", SMALL, 4), ("wide", WIDE, 2))
            ]
            if args.twin:
                held_out = [p.question for p in arith.test_split()[: args.batch]]
                runs = [("twin", lambda d: Path(shutil.copytree(resolve_model_path(args.twin), d / "twin")), held_out)]
            for key, checkpoint, questions in runs:
                folder = checkpoint(Path(tmp) / key)
                r = results[f"against_published_{key}"] = against_published(
                    folder, args.reference_python, args.reference_files, args.batch, questions
                )
                print(
                    f"{key}: published generate {r['published']['seconds']:.2f} s, {r['published']['forwards']} "
                    f"forwards; ours {r['ours']['seconds']:.2f} s, {r['ours']['forwards']} forwards; same tokens "
                    f"{r['same_tokens']}; x{r['speedup']:.1f}"
                    + (
                        f"; batched x{r['speedup_batched']:.1f} (same tokens {r['same_tokens_batched']})"
                        if "speedup_batched" in r
                        else ""
                    ),
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
