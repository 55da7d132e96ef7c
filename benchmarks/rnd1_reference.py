"""RND1: our loop against its published `generate` (`diffusion_sample`) on the same checkpoint.

    python benchmarks/rnd1_reference.py --reference-python PY --reference CHECKOUT
        [--dim 256 --layers 4 --experts 16 --active 4] [--prompts 8] [--gen 64] [--steps 64]
        [--temperature 0.0] [--threads 2] [--out FILE]

A random checkpoint in RND1's layout (float32; mixture of experts in every layer), saved by us and
loaded strictly by RND1's own classes (`tests/reference/rnd1_sample.py`, an interpreter with
transformers 4.57). Both decode the same prompts with the same settings (its schedule, no cache:
every step a forward of the whole sequence, as published); the published loop takes one prompt at
a time, ours one at a time and as one batch. Reports tokens/s, forwards per answer, and whether
every answer is the same token for token. A random model is far less confident than a trained
one, but this schedule reveals a fixed count per step whatever the confidences, so the forwards
are the same as a trained model's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.embedded.recipe import build_tokenizer, new_model
from fastdllm.models.loading import save_pretrained

RUNNER = Path(__file__).resolve().parent.parent / "tests" / "reference" / "rnd1_sample.py"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference-python", required=True)
    p.add_argument("--reference", required=True, help="a vz415/RND1 checkout at 520473c")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = build_tokenizer()
    model = new_model(
        "rnd1",
        "micro",
        tok,
        seed=0,
        dim=a.dim,
        n_layers=a.layers,
        n_heads=a.dim // 32,
        n_kv_heads=max(1, a.dim // 128),
        head_size=32,
        rope_dim=32,
        hidden_dim=2 * a.dim,
        n_experts=a.experts,
        n_active_experts=a.active,
        moe_hidden_dim=a.dim // 2,
    ).eval()
    texts = [f"Question: what is {i} + {i + 3}? Answer:" for i in range(a.prompts)]
    prompts = [tok.encode(t) for t in texts]
    config = dict(gen_length=a.gen, steps=a.steps, temperature=a.temperature, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_pretrained(model, Path(tmp, "rnd1"), tok, dtype=torch.float32)
        job = Path(tmp, "job.json")
        job.write_text(json.dumps({"logits": [], "prompts": prompts, "configs": [config], "threads": a.threads}))
        out = subprocess.run(
            [a.reference_python, str(RUNNER), a.reference, str(folder), str(job)], capture_output=True, text=True
        )
        if out.returncode != 0:
            sys.exit(out.stderr[-2000:])
        theirs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
    ours_config = GenerationConfig.rnd1(stop_at_eos=False, **config)
    fastdllm.generate(model, [prompts[0]], config=ours_config)  # warm-up
    started = time.perf_counter()
    alone = [fastdllm.generate(model, [p], config=ours_config) for p in prompts]
    alone_seconds = time.perf_counter() - started
    started = time.perf_counter()
    batch = fastdllm.generate(model, prompts, config=ours_config.replace(seed=None), row_seeds=[0] * len(prompts))
    batch_seconds = time.perf_counter() - started
    tokens = a.gen * len(prompts)
    same_alone = all(o.sequences[0].tolist() == t["tokens"] for o, t in zip(alone, theirs))
    same_batch = all(batch.sequences[i].tolist() == t["tokens"] for i, t in enumerate(theirs))
    reference_seconds = sum(t["seconds"] for t in theirs)
    result = {
        "checkpoint": dict(dim=a.dim, layers=a.layers, experts=a.experts, active=a.active, vocab=model.args.vocab_size),
        "config": config,
        "prompts": len(prompts),
        "threads": a.threads,
        "reference": {"seconds": reference_seconds, "tokens_per_s": tokens / reference_seconds},
        "ours_one_at_a_time": {"seconds": alone_seconds, "tokens_per_s": tokens / alone_seconds},
        "ours_batched": {"seconds": batch_seconds, "tokens_per_s": tokens / batch_seconds},
        "nfe_per_answer": {"reference": [t["nfe"] for t in theirs], "ours": [o.nfe for o in alone]},
        "same_tokens": {"one_at_a_time": same_alone, "batched": same_batch},
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
