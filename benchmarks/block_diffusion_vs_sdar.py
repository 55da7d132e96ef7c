"""Our block-diffusion decoding against SDAR's own routine, side by side in one process.

    PYTHONPATH=tests/reference/cpu_shims python benchmarks/block_diffusion_vs_sdar.py \\
        --sdar PATH/TO/SDAR [--model sdar-arith] [--limit 32] [--gen-length 256] [--threshold 0.9] [--batch 8]

Needs an interpreter with what SDAR pins (transformers 4.52, einops) and fastdllm; `cpu_shims` holds
flash_attn's two functions in plain torch. The checkpoint is saved in SDAR's layout with SDAR's
modeling files and loaded by transformers (trust_remote_code); both decode the same held-out arith
prompts one at a time (SDAR's routine takes one), greedy, float32, with the quota rule (dynamic
with --threshold, static with --threshold 1). Printed: agreement up to the first stop token,
tokens/s of each (generated tokens up to and including it over wall time), their ratio, forwards
per sample of each and our positions per generated token (commit passes included). With --batch,
also our throughput on the same prompts in batches, against SDAR's one at a time (its routine
takes a single prompt). Each routine runs once untimed first.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.evaluation.tasks import get_task
from fastdllm.models.loading import save_pretrained


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sdar", required=True, help="a JetAstra/SDAR checkout")
    p.add_argument("--model", default="sdar-arith")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="also time ours on the prompts in batches of this size (SDAR's routine takes one)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    source = Path(args.sdar, "evaluation/opencompass/opencompass/models/huggingface_bd3.py").read_text()
    source = source[source.index("## bd3 generation") : source.index("def forward_add_noise")]
    ns: dict = {}
    exec(compile(source, "huggingface_bd3.py", "exec"), ns)
    reference_generate = ns["block_diffusion_generate"]

    model, tok = fastdllm.load(args.model, dtype=torch.float32)
    blk = model.args.block_size
    folder = Path(tempfile.mkdtemp(prefix="sdar-ref-"))
    save_pretrained(model, folder, tok, dtype=torch.float32)
    files = Path(args.sdar, "training", "model", "SDAR-4B-Chat")
    for f in ("configuration_sdar.py", "modeling_sdar.py"):
        (folder / f).write_text((files / f).read_text())
    (folder / "fused_linear_diffusion_cross_entropy.py").write_text(
        "class FusedLinearDiffusionCrossEntropyLoss:\n    pass\n"
    )
    ref = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
    calls = {"n": 0}
    forward = ref.forward

    def counted(*a, **k):
        calls["n"] += 1
        return forward(*a, **k)

    ref.forward = counted
    stop = sorted(model.stop_token_ids)
    threshold = None if args.threshold >= 1 else args.threshold
    config = GenerationConfig.for_model(
        model, GenerationConfig(gen_length=args.gen_length, threshold=threshold), temperature=0.0
    )
    task = get_task("arith")
    docs = task.load(limit=args.limit)

    def upto_stop(tokens):
        for k, t in enumerate(tokens):
            if t in stop:
                return tokens[: k + 1]
        return tokens

    def theirs_generate(prompt):
        ids = torch.tensor([prompt])
        return reference_generate(
            ref,
            None,
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            model.mask_token_id,
            gen_length=args.gen_length,
            block_length=blk,
            denoising_steps=blk,
            temperature=1.0,
            top_k=1,
            top_p=1.0,
            remasking="low_confidence",
            threshold=args.threshold,
            stopping_criteria_idx=stop,
        )

    # one untimed run of each first: lazy set-up (kernels, allocator, tables) is not decoding
    warm = task.encode(tok, docs[0], [])
    fastdllm.generate(model, [warm], config=config)
    theirs_generate(warm)
    calls["n"] = 0
    ours_t = theirs_t = 0.0
    ours_tokens = theirs_tokens = agree = ours_nfe = correct = 0
    positions = 0
    singles = []
    for doc in docs:
        prompt = task.encode(tok, doc, [])
        t0 = time.perf_counter()
        out = fastdllm.generate(model, [prompt], config=config)
        ours_t += time.perf_counter() - t0
        mine = upto_stop(out.sequences[0].tolist())
        singles.append(mine)
        ours_tokens, ours_nfe = ours_tokens + len(mine), ours_nfe + out.nfe
        positions += out.forward_positions[0]
        correct += task.score_one(doc, tok.decode(mine, skip_special_tokens=True)).correct
        before = calls["n"]
        t0 = time.perf_counter()
        x = theirs_generate(prompt)
        theirs_t += time.perf_counter() - t0
        calls["theirs"] = calls.get("theirs", 0) + calls["n"] - before
        theirs = upto_stop(x[0, len(prompt) : len(prompt) + args.gen_length].tolist())
        theirs_tokens += len(theirs)
        agree += mine == theirs
    n = len(docs)
    result = {
        "model": args.model,
        "samples": n,
        "gen_length": args.gen_length,
        "threshold": args.threshold,
        "threads": args.threads,
        "agree": agree,
        "accuracy": correct / n,
        "ours_tokens_per_s": ours_tokens / ours_t,
        "sdar_tokens_per_s": theirs_tokens / theirs_t,
        "ratio": (ours_tokens / ours_t) / (theirs_tokens / theirs_t),
        "ours_forwards_per_sample": ours_nfe / n,
        "sdar_forwards_per_sample": calls["theirs"] / n,
        "ours_positions_per_token": positions / ours_tokens,
    }
    if args.batch > 1:  # throughput: the same prompts in batches (left-padded), against SDAR one at a time
        prompts = [task.encode(tok, doc, []) for doc in docs]
        batched_t, batched_tokens, same = 0.0, 0, 0
        for i in range(0, n, args.batch):
            t0 = time.perf_counter()
            out = fastdllm.generate(model, prompts[i : i + args.batch], config=config)
            batched_t += time.perf_counter() - t0
            for j, row in enumerate(out.sequences.tolist()):
                mine = upto_stop(row)
                batched_tokens += len(mine)
                same += mine == singles[i + j]
        result.update(
            {
                "batch": args.batch,
                "batched_same_as_single": same,
                "ours_batched_tokens_per_s": batched_tokens / batched_t,
                "batched_ratio": (batched_tokens / batched_t) / (theirs_tokens / theirs_t),
            }
        )
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
