"""`fastdllm quantize SRC DST --bits 8|4`: write a weight-only quantized checkpoint once, so that
loading it is fast and small (`fastdllm.models.loading.quantize_checkpoint`); with `--format gguf`,
a GGUF file for llama.cpp (`fastdllm.models.gguf.write_gguf`: --bits 8 is Q8_0, 4 Q4_0, 16 F16,
32 F32)."""

from __future__ import annotations

from .args import UserError, parser

EPILOG = """examples:
  fastdllm quantize GSAI-ML/LLaDA-8B-Instruct llada-8b-w4 --bits 4
  fastdllm quantize llada-arith llada-arith-w8 --bits 8 --format gptq
  fastdllm eval --task arith --model llada-arith-w8
  fastdllm quantize llada-arith llada-arith-q8_0.gguf --bits 8 --format gguf
"""
GGUF_KINDS = {8: "q8_0", 4: "q4_0", 16: "f16", 32: "f32"}


def main(argv: list[str] | None = None) -> int:
    from ..quant.formats import FORMATS

    p = parser("fastdllm quantize", __doc__.split("\n\n")[0], EPILOG)
    p.add_argument("src", help="checkpoint folder, hub id or embedded model name")
    p.add_argument("dst", help="folder to write")
    p.add_argument("--bits", type=int, required=True, choices=[8, 4, 16, 32], help="16 and 32: --format gguf only")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="N",
        help="columns per scale for int4 (32, 64, 128, 256; default 128 or the largest that fits); "
        "int8 is per output channel unless given",
    )
    p.add_argument(
        "--format",
        default="compressed-tensors",
        choices=[*FORMATS, "gguf"],
        help="checkpoint layout (default compressed-tensors: what vLLM and llm-compressor use; gguf: "
        "one file for llama.cpp)",
    )
    p.add_argument("--quantize-head", action="store_true", help="quantize the output head too")
    p.add_argument(
        "--dtype", default=None, help="dtype of the scales and unquantized weights (default the checkpoint's)"
    )
    p.add_argument("--max-shard-size", type=int, default=None, metavar="BYTES", help="shard the safetensors files")
    args = p.parse_args(argv)
    from ..models.loading import load, quantize_checkpoint
    from ..quant import weight_bytes

    if args.format == "gguf":
        return _gguf(args)
    if args.bits > 8:
        raise UserError(f"bits: {args.bits} only with --format gguf (a float GGUF)")
    try:
        dst = quantize_checkpoint(
            args.src,
            args.dst,
            args.bits,
            group_size=args.group_size,
            quant_format=args.format,
            quantize_head=args.quantize_head,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
        )
        model, _ = load(dst, device="cpu")
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    q = model.quantization
    size = weight_bytes(model)["weight_bytes"]
    print(
        f"wrote {dst}: {q['layers']} layers {q['bits'][0]}-bit ({args.format}, group size {q['group_size']}), "
        f"weights {size / 2**20:.1f} MiB resident"
    )
    return 0


def _gguf(args) -> int:
    """The source model as one GGUF file (LLaDA, Dream or RND1), as llama.cpp's converter writes it."""
    from pathlib import Path

    from ..models.gguf import write_gguf
    from ..models.loading import load

    if args.group_size is not None or args.quantize_head:
        raise UserError("group_size: not with --format gguf (its blocks are its own: 32 weights per scale)")
    try:
        model, tokenizer = load(args.src, dtype="float32", device="cpu")
        dst = write_gguf(model, tokenizer, Path(args.dst), GGUF_KINDS[args.bits])
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    print(f"wrote {dst}: {GGUF_KINDS[args.bits].upper()} matrices, {dst.stat().st_size / 2**20:.1f} MiB")
    return 0
