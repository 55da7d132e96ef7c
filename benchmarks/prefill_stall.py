"""How long one long prompt stalls the rows already decoding, at a published model's width:
chunked prefill (`prefill_chunk`) against one prefill forward.

A block-causal family's published config with `--layers` layers and random bf16 weights (as
`gpu_check.py` builds it; random weights reveal one token per step, which is all the timing
needs). `--rows` rows with short prompts decode; after a few steps a row with a `--prompt`-position
prompt joins. Per `--chunks` value (none: one forward), in one process, after one untimed run of
each: the median step before it joins, the longest step while it is prefilled (the decoding rows'
stall), and the time from its arrival to its first decoding step.

    python benchmarks/prefill_stall.py --device cuda --chunks none 512 1024     # on a GPU
    python benchmarks/prefill_stall.py --tiny                                    # anywhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.gpu_check import wide  # noqa: E402
from fastdllm import GenerationConfig  # noqa: E402
from fastdllm.engine.decoder import BlockDecoder  # noqa: E402


def prompts(model, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.args.vocab_size, (n, length), generator=g)
    ids[ids == model.mask_token_id] = 0
    return ids.tolist()


def run(model, rows: int, prompt: int, chunk, sync) -> dict:
    block = model.args.block_size
    config = GenerationConfig(
        gen_length=16 * block,
        block_length=block,
        threshold=0.9,
        stop_at_eos=False,
        prefix_cache="off",
        prefill_chunk=chunk,
    )
    decoder = BlockDecoder(model, config)
    decoder.add(prompts(model, rows, 8 * block, seed=1))
    times, joined_at, arrived = [], None, 6
    long_row = None
    for step in range(64):
        if step == arrived:
            (long_row,) = decoder.add(prompts(model, 1, prompt, seed=2))
        sync()
        t0 = time.perf_counter()
        decoder.step()
        sync()
        times.append(time.perf_counter() - t0)
        if step >= arrived and long_row.nfe > 0 and joined_at is None:
            joined_at = step
        if joined_at is not None and step > joined_at:
            break
    before = statistics.median(times[:arrived])
    during = max(times[arrived : joined_at + 1])
    return {
        "step_ms_before": round(1000 * before, 2),
        "longest_step_ms_while_it_joins": round(1000 * during, 2),
        "ms_to_its_first_decoding_step": round(1000 * sum(times[arrived : joined_at + 1]), 2),
        "steps_to_join": joined_at - arrived + 1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="sdar")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--chunks", nargs="+", default=["none", "512", "1024"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a small width, one layer, a 256-position prompt")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        args.layers, args.prompt, args.chunks = 1, 256, ["none", "64"]
    model = wide(args.family, args.layers, device, args.tiny)
    if args.tiny:  # the published special ids lie past the small vocabulary
        model.args.mask_token_id, model.args.eos_token_id = model.args.vocab_size - 1, model.args.vocab_size - 2
        model.stop_token_ids = [model.args.eos_token_id]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    chunks = [None if c == "none" else int(c) for c in args.chunks]
    results = []
    with torch.inference_mode():
        for chunk in chunks:  # untimed: every shape's first costs
            run(model, args.rows, args.prompt, chunk, sync)
        for chunk in chunks:
            row = {"family": args.family, "layers": args.layers, "rows": args.rows, "prompt": args.prompt}
            row |= {"device": str(device), "prefill_chunk": chunk, **run(model, args.rows, args.prompt, chunk, sync)}
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
