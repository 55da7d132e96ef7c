"""The GPU table in one command: every family at its real width, replaying real decoding schedules.

    python benchmarks/gpu_check.py                 # on a GPU: aim at under 8 minutes
    python benchmarks/gpu_check.py --tiny          # anywhere (the slow test suite runs this)
    python benchmarks/gpu_check.py --out docs/results/gpu_check.json

Random weights decide nothing (their confidences are near-uniform, so a threshold would reveal one
token per step), so the schedules come from the embedded models: each configuration (baseline,
Fast-dLLM, default) decodes a few held-out arith problems on the family's embedded twin (llada-arith
for LLaDA, Dream and LLaDA-MoE, sdar-arith for SDAR and Fast-dLLM v2, llada2-arith for LLaDA2, the
micro twin of `tests/fixtures` for Nemotron-Labs-Diffusion),
recording every forward's window. Each family's model is then built at the width of its published
config (random bf16 weights, `--layers` of its layers: time per layer is what scales), and the
windows are replayed on it for `--batch` rows at once: tokens/s of the generated tokens, and
positions computed per token (the work, independent of the machine). Optional rows: int8 / int4
weights (`--quant`), every step after a row's first through the fixed-shape step `cuda_graphs` captures
(`--graphs`: CUDA graphs on a GPU, compiled once per batch size), and torch.compile of the
layers with dynamic shapes (`--compile`). Eager forwards run twice, their rows attending in a call
per row and in one call per layer (`models.packed`: what `attention_calls` "auto" picks from 8 rows
on a GPU). Then the ways of attending ragged rows
(`attention_kernels.py`: SDPA per row, padded, over jagged nested tensors, flex_attention) at
LLaDA-8B's attention shapes for 1-64 rows.
The table and the attention results are printed (and written as JSON with `--out`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

FAST_DLLM = dict(cache="dual", threshold=0.9, suffix_window=None, refresh="full", refresh_every=None)
CONFIGS = {"baseline": dict(FAST_DLLM, cache="none", threshold=None), "fast-dllm": FAST_DLLM, "default": {}}
FAMILIES = {  # family module -> the embedded twin whose schedules it replays
    "llada": "llada-arith",
    "dream": "dream-arith",
    "llada_moe": "llada-arith",
    "sdar": "sdar-arith",
    "fast_dllm_v2": "sdar-arith",
    "llada2": "llada2-arith",
    "nemotron_labs_diffusion": "tests/fixtures/nemotron_labs_diffusion_micro",
}


def record(twin: str, config_name: str, gen_length: int, problems: int) -> tuple[list[list[tuple]], int]:
    """Every forward's windows (`KVRunner.history`) of `problems` decodes, one row each, and the
    tokens they generated."""
    import fastdllm
    from fastdllm.engine.kv.runner import KVRunner
    from fastdllm.evaluation.tasks import arith

    model, tok = fastdllm.load(twin, dtype="float32", device="cpu")
    base = fastdllm.GenerationConfig.for_model(model, checkpoint_defaults=False)
    config = base.replace(gen_length=gen_length, **CONFIGS[config_name])
    if config_name == "baseline":
        config = config.replace(steps=gen_length)
    runs, tokens, runner = [], 0, KVRunner(model)  # one runner: later prompts share stored blocks
    for p in arith.test_split()[:problems]:
        runner.record()
        out = fastdllm.generate(model, [arith.prompt_ids(tok, p.question, [])], config=config, kv=runner)
        runs.append(runner.history)
        tokens += sum(out.num_tokens)
    return runs, tokens


def wide(family: str, layers: int, device, tiny: bool):
    """The family's published config with `layers` layers (or a small width with --tiny), random bf16."""
    import importlib

    from fastdllm.models.loading import build_model

    config = dict(importlib.import_module(f"fastdllm.models.{family}").REFERENCE_CONFIG)
    for key in ("num_hidden_layers", "n_layers"):
        if key in config:
            depth, config[key] = config[key], layers
            for name, value in list(config.items()):  # per-layer lists (LLaDA-MoE's moe_layer_freq)
                if isinstance(value, list) and len(value) == depth:
                    config[name] = value[:layers]
    if tiny:  # a small model of the same layout
        for key, value in (
            ("hidden_size", 256),
            ("d_model", 256),
            ("intermediate_size", 512),
            ("mlp_hidden_size", 512),
            ("moe_intermediate_size", 64),
            ("num_attention_heads", 4),
            ("n_heads", 4),
            ("num_key_value_heads", 2),
            ("n_kv_heads", 4),
            ("head_dim", 64),
            ("vocab_size", 4096),
            ("embedding_size", 4096),
            ("num_experts", 8),
            ("num_experts_per_tok", 2),
            ("n_group", 1),
            ("topk_group", 1),
        ):
            if key in config:
                config[key] = value
    model = build_model(config, device="meta").to_empty(device=device)
    model.setup_rope(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


@torch.inference_mode()
def replay(model, history: list[list[tuple]], batch: int, device, mode: str = "eager", capacity: int = 0) -> None:
    """The recorded forwards of one row on `batch` copies of it (random tokens: only the shapes
    matter), each forward one packed call over the rows' windows; with `graphs`, every forward
    after the first through the fixed-shape step that `cuda_graphs` captures, over a cache of
    `capacity` positions (at least the run's largest length: one buffer length for every run, so
    that each batch size is one layout with a few window widths); with `compile`, the layers'
    dense math through torch.compile (dynamic shapes)."""
    graphs = mode == "graphs"
    vocab = model.args.vocab_size
    capacity = max(capacity, length(history))
    x = torch.randint(0, vocab, (batch, capacity), device=device)
    from fastdllm.engine.cache.base import SequenceView
    from fastdllm.engine.kv.pages import PagedKVCache
    from fastdllm.engine.kv.runner import FixedForm

    cache = PagedKVCache.for_rows(model, batch, capacity)
    for n, forward in enumerate(history):
        _, lo, hi, keys, start = forward[0]
        windows = [(b, lo, hi, keys, start) for b in range(batch)]
        if graphs and n:  # a step as `cuda_graphs` runs it (not a row's first): in `FixedForm`'s shapes
            per_row = [(value,) * batch for value in (start, keys, 0, hi - lo, hi - start)]
            form = FixedForm.of(model, SequenceView(x, *per_row), windows)
            model.graphed_window_logits()(*form.inputs(x, cache, None))
            continue
        model.packed_logits(x, windows, cache, compiled=mode == "compile")


def length(history: list[list[tuple]]) -> int:
    """The cache length a run's forwards reach."""
    return max(max(hi, keys) for forward in history for _, _, hi, keys, _ in forward)


def timed(model, runs, batch, device, mode: str = "eager", capacity: int = 0) -> float:
    """Seconds to replay `runs`, after one untimed replay of each: every shape's first costs (the
    allocator growing, kernel selection, compiling, capturing graphs) fall before the clock starts."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for windows in runs:
        replay(model, windows, batch, device, mode, capacity)
    sync()
    t0 = time.perf_counter()
    for windows in runs:
        replay(model, windows, batch, device, mode, capacity)
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small widths, one problem, batch 1 and 2 (runs on a CPU)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--layers", type=int, default=None, help="layers built per model (default 4; --tiny 1)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="rows at once (default 1 8 32; --tiny 1 2)")
    p.add_argument("--problems", type=int, default=None, help="schedules recorded per config (default 2)")
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--quant", nargs="*", default=[], choices=["int8", "int4"], help="also quantized weights")
    p.add_argument("--compile", action="store_true", help="also torch.compile'd layers (dynamic shapes)")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also every step after the first through the fixed-shape step of `cuda_graphs` (CUDA graphs on a GPU)",
    )
    p.add_argument(
        "--no-attention",
        dest="attention",
        action="store_false",
        help="skip the ragged-attention candidates (`attention_kernels.py`) at LLaDA-8B's attention shapes",
    )
    p.add_argument(
        "--attention-calls",
        nargs="+",
        default=["per_row", "one"],
        choices=["per_row", "one", "auto"],
        help="how the eager forwards' rows attend (`models.packed`)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = args.layers or (1 if args.tiny else 4)
    batches = args.batch or ([1, 2] if args.tiny else [1, 8, 32])
    problems = args.problems or (1 if args.tiny else 2)
    gen_length = 64 if args.tiny else args.gen_length
    schedules = {}
    for twin in sorted(set(FAMILIES[f] for f in args.families)):
        for name in CONFIGS:
            schedules[twin, name] = record(twin, name, gen_length, problems)
    rows = []
    print(f"{'family':<24} {'config':<10} {'batch':>5} {'weights':<8} {'mode':<14} {'tok/s':>9} {'pos/tok':>8}")
    for family in args.families:
        model = wide(family, layers, device, args.tiny)
        variants = [("bf16", model)]
        for q in args.quant:
            from fastdllm.models.loading import QUANTIZE
            from fastdllm.quant import install, quantize_weights

            qm = wide(family, layers, device, args.tiny)
            install(qm, quantize_weights(qm, QUANTIZE[q]), device=device)
            variants.append((q, qm))
        modes = [f"eager:{c}" for c in args.attention_calls]
        modes += (["graphs"] if args.graphs else []) + (["compile"] if args.compile else [])
        capacity = max(length(h) for name in CONFIGS for h in schedules[FAMILIES[family], name][0])
        for weights, m in variants:
            for mode in modes:
                for name in CONFIGS:
                    runs, tokens = schedules[FAMILIES[family], name]
                    positions = sum(hi - lo for r in runs for forward in r for _, lo, hi, _, _ in forward)
                    for batch in batches:
                        kind, _, calls = mode.partition(":")  # eager:per_row, eager:one, graphs, compile
                        if calls == "one" and batch == 1 and "per_row" in args.attention_calls:
                            continue  # one row attends in one call either way
                        m.attention_calls = calls or "auto"
                        seconds = timed(m, runs, batch, device, kind, capacity)
                        row = {
                            "family": family,
                            "config": name,
                            "batch": batch,
                            "weights": weights,
                            "mode": mode,
                            "layers": layers,
                            "tokens_per_second": tokens * batch / seconds,
                            "positions_per_token": positions / tokens,
                            "device": str(device),
                        }
                        rows.append(row)
                        print(
                            f"{family:<24} {name:<10} {batch:>5} {weights:<8} {mode:<14} "
                            f"{row['tokens_per_second']:>9.1f} {row['positions_per_token']:>8.2f}",
                            flush=True,
                        )
    attention = []
    if args.attention:  # the ways of attending ragged rows, at LLaDA-8B's shapes (small with --tiny)
        from attention_kernels import measure

        shape = (4, 32, 64, 32) if args.tiny else (32, 128, 1024, 32)
        attention = measure([1, 4] if args.tiny else [1, 8, 32, 64], *shape, 3 if args.tiny else 20, device, "bfloat16")
    if args.out:
        with open(args.out, "w") as f:
            out = {"tiny": args.tiny, "layers": layers, "gen_length": gen_length, "rows": rows, "attention": attention}
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
