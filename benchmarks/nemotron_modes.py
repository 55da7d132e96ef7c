"""Nemotron-Labs-Diffusion's three decoding modes side by side on held-out arith problems: the
autoregressive mode, the diffusion mode (threshold 0.9) and LinearSpec, greedy, at batch 1 and in
batches, one thread. Per mode: tokens (up to a stop), forwards, tokens per forward, LinearSpec's mean
acceptance length, tokens/s, and how many answers equal the autoregressive mode's.

    python benchmarks/nemotron_modes.py --model tests/fixtures/nemotron_labs_diffusion_micro --problems 64

With `--mixed`, the three modes' rows together (problem i in mode i % 3): in one batch, every row on
its own block length and clock, against each mode's rows in a batch of their own one after the
other (what a server did when a batch's rows had to share a block length), alternating `--repeats`
times: wall seconds, the batches' forwards, and whether every answer is the same both ways.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.evaluation.tasks import arith

MODES = {
    "ar": GenerationConfig.nemotron_labs_diffusion_ar,
    "diffusion": GenerationConfig.nemotron_labs_diffusion,
    "linear_spec": GenerationConfig.nemotron_labs_diffusion_linear_spec,
}


def run(model, prompts: list, config: GenerationConfig, batch: int) -> dict:
    tokens = forwards = 0
    answers, acceptances = [], []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out = generate(model, prompts[i : i + batch], config)
        tokens += sum(out.num_tokens)
        forwards += sum(out.nfe_per_row)
        answers += [row[:n] for row, n in zip(out.sequences.tolist(), out.num_tokens)]
        acceptances += [a for row in out.acceptances for a in row]
    seconds = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "row_forwards": forwards,
        "tokens_per_forward": round(tokens / forwards, 3),
        "mean_acceptance_length": round(sum(acceptances) / len(acceptances), 3) if acceptances else None,
        "tokens_per_second": round(tokens / seconds, 1),
        "answers": answers,
    }


def mixed(model, prompts: list, gen_length: int, batch: int, repeats: int) -> dict:
    """Mode i % 3 for problem i, `batch` rows of each mode at a time: one batch of every mode's
    rows, against a batch per mode in turn."""
    presets = list(MODES.values())
    configs = [presets[i % 3](gen_length=gen_length) for i in range(len(prompts))]
    groups = [list(range(k, len(prompts), 3)) for k in range(3)]

    def together() -> tuple[list, int]:
        answers, forwards = [None] * len(prompts), 0
        for lo in range(0, len(groups[0]), batch):
            decoder = BlockDecoder(model, configs[groups[0][lo]])
            rows = {i: decoder.add([prompts[i]], config=configs[i])[0] for g in groups for i in g[lo : lo + batch]}
            while decoder.active:
                decoder.step()
            forwards += decoder.nfe
            for i, r in rows.items():
                answers[i] = r.answer.tolist()
        return answers, forwards

    def apart() -> tuple[list, int]:
        answers, forwards = [None] * len(prompts), 0
        for lo in range(0, len(groups[0]), batch):
            for g in groups:
                part = g[lo : lo + batch]
                out = generate(model, [prompts[i] for i in part], configs[part[0]])
                forwards += out.nfe
                for i, row, n in zip(part, out.sequences.tolist(), out.num_tokens):
                    answers[i] = row
                    kept[i] = n
        return answers, forwards

    kept = [0] * len(prompts)  # tokens up to a stop, per answer

    times: dict[str, list[float]] = {"one batch": [], "a batch per mode": []}
    results = {}
    for _ in range(repeats):
        for name, way in (("one batch", together), ("a batch per mode", apart)):
            t0 = time.perf_counter()
            results[name] = way()
            times[name].append(round(time.perf_counter() - t0, 3))
    tokens = sum(kept)
    return {
        "rows": len(prompts),
        "rows_per_mode_per_batch": batch,
        "tokens": tokens,
        **{f"{name} seconds": t for name, t in times.items()},
        **{f"{name} tokens/s (median)": round(tokens / sorted(t)[len(t) // 2], 1) for name, t in times.items()},
        **{f"{name} forwards": results[name][1] for name in times},
        "same_answers": results["one batch"][0] == results["a batch per mode"][0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tests/fixtures/nemotron_labs_diffusion_micro")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mixed", action="store_true", help="the three modes' rows in one batch against apart")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = fastdllm.load(args.model, dtype="float32")
    prompts = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[: args.problems]]
    if args.mixed:
        with torch.inference_mode():
            result = mixed(model, prompts, args.gen_length, args.batch, args.repeats)
        print(json.dumps({"model": args.model, "gen_length": args.gen_length, **result}, indent=1))
        return
    results = {}
    with torch.inference_mode():
        for name, preset in MODES.items():
            config = preset(gen_length=args.gen_length)
            generate(model, prompts[:2], config)  # warm-up
            for batch in (1, args.batch):
                results[f"{name}, batch {batch}"] = run(model, prompts, config, batch)
    reference = results["ar, batch 1"]["answers"]
    for r in results.values():
        r["same_as_ar"] = sum(a == b for a, b in zip(r.pop("answers"), reference))
    print(
        json.dumps({"model": args.model, "problems": len(prompts), "gen_length": args.gen_length, **results}, indent=1)
    )


if __name__ == "__main__":
    main()
