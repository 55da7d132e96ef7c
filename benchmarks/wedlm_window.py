"""WeDLM's sliding window against one token per forward on the same model, and against its own
decoder.

    python benchmarks/wedlm_window.py [--dim 256 --layers 4] [--sharpen 30] [--prompts 8] [--gen 64]
        [--threads 2] [--reference-python PY --reference CHECKOUT] [--out FILE]

A random checkpoint in WeDLM's Qwen2.5 layout (float32), its output head multiplied by `--sharpen`
so that its entropies spread over the thresholds (a random model is far less confident than a
trained one: read the forwards per token beside every speed). Greedy, on held-out arith prompts:
- `window 1`: a window of one position, which is autoregressive decoding of the same model with
  the same exact prefix cache (one token per forward);
- `wedlm`: its published settings (window 16, entropy under 0.4, 0.02 per position), with the
  prefix cache and with none (the same tokens), and with a looser threshold of 1.0;
each one prompt at a time and as one batch. With `--reference`, its engine's decoder on the same
checkpoint (`tests/reference/wedlm_decode.py`: its decoder and sampler driven on the CPU, each
step's logits from its transformers model over the whole sequence, as its CUDA runner's cache
cannot run here): the same tokens, and its time for what it is, not its engine's speed.
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
from fastdllm.evaluation.tasks import get_task
from fastdllm.models.loading import save_pretrained

RUNNER = Path(__file__).resolve().parent.parent / "tests" / "reference" / "wedlm_decode.py"


def run(model, prompts, config: GenerationConfig, batch: bool) -> dict:
    started = time.perf_counter()
    outs = (
        [fastdllm.generate(model, prompts, config=config)]
        if batch
        else [fastdllm.generate(model, [p], config=config) for p in prompts]
    )
    seconds = time.perf_counter() - started
    tokens = [row for o in outs for row in o.sequences.tolist()]
    answered = sum(n for o in outs for n in o.num_tokens)
    forwards = sum(sum(o.nfe_per_row) for o in outs)
    positions = sum(sum(o.forward_positions) for o in outs)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(answered / seconds, 1),
        "forwards_per_token": round(forwards / max(1, answered), 3),
        "positions_per_token": round(positions / max(1, answered), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sharpen", type=float, default=30.0)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reference-python", default=None)
    p.add_argument("--reference", default=None, help="a Tencent/WeDLM checkout")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = build_tokenizer()
    model = new_model(
        "wedlm",
        "micro",
        tok,
        seed=0,
        dim=a.dim,
        n_layers=a.layers,
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=4 * a.dim,
        qkv_bias=True,
    )
    with torch.no_grad():
        model.output.weight.mul_(a.sharpen)
    model.eval().requires_grad_(False)
    task = get_task("arith")
    prompts = [task.encode(tok, doc, []) for doc in task.load(limit=a.prompts)]
    published = GenerationConfig.wedlm(gen_length=a.gen, stop_at_eos=False)
    settings = {
        "window 1 (autoregressive)": published.replace(window_size=1),
        "wedlm": published,
        "wedlm, no cache": published.replace(cache="none", refresh="full"),
        "wedlm, threshold 1.0": published.replace(threshold=1.0),
    }
    fastdllm.generate(model, prompts[:1], config=published)  # warm-up
    results = {}
    for name, config in settings.items():
        for batch in (False, True):
            key = f"{name}, {'batch of ' + str(len(prompts)) if batch else 'one at a time'}"
            results[key] = run(model, prompts, config, batch)
            r = results[key]
            print(
                f"{key:48s} {r['tokens_per_s']:8.1f} tok/s  {r['forwards_per_token']:.3f} forwards/token  "
                f"{r['positions_per_token']:7.2f} positions/token",
                file=sys.stderr,
            )
    base = results["wedlm, one at a time"]["tokens"]
    same_cache = results["wedlm, no cache, one at a time"]["tokens"] == base
    same_batch = results[f"wedlm, batch of {len(prompts)}"]["tokens"] == base
    summary = {
        "model": {"dim": a.dim, "layers": a.layers, "sharpen": a.sharpen, "vocab": model.args.vocab_size},
        "prompts": len(prompts),
        "gen_length": a.gen,
        "threads": a.threads,
        "prefix_cache_same_tokens_as_none": same_cache,
        "batch_same_tokens_as_alone": same_batch,
        "speedup_over_window_1_one_at_a_time": round(
            results["wedlm, one at a time"]["tokens_per_s"]
            / results["window 1 (autoregressive), one at a time"]["tokens_per_s"],
            2,
        ),
    }
    if a.reference and a.reference_python:
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_pretrained(model, Path(tmp) / "wedlm", tok, dtype=torch.float32)
            c = {k: getattr(published, k) for k in ("gen_length", "window_size", "threshold", "pos_penalty_factor")}
            c.update(temperature=0.0, seed=0, stop_at_eos=False)
            job = Path(tmp) / "job.json"
            job.write_text(json.dumps({"logits": [], "prompts": prompts, "configs": [c], "threads": a.threads}))
            out = subprocess.run(
                [a.reference_python, str(RUNNER), a.reference, str(folder), str(job)], capture_output=True, text=True
            )
            assert out.returncode == 0, out.stderr[-2000:]
            runs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
        seconds = sum(r["seconds"] for r in runs)
        summary["reference_decoder_uncached"] = {
            "same_tokens": [r["tokens"] for r in runs] == base,
            "tokens_per_s": round(sum(len(r["tokens"]) for r in runs) / seconds, 1),
            "forwards_per_token": round(sum(r["nfe"] for r in runs) / sum(len(r["tokens"]) for r in runs), 3),
        }
    for r in results.values():
        del r["tokens"]
    summary["runs"] = results
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
