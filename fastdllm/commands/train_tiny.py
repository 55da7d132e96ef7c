"""`fastdllm train-tiny`: train the embedded model (`fastdllm.train`)."""

from __future__ import annotations

import argparse

from ..models import FAMILIES
from ..train import DATA_MIXES, PRESETS, train


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=sorted(FAMILIES), default="llada")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model size (default: the arch's)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, final/, train_log.jsonl")
    p.add_argument("--steps", type=int, default=3600)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--decay-frac", type=float, default=0.4)
    p.add_argument("--token-budget", type=int, default=8192, help="tokens per batch")
    p.add_argument("--data-mix", choices=sorted(DATA_MIXES), default="v1", help="batch shapes (see DATA_MIXES)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=64)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint if present")
    p.add_argument("--init-from", default=None, help="start from this model folder's weights and tokenizer")


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="fastdllm train-tiny", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.preset = args.preset or args.arch
    args.command_line = "fastdllm train-tiny " + " ".join(sys.argv[1:] if argv is None else argv)
    final = train(args)
    print(f"saved {final}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
