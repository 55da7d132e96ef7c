"""Kernel-issuing aten calls per decoding step (`torch.profiler` over `fastdllm.generate`): what a
GPU would launch, counted on the CPU. Per embedded model, at batch 1 and 16, each model's default
config, float32, one thread: aten calls that have no aten call inside them, views and reshapes not
counted, per forward; and attention calls (`scaled_dot_product_attention`) and K/V writes into the
pool (`index_copy_`, `copy_` into it) per layer per forward.

    python benchmarks/aten_calls.py [--models llada-arith sdar-arith gemma-arith] [--batches 1 16]
        [--attention-calls one|per_row|auto]

`--attention-calls` sets how the packed forward's rows attend (`models.packed`): "one" call per
layer for every row (the default here: what a GPU runs from 8 rows), a call "per_row", or "auto"
(this device's rule: on a CPU a call per row for the shared transformer).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

import fastdllm
from fastdllm.evaluation.tasks import arith

VIEWS = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::select",
    "aten::transpose", "aten::t", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::permute",
    "aten::alias", "aten::detach", "aten::unflatten", "aten::flatten", "aten::split", "aten::narrow",
    "aten::contiguous", "aten::lift_fresh", "aten::split_with_sizes", "aten::unbind", "aten::chunk",
}  # fmt: skip


def count(model, tok, batch: int) -> dict:
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:batch]]
    # seeded: a model that draws (DiffusionGemma's canvases) takes the same steps in every checkout
    config = fastdllm.GenerationConfig.for_model(model, checkpoint_defaults=False).replace(seed=0)
    with torch.inference_mode():
        fastdllm.generate(model, ids, config=config)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fastdllm.generate(model, ids, config=config)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    issuing = [e for e in leaves if e.name not in VIEWS]
    layers = model.args.n_layers
    attention = sum(e.name == "aten::scaled_dot_product_attention" for e in events)
    writes = sum(e.name == "aten::index_copy_" for e in events)
    return {
        "batch": batch,
        "forwards": out.nfe,
        "aten_calls_per_forward": round(len(issuing) / out.nfe, 1),
        "attention_calls_per_layer_per_forward": round(attention / (layers * out.nfe), 2),
        "kv_index_copies_per_layer_per_forward": round(writes / (layers * out.nfe), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llada-arith", "sdar-arith", "gemma-arith"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--attention-calls", default="one", choices=["one", "per_row", "auto"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        model, tok = fastdllm.load(name, dtype="float32")
        model.attention_calls = args.attention_calls
        for batch in args.batches:
            record = {"model": name, "code": fastdllm.__file__, "attention_calls": args.attention_calls}
            print(json.dumps({**record, **count(model, tok, batch)}), flush=True)


if __name__ == "__main__":
    main()
