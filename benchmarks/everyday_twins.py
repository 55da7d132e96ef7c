"""The embedded models on everyday questions, plain prompts, the old test set and general text.

    python benchmarks/everyday_twins.py [--models llada-arith dream-arith] [--limit 200] [--baseline-limit 100]
        [--presets baseline fast-dllm default] [--threads 2] [--out FILE]

Accuracy rows (`fastdllm.evaluation.harness`, bf16, batch 16, 0-shot, gen length 256; presets baseline,
fast-dllm and default): `everyday` (500 held-out questions, test phrasings and entities) with
the chat template and as plain "Question: ...\\nAnswer:" prompts, `everyday-probe` (32
hand-written questions) both ways, and `arith` (the old test set) with the chat template. Printed
per row: accuracy, tokens/s, NFE per sample, tokens per step.

Confidence rows: at gen length 256 the default's tokens per step and NFE with and without
stop-at-EOS (on `everyday`); and on held-out general text (docstring paragraphs of modules no
training row reads: the first 30% of each paragraph as a plain prompt, 64 new tokens), threshold
0.9's tokens per step and how many of its tokens equal the baseline's (one token per step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.embedded.train_data import docstrings
from fastdllm.evaluation.harness import evaluate

ACCURACY_ROWS = [
    ("everyday", True),
    ("everyday", False),
    ("everyday-probe", True),
    ("everyday-probe", False),
    ("arith", True),
]
PRESETS = ["baseline", "fast-dllm", "default"]


def accuracy_rows(name, model, tok, args):
    rows = []
    for task, chat in ACCURACY_ROWS:
        for preset in args.presets:
            config = GenerationConfig.for_model(model, GenerationConfig.preset(preset, gen_length=args.gen_length))
            limit = args.baseline_limit if preset == "baseline" else args.limit
            m = evaluate(model, tok, task, limit=limit, config=config, batch_size=args.batch_size, chat_template=chat)
            row = {
                "model": name,
                "task": task,
                "prompt": "chat" if chat else "plain",
                "preset": preset,
                **{
                    k: m[k]
                    for k in ("accuracy", "tokens_per_second", "nfe_per_sample", "tokens_per_step", "num_samples")
                },
            }
            rows.append(row)
            print(
                f"{name:<12} {task:<15} {row['prompt']:<6} {preset:<10} acc {100 * row['accuracy']:5.1f}  "
                f"{row['tokens_per_second']:8.1f} tok/s  NFE {row['nfe_per_sample']:6.2f}  "
                f"tok/step {row['tokens_per_step']:5.2f}",
                flush=True,
            )
    return rows


def confidence_rows(name, model, tok, args):
    rows = []
    for stop in (True, False):
        config = GenerationConfig.for_model(model, GenerationConfig.preset("default", gen_length=256, stop_at_eos=stop))
        m = evaluate(model, tok, "everyday", limit=min(args.limit, 64), config=config, batch_size=args.batch_size)
        rows.append(
            {
                "model": name,
                "what": f"everyday, default, stop_at_eos={stop}",
                "tokens_per_step": m["tokens_per_step"],
                "nfe_per_sample": m["nfe_per_sample"],
            }
        )
        print(
            f"{name:<12} {rows[-1]['what']:<44} tok/step {m['tokens_per_step']:6.2f}  NFE {m['nfe_per_sample']:6.2f}",
            flush=True,
        )
    texts = docstrings(held_out=True)[: args.texts]
    prompts = [tok.encode(" ".join(t.split()[: max(1, int(len(t.split()) * 0.3))])) for t in texts]
    outs = {}
    for label, threshold in (("baseline", None), ("threshold 0.9", 0.9)):
        config = GenerationConfig.for_model(
            model,
            GenerationConfig(
                gen_length=64,
                block_length=32,
                steps=64,
                threshold=threshold,
                stop_at_eos=False,
                cache="none",
                suffix_window=None,
                refresh="full",
            ),
        )
        out = fastdllm.generate(model, prompts, config=config)
        steps = [s for row in out.tokens_per_step for s in row]
        outs[label] = out
        rows.append(
            {
                "model": name,
                "what": f"general text, {label}",
                "tokens_per_step": sum(steps) / len(steps),
                "nfe_per_sample": sum(out.nfe_per_row) / len(prompts),
            }
        )
    a, b = outs["baseline"].sequences, outs["threshold 0.9"].sequences
    agree = sum(int((x == y).sum()) for x, y in zip(a, b)) / sum(len(x) for x in a)
    rows[-1]["agreement_with_baseline"] = agree
    for r in rows[-2:]:
        print(
            f"{name:<12} {r['what']:<44} tok/step {r['tokens_per_step']:6.2f}  NFE {r['nfe_per_sample']:6.2f}"
            + (f"  tokens equal to the baseline's {100 * agree:.1f}%" if "agreement_with_baseline" in r else ""),
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["llada-arith", "dream-arith"])
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--baseline-limit", type=int, default=100, help="problems per baseline row (it is ~50x slower)")
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--texts", type=int, default=32, help="held-out docstring paragraphs")
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        model, tok = fastdllm.load(name, dtype="bfloat16")
        rows += confidence_rows(name, model, tok, args)
        if not args.skip_accuracy:
            rows += accuracy_rows(name, model, tok, args)
        if args.out:
            Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
