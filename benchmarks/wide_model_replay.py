"""Replay the forward windows of real runs on a model of LLaDA-8B's width.

    python benchmarks/wide_model_replay.py [--problems 2] [--gen-length 1024] [--num-fewshot 8]
        [--layers 2] [--dtype float32] [--configs fast-dllm beyond]

The embedded model decodes held-out arith problems one at a time under each configuration; every
forward's window (what the cache policy recomputed, against how long a sequence) is recorded.
The same sequence of windows is then run, with random weights, on a transformer with LLaDA-8B's
d_model 4096, 32 heads, SwiGLU 12288 and vocabulary 126464, but only `--layers` layers (time per
layer is what scales), and timed. Both configurations replay in one process, alternating, so the
ratio is measured side by side. This shows whether a speed-up that the tiny model shows (where
per-step overhead matters) holds where the forward's compute dominates.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# Every row names each policy field, so that the rows do not move with GenerationConfig's defaults.
FAST_DLLM = dict(cache="dual", threshold=0.9, suffix_window=None, refresh="full", refresh_every=None)
CONFIGS = {
    "fast-dllm": FAST_DLLM,
    "suffix64": dict(FAST_DLLM, suffix_window=64),
    "beyond": dict(FAST_DLLM, suffix_window=64, refresh="vicinity"),
    "beyond32": dict(FAST_DLLM, suffix_window=32, refresh="vicinity"),  # the default
}


def record_windows(config_name: str, gen_length: int, num_fewshot: int, problems: int) -> list[list[tuple]]:
    import fastdllm
    from fastdllm.engine.kv.runner import KVRunner
    from fastdllm.evaluation.tasks import arith

    model, tok = fastdllm.load(dtype="float32")
    cfg = fastdllm.GenerationConfig(gen_length=gen_length, **CONFIGS[config_name])
    shots = arith.fewshot_exemplars(num_fewshot)
    runs, runner = [], KVRunner(model)  # one runner: later prompts share stored blocks
    for p in arith.test_split()[:problems]:
        runner.record()
        fastdllm.generate(model, [arith.prompt_ids(tok, p.question, shots)], config=cfg, kv=runner)
        runs.append(runner.history)
    return runs


def wide_model(layers: int, dtype):
    from fastdllm.models import ModelArgs, Transformer

    args = ModelArgs(
        dim=4096,
        n_layers=layers,
        n_heads=32,
        n_kv_heads=32,
        hidden_dim=12288,
        vocab_size=126464,
        max_seq_len=4096,
        rope_theta=500000.0,
        norm_eps=1e-5,
        qkv_bias=False,
        tie_embeddings=False,
        mask_token_id=126336,
        eos_token_id=126081,
        shifted_logits=False,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Transformer(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.to(dtype).eval().requires_grad_(False)


@torch.inference_mode()
def replay(model, history: list[list[tuple]]) -> float:
    """Seconds to run one generation's forwards, each a list of row windows (row, first column,
    end column, keys, first logit column); tokens are random: only the shapes matter."""
    length = max(max(hi, keys) for windows in history for _, _, hi, keys, _ in windows)
    x = torch.randint(0, 1000, (1, length))
    from fastdllm.engine.kv.pages import PagedKVCache

    cache = PagedKVCache.for_rows(model, 1, length)
    t0 = time.perf_counter()
    for windows in history:
        model.packed_logits(x, windows, cache)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", type=int, default=2)
    p.add_argument("--gen-length", type=int, default=1024)
    p.add_argument("--num-fewshot", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", nargs=2, default=["fast-dllm", "beyond"], choices=list(CONFIGS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = {c: record_windows(c, args.gen_length, args.num_fewshot, args.problems) for c in args.configs}
    for c, rs in runs.items():
        positions = [sum(hi - lo for windows in r for _, lo, hi, _, _ in windows) for r in rs]
        print(
            f"{c}: {statistics.mean(len(r) for r in rs):.1f} forwards/problem, "
            f"{statistics.mean(positions):.0f} query positions/problem"
        )
    model = wide_model(args.layers, getattr(torch, args.dtype))
    replay(model, runs[args.configs[0]][0][:1])  # warm up
    times = {c: 0.0 for c in args.configs}
    for i in range(args.problems):
        for c in args.configs:
            times[c] += replay(model, runs[c][i])
    a, b = args.configs
    print(
        f"width 4096, {args.layers} layers, {args.dtype}: {a} {times[a]:.1f}s, {b} {times[b]:.1f}s "
        f"for {args.problems} problems: {b} is {times[a] / times[b]:.2f}x faster"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
