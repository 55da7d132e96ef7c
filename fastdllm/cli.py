"""`fastdllm <command>`: the command-line entry point (also `python -m fastdllm <command>`).

Each command lives in its own module with a `main(argv)`; this file only dispatches and holds the
decoding flags every command shares, so that they have the names and validation of
`GenerationConfig`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .generate import GenerationConfig

COMMANDS = {
    "generate": ("fastdllm.chat", "main_generate", "generate text for one prompt"),
    "chat": ("fastdllm.chat", "main_chat", "multi-turn chat with the model's chat template"),
    "serve": ("fastdllm.server", "main", "OpenAI-compatible HTTP server"),
    "eval": ("fastdllm.evaluate", "main", "accuracy and tokens/s on gsm8k, math500, humaneval, mbpp, arith"),
    "bench": ("fastdllm.bench", "main", "the Fast-dLLM tables on your machine: baseline vs cache vs parallel"),
    "train-tiny": ("fastdllm.train", "main", "train the embedded default model from a seed"),
}

EXAMPLES = """examples:
  fastdllm generate "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"
  fastdllm generate --show --threshold 0.7 "..."     # watch the canvas denoise
  fastdllm chat
  fastdllm serve --port 8000
  fastdllm eval --task arith --limit 200
  fastdllm bench --quick
"""


class UserError(Exception):
    """A mistake of the user's (bad flag, missing folder): printed as one line, exit code 2."""


def _optional_float(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else float(text)


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "off") else int(text)


def _optional_str(text: str) -> str | None:
    return None if text.lower() in ("none", "off") else text


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or Hugging Face repo id (default: the embedded model)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's; use 1 on a machine shared with other jobs)")


def add_generation_args(p: argparse.ArgumentParser, defaults: GenerationConfig | None = None) -> None:
    """One flag per GenerationConfig field, same names (dashes for underscores)."""
    d = defaults or GenerationConfig()
    g = p.add_argument_group("decoding (GenerationConfig)")
    g.add_argument("--gen-length", type=int, default=d.gen_length, help="tokens to generate (default %(default)s)")
    g.add_argument("--block-length", type=int, default=d.block_length, help="block size (default %(default)s)")
    g.add_argument("--steps", type=_optional_int, default=d.steps, help="schedule steps (default: gen_length)")
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--remasking", default=d.remasking, help="low_confidence | random")
    g.add_argument("--threshold", type=_optional_float, default=d.threshold,
                   help="parallel decoding confidence threshold; 'none' for the schedule (default %(default)s)")
    g.add_argument("--factor", type=_optional_float, default=d.factor, help="factor-rule parallel decoding")
    g.add_argument("--cache", default=d.cache, help="none | prefix | dual (default %(default)s)")
    g.add_argument("--alg", type=_optional_str, default=d.alg, help="Dream: origin | maskgit_plus | topk_margin | entropy")
    g.add_argument("--alg-temp", type=_optional_float, default=d.alg_temp)
    g.add_argument("--eps", type=float, default=d.eps)
    g.add_argument("--top-p", type=_optional_float, default=d.top_p)
    g.add_argument("--top-k", type=_optional_int, default=d.top_k)
    g.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false", help="always decode every block")
    g.add_argument("--seed", type=_optional_int, default=d.seed)


def config_from_args(args: argparse.Namespace) -> GenerationConfig:
    values = {name: getattr(args, name) for name in GenerationConfig.field_names() if hasattr(args, name)}
    try:
        return GenerationConfig(**values)
    except ValueError as e:
        raise UserError(f"--{str(e).split(':', 1)[0].replace('_', '-')}:{str(e).split(':', 1)[1]}") from None


def load_model_or_exit(args: argparse.Namespace):
    import torch

    from .loading import load

    if getattr(args, "threads", None):
        if args.threads < 1:
            raise UserError("--threads: must be a positive integer")
        torch.set_num_threads(args.threads)
    try:
        return load(args.model, dtype=args.dtype, device=args.device)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="fastdllm",
        description="Fast inference for diffusion language models (LLaDA, Dream).",
        epilog="commands:\n" + "\n".join(f"  {k:<11} {v[2]}" for k, v in COMMANDS.items()) + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=list(COMMANDS), metavar="command", help=argparse.SUPPRESS)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        print(f"fastdllm: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, func, _ = COMMANDS[argv[0]]
    try:
        return int(getattr(importlib.import_module(module_name), func)(argv[1:]) or 0)
    except UserError as e:
        print(f"fastdllm {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
