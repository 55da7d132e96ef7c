"""`fastdllm <command>`: the command-line entry point (also `python -m fastdllm <command>`).

Each command lives in its own module of `fastdllm.cli` with a `main(argv)`; this file only
dispatches (importing the command's module when it runs), and no module imports it. What the
commands share (argument parser, model and decoding flags) is in `cli/args.py`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .args import UserError

COMMANDS = {
    "generate": ("fastdllm.cli.generate", "main", "generate text for one prompt"),
    "chat": ("fastdllm.cli.chat", "main", "multi-turn chat with the model's chat template"),
    "serve": ("fastdllm.cli.serve", "main", "OpenAI-compatible HTTP server"),
    "eval": ("fastdllm.cli.eval", "main", "accuracy and tokens/s on gsm8k, math500, humaneval, mbpp, arith"),
    "bench": ("fastdllm.cli.bench", "main", "the Fast-dLLM tables on your machine: baseline vs cache vs parallel"),
    "quantize": ("fastdllm.cli.quantize", "main", "write a weight-only int8 / int4 checkpoint"),
    "train-tiny": ("fastdllm.cli.train_tiny", "main", "train the embedded default model from a seed"),
    "tune": ("fastdllm.cli.tune", "main", "the fastest decoding within an accuracy budget, as a preset"),
    "plan": ("fastdllm.cli.plan", "main", "weights and KV cache per rank under --tp / --ep, from config.json"),
    "demo": ("fastdllm.cli.demo", "main", "two chat panes side by side, each canvas denoising live (Gradio)"),
}

EXAMPLES = """examples:
  fastdllm generate "A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?"
  fastdllm generate --show --threshold 0.7 "..."     # watch the canvas denoise
  fastdllm chat
  fastdllm serve --port 8000
  fastdllm demo                                    # http://127.0.0.1:7860
  fastdllm eval --task arith --limit 200
  fastdllm bench --quick
  fastdllm tune --task arith --budget 1 --out arith.json
  fastdllm quantize llada-arith llada-arith-w4 --bits 4
  fastdllm plan --model GSAI-ML/LLaDA-8B-Instruct --tp 2 --memory 24
  torchrun --nproc-per-node 2 -m fastdllm generate --tp 2 "..."
"""


def main(argv: list[str] | None = None) -> int:
    status = _run(argv)
    tp = sys.modules.get("fastdllm.models.tp")
    if tp is not None and tp.started():  # a tensor-parallel rank: tear down together, then exit
        tp.exit_after_teardown(status)
    return status


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="fastdllm",
        description="Fast inference for diffusion language models (LLaDA, Dream, SDAR, LLaDA2, ...).",
        epilog="commands:\n" + "\n".join(f"  {k:<11} {v[2]}" for k, v in COMMANDS.items()) + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=list(COMMANDS), metavar="command", help=argparse.SUPPRESS)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"fastdllm {__version__}")
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
    except BrokenPipeError:  # `fastdllm generate ... | head`: the reader left; no traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
