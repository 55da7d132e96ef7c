"""Named LoRA adapters: a batch of rows across adapters against the base, merged against unmerged.

    python benchmarks/lora_adapters.py [--model llada-arith] [--adapters 4] [--rows 16] [--rank 8]
        [--gen 64] [--threads 2] [--out FILE]

Random PEFT-format adapters (rank `--rank` on every attention and MLP projection; B small, so the
answers stay the model's) are written for the model, then on held-out arith prompts, greedy:
- `--rows` rows of the base in one batch, against the same rows spread evenly over `--adapters`
  adapters held by name (`load(lora_modules=...)`, one batch: `BlockDecoder`);
- one adapter at batch 1, merged into the weights (`load(adapters=[...])`) against held by name.
Reports tokens/s and forwards; the merged and named answers must be the same tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.evaluation.tasks import get_task

TARGETS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2")


def write_adapter(model, folder: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of `model`'s own module names (its checkpoint's), random A and small B."""
    gen = torch.Generator().manual_seed(seed)
    names = model.family.weight_names(model.args)
    tensors, modules = {}, set()
    for ours, theirs in names.items():
        module = ours.removesuffix(".weight")
        if not isinstance(theirs, str) or not module.endswith(TARGETS):
            continue
        out_f, in_f = model.state_dict()[ours].shape
        prefix = "base_model.model." + theirs.removesuffix(".weight")
        tensors[prefix + ".lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
        tensors[prefix + ".lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
        modules.add(theirs.removesuffix(".weight").rsplit(".", 1)[-1])
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(modules), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def batch(model, prompts, configs) -> tuple[float, int, list]:
    decoder = BlockDecoder(model, configs[0])
    started = time.perf_counter()
    rows = [decoder.add([p], config=c)[0] for p, c in zip(prompts, configs)]
    while decoder.active:
        decoder.step()
    seconds = time.perf_counter() - started
    tokens = sum(int((r.answer != model.args.eos_token_id).sum()) for r in rows)
    return tokens / seconds, decoder.nfe, [r.answer.tolist() for r in rows]


def one_at_a_time(model, prompts, config) -> tuple[float, list]:
    started, answers, tokens = time.perf_counter(), [], 0
    for p in prompts:
        out = fastdllm.generate(model, [p], config=config)
        answers.append(out.sequences[0].tolist())
        tokens += out.num_tokens[0]
    return tokens / (time.perf_counter() - started), answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base, tok = fastdllm.load(a.model, dtype="float32")
    task = get_task("arith")
    prompts = [task.encode(tok, d, []) for d in task.load(limit=a.rows)]
    config = GenerationConfig.for_model(base, gen_length=a.gen)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f"a{k}": write_adapter(base, Path(tmp) / f"a{k}", a.rank, k) for k in range(a.adapters)}
        named, _ = fastdllm.load(a.model, dtype="float32", lora_modules=paths)
        merged, _ = fastdllm.load(a.model, dtype="float32", adapters=[paths["a0"]])
        batch(named, prompts[:2], [config] * 2)  # warm-up
        base_tps, base_nfe, _ = batch(named, prompts, [config] * a.rows)
        spread = [config.replace(adapter=f"a{i % a.adapters}") for i in range(a.rows)]
        mixed_tps, mixed_nfe, _ = batch(named, prompts, spread)
        merged_tps, merged_answers = one_at_a_time(merged, prompts[:8], config)
        named_tps, named_answers = one_at_a_time(named, prompts[:8], config.replace(adapter="a0"))
    summary = {
        "model": a.model or "llada-arith (embedded)",
        "rank": a.rank,
        "gen_length": a.gen,
        "threads": a.threads,
        f"batch_of_{a.rows}_base": {"tokens_per_s": round(base_tps, 1), "forwards": base_nfe},
        f"batch_of_{a.rows}_across_{a.adapters}_adapters": {"tokens_per_s": round(mixed_tps, 1), "forwards": mixed_nfe},
        "batch_1_merged": {"tokens_per_s": round(merged_tps, 1)},
        "batch_1_named": {"tokens_per_s": round(named_tps, 1)},
        "merged_and_named_same_tokens": merged_answers == named_answers,
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
