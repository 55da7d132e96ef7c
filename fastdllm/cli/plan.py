"""`fastdllm plan`: weights and KV cache per rank under tensor / expert parallelism, and whether
they fit a device, from config.json alone (`fastdllm.models.plan`)."""

from __future__ import annotations

import json

from .args import UserError, parser

EPILOG = """examples:
  fastdllm plan --model GSAI-ML/LLaDA-8B-Instruct --tp 2 --batch 8 --max-len 2048 --memory 24
  fastdllm plan --model inclusionAI/LLaDA2.0-flash --tp 8 --ep 8 --memory 80
  fastdllm plan --model config.json --tp 4 --quantize int4
"""
GIB = 1024**3


def main(argv: list[str] | None = None) -> int:
    from ..models.plan import config_of, plan

    p = parser("fastdllm plan", __doc__.split("\n\n")[0], EPILOG)
    p.add_argument(
        "--model", default=None, help="folder, hub id, embedded model or config.json (default: the embedded model)"
    )
    p.add_argument("--revision", default=None, help="for a hub id: the branch, tag or commit")
    p.add_argument("--local-files-only", action="store_true", help="for a hub id: the hub cache only")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks among them (default 1)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="weights and KV cache: bfloat16, float16 or float32 (default: auto, what loading it here holds)",
    )
    p.add_argument("--quantize", default=None, choices=["int8", "int4"], help="weight-only quantized linear layers")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    p.add_argument("--quantize-head", action="store_true", help="quantize the output head too")
    p.add_argument("--vocab-parallel", action="store_true", help="split the embedding and head by vocabulary rows")
    p.add_argument("--batch", type=int, default=1, help="rows decoded at once (default 1)")
    p.add_argument("--max-len", type=int, default=None, help="positions per row (default: the model's context)")
    p.add_argument("--memory", type=float, default=None, metavar="GIB", help="device memory to fit, in GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    try:
        config = config_of(args.model, args.revision, args.local_files_only)
        if args.dtype == "auto":
            args.dtype = loaded_dtype(config)[0]
        if args.quantize is None:  # an FP8 or NVFP4 checkpoint's linear layers stay so when loaded
            args.quantize = stored_floating(config)
        r = plan(
            config,
            args.tp,
            args.ep,
            dtype=args.dtype,
            quantize=args.quantize,
            group_size=args.group_size,
            quantize_head=args.quantize_head,
            vocab_parallel=args.vocab_parallel,
            batch=args.batch,
            max_len=args.max_len,
        )
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    fits = None if args.memory is None else r.total_bytes <= args.memory * GIB
    if args.json:
        print(json.dumps(as_json(r, args.memory, fits)))
        return 0 if fits is not False else 1
    if config.get("gguf_tensor_types"):
        print(
            f"a GGUF of {', '.join(config['gguf_tensor_types'])} tensors: every one is dequantized at load, so "
            f"it takes {args.quantize or args.dtype} weights in memory (--quantize to hold int8/int4)"
        )
    print(
        f"{args.model or 'llada-arith'}: {scaled(r.parameters, 1000, 'KMB')} parameters, "
        f"{scaled(r.active_parameters, 1000, 'KMB')} per token; tp {r.tp}, ep {r.ep}, "
        f"{args.quantize or args.dtype} weights"
    )
    print(
        f"per rank: weights {scaled(r.weight_bytes)} (split {scaled(r.sharded_bytes)} + whole "
        f"{scaled(r.replicated_bytes)}), KV cache {scaled(r.kv_cache_bytes)} for {args.batch} x "
        f"{args.max_len or 'context'} positions, total {scaled(r.total_bytes)}"
    )
    if fits is not None:
        print(f"fits {args.memory:g} GiB: {'yes' if fits else 'no'}")
    print(loads_here(config))
    return 0 if fits is not False else 1


def stored_floating(config: dict) -> str | None:
    """ "fp8" or "nvfp4" where the checkpoint's linear layers are compressed-tensors FP8 or NVFP4
    (`quant.floating`), else None."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        return None
    return {"float-quantized": "fp8", "nvfp4-pack-quantized": "nvfp4"}.get(qc.get("format"))


def as_json(r, memory: float | None, fits: bool | None) -> dict:
    return {
        "parameters": r.parameters,
        "active_parameters": r.active_parameters,
        "tp": r.tp,
        "ep": r.ep,
        "weight_bytes_per_rank": r.weight_bytes,
        "sharded_bytes": r.sharded_bytes,
        "replicated_bytes": r.replicated_bytes,
        "kv_cache_bytes_per_rank": r.kv_cache_bytes,
        "total_bytes_per_rank": r.total_bytes,
        "memory_gib": memory,
        "fits": fits,
    }


def loaded_dtype(config: dict) -> tuple[str, str | None]:
    """What `dtype="auto"` (every command's default) loads the checkpoint in on this machine (the
    dtype it stores, where the device computes it natively: `loading.auto_dtype`), and why where it
    is not the stored one."""
    import torch

    from ..models.loading import auto_dtype, checkpoint_dtype

    chosen, why = auto_dtype(checkpoint_dtype(config), "cuda" if torch.cuda.is_available() else "cpu")
    return str(chosen).removeprefix("torch."), why


def loads_here(config: dict) -> str:
    name, why = loaded_dtype(config)
    return f"on this machine --dtype auto loads it in {name}: " + (why or "the checkpoint's, computed natively")


def scaled(n: float, base: int = 1024, units=("KiB", "MiB", "GiB", "TiB")) -> str:
    """`n` in the largest unit it reaches (bytes by default; `base` 1000 and units "KMB" for counts)."""
    unit = "" if base == 1000 else " B"
    for name in units:
        if abs(n) < base:
            break
        n, unit = n / base, (name if base == 1000 else f" {name}")
    return f"{n:.2f}{unit}"
