"""Which decoding forwards `cuda_graphs` runs through its fixed-shape step, and in how many shapes:
per embedded model and cache policy, arith problems decoded in one batch with `cuda_graphs=True`,
the share of forwards graphed and the distinct input shapes (a CUDA graph each on a GPU).

    python benchmarks/graph_coverage.py [--models llada-arith sdar-arith] [--problems 16] [--out FILE]
    python benchmarks/graph_coverage.py --models tests/fixtures/nemotron_labs_diffusion_micro  # its 3 modes
    python benchmarks/graph_coverage.py --models gemma-arith  # DiffusionGemma under each cache it takes
    python benchmarks/graph_coverage.py --joins 2  # rows joining a running decode, as a server's

Each decodes on a fixed schedule (4 tokens a step, no early stop: the embedded models' confidence
would end a block in a step or two). The fixed-shape step runs eagerly here (no compile: what is
counted is which forwards take it, not their time); run it with PYTHONPATH set to another
checkout to compare. Tokens are checked against the same decode without `cuda_graphs`.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import fastdllm
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.engine.kv.runner import KVRunner
from fastdllm.evaluation.tasks import arith
from fastdllm.models.transformer import Transformer

MULTI = dict(parallel_blocks=2, block_add_threshold=0.0, lookahead_threshold=1.0, decoded_token_threshold=0.0)
NEMOTRON_MODES = ("nemotron_labs_diffusion", "nemotron_labs_diffusion_ar", "nemotron_labs_diffusion_linear_spec")
CONFIGS = {
    "dual (Fast-dLLM)": dict(cache="dual", suffix_window=None, refresh="full"),
    "dual, vicinity, suffix 0": dict(cache="dual", suffix_window=0, refresh="vicinity"),
    "prefix": dict(cache="prefix", suffix_window=None, refresh="full"),
    "none": dict(cache="none", suffix_window=None),
    "delayed, 2 blocks": dict(cache="delayed", suffix_window=None, **MULTI),
    "sub-block": dict(cache="sub-block", suffix_window=None, refresh="full"),  # sub-blocks of half a block
}
# DiffusionGemma's canvases under each cache it takes, its own decoding (seeded draws, every
# denoising step: its adaptive stop off)
CANVAS_CONFIGS = {
    "dual, vicinity (default)": dict(cache="dual", refresh="vicinity"),
    "dual, full refresh": dict(cache="dual", refresh="full"),
    "prefix": dict(cache="prefix"),
    "none": dict(cache="none"),
}


def coverage(model, ids, config, joins: int | None = None) -> dict:
    """One decode with and one without `cuda_graphs`, counting the fixed-shape steps; with
    `joins`, the rows join one running decode (`BlockDecoder`) at seeded random steps, up to
    `joins` at a step, as a server's requests do."""
    shapes, graphed, calls = set(), [0], [0]

    def eager(self):
        def run(*args):
            calls[0] += 1
            shapes.add((tuple(args[0].shape), args[3].shape[-1]))  # (rows, window columns), keys
            return self.window_logits_static(*args)

        return run

    def forward(self, pages, seq, windows, forms=None):
        graphed[0] += forms is not None
        return run_forward(self, pages, seq, windows, forms)

    def decode(config):
        if joins is None:
            out = fastdllm.generate(model, ids, config=config)
            return out.sequences.tolist(), out.nfe
        decoder, rng, pending, rows = BlockDecoder(model, config), random.Random(0), list(ids), []
        while decoder.active or pending:
            for _ in range(rng.randint(0, joins)):
                if pending:
                    rows += decoder.add([pending.pop(0)], config=config)
            if decoder.active:
                decoder.step()
        return [r.answer.tolist() for r in rows], decoder.nfe

    plain, _ = decode(config)
    patched, Transformer.graphed_window_logits = Transformer.graphed_window_logits, eager
    run_forward, KVRunner.forward = KVRunner.forward, forward
    try:
        out, nfe = decode(config.replace(cuda_graphs=True))
    finally:
        Transformer.graphed_window_logits, KVRunner.forward = patched, run_forward
    return {
        "forwards": nfe,
        "graphed": graphed[0],
        "graphed_share": round(graphed[0] / max(1, nfe), 3),
        "fixed_shape_calls": calls[0],  # more than one in a step whose windows part (`FixedForm.parts`)
        "shapes": len(shapes),
        "same_tokens": plain == out,
    }


def line(row: dict) -> str:
    return (
        f"{row['model'][-12:]:12s} {row['config'][-26:]:26s} forwards {row['forwards']:4d}  "
        f"graphed {row['graphed']:4d} ({100 * row['graphed_share']:5.1f}%) in {row['fixed_shape_calls']:4d} calls  "
        f"shapes {row['shapes']:3d}  "
        f"same tokens {row['same_tokens']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llada-arith", "dream-arith", "sdar-arith"])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument(
        "--joins", type=int, default=None, help="rows join one running decode, up to this many at a step (a server's)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        model, tok = fastdllm.load(name, dtype=torch.float32)
        ids = [arith.prompt_ids(tok, p.question, arith.fewshot_pool()[:2]) for p in arith.test_split()[: args.problems]]
        if model.two_passes:  # Nemotron-Labs-Diffusion: its three modes, each as published
            for preset in NEMOTRON_MODES:
                config = getattr(fastdllm.GenerationConfig, preset)(gen_length=args.gen_length)
                row = {"model": name, "config": preset, **coverage(model, ids, config.fit_to_model(model), args.joins)}
                rows.append(row)
                print(line(row), flush=True)
            continue
        if model.family.name == "DiffusionGemma":
            for label, fields in CANVAS_CONFIGS.items():
                steps = dict(gen_length=args.gen_length, max_denoising_steps=16, confidence_threshold=None, seed=0)
                config = fastdllm.GenerationConfig.for_model(model, stop_at_eos=False, **steps, **fields)
                row = {"model": name, "config": label, **coverage(model, ids, config, args.joins)}
                rows.append(row)
                print(line(row), flush=True)
            continue
        for label, fields in CONFIGS.items():
            base = fastdllm.GenerationConfig.for_model(model, checkpoint_defaults=False)
            try:
                # a fixed schedule, 4 tokens a step to the end: the steps a real model would take
                steps = dict(gen_length=args.gen_length, steps=args.gen_length // 4, threshold=None, stop_at_eos=False)
                if fields["cache"] == "sub-block":
                    fields = dict(fields, sub_block_length=max(1, base.block_length // 2))
                config = base.replace(**steps, **fields)
            except ValueError as e:  # a policy the family does not take
                print(f"{name:12s} {label:26s} -: {e}")
                continue
            row = {"model": name, "config": label, **coverage(model, ids, config, args.joins)}
            rows.append(row)
            print(line(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
