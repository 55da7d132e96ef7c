"""`fastdllm train-tiny`: train the embedded model (`fastdllm.embedded.train`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..embedded.mixes import MIXES
from ..embedded.recipe import PRESETS, TOKENIZER_CORPORA
from ..embedded.train import TRAINABLE, TrainSettings, train
from ..models import FAMILIES
from .args import UserError

CHOICES = {
    "arch": sorted(FAMILIES),
    "preset": sorted(PRESETS),
    "data_mix": sorted(MIXES),
    "trainable": list(TRAINABLE),
    "tokenizer_corpus": list(TOKENIZER_CORPORA),
}
HELP = {
    "out": "run folder: checkpoint/, final/, train_log.jsonl",
    "preset": "model size (default: the arch's)",
    "token_budget": "tokens per batch",
    "data_mix": "the training data (fastdllm.embedded.mixes.MIXES)",
    "resume": "continue from OUT/checkpoint if present",
    "init_from": "start from this model folder's weights and tokenizer",
    "trainable": "experts: only a mixture's routed experts and routers learn",
    "tokenizer_corpus": "what a fresh run's BPE is trained on",
    "vocab_size": "a fresh run's BPE vocabulary",
    "eval_plain": "also evaluate plain prompts (no chat template) at each evaluation",
    "eval_block_length": "the block length held-out answers are decoded in (families without blocks of their own)",
    "keep_best": "save OUT/best at the evaluation whose lowest accuracy (chat, plain) is highest",
    "average_of": "comma-separated model folders: write the mean of their weights to OUT/final (a uniform "
    "model soup of runs fine-tuned from one start) instead of training",
    "editing_noise": "share of unmasked answer tokens replaced by random ones, which the model learns to "
    "restore (LLaDA2.1's token-to-token objective, for editing); 0: none",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A flag for each TrainSettings field, with its default."""
    for f in dataclasses.fields(TrainSettings):
        if f.name == "command_line":
            continue
        name = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(name, action="store_true", help=HELP.get(f.name))
            continue
        kind = {"int": int, "float": float}.get(f.type, str)
        required = f.default is dataclasses.MISSING
        p.add_argument(
            name,
            type=kind,
            required=required,
            default=None if required else f.default,
            choices=CHOICES.get(f.name),
            help=HELP.get(f.name),
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fastdllm train-tiny", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = vars(p.parse_args(argv))
    command_line = "fastdllm train-tiny " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        final = train(TrainSettings(**args, command_line=command_line))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    print(f"saved {final}")
    return 0
