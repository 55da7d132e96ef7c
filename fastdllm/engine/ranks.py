"""Keeping the ranks of a tensor-parallel model in step: rank 0 decides, every rank runs the same
forwards.

Under `torchrun --nproc-per-node N -m fastdllm serve|chat --tp N`, each rank holds its part of the
model and every forward ends in all-reduces that all ranks must join, in the same order. Rank 0
runs the app and the scheduler (or reads the chat); before it does anything that leads to forwards
or changes the batch (a batch starts, rows join or leave, a step is decoded, the warm-up, a
scoring request, a chat turn), it sends that command to the other ranks (`Commands.run`, one
broadcast), under one lock, so that commands and their collectives reach every rank in one
order. The other ranks (`follow`) repeat each command on their own decoder: the same inputs and
the same all-reduced bits give the same decisions, so nothing else needs sending. A
grammar-constrained row's grammar is sent as its source (`GrammarConstraint.spec`) and built
again there; a prompt's pictures as rank 0 placed them (`placed_spec`: their columns and soft
tokens), or for `generate` as given (each rank's tower reads them alike).

A rank that is gone makes the next collective fail (`tp.RankLost`): rank 0 answers every request
in flight or queued with a 503 and stops; a following rank stops with one line. torchrun then ends
the others. An idle rank 0 sends a tick now and then, so that the others' wait for the next
command never reaches the process group's timeout.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from ..models.tp import RankLost, collective
from .constraints import GrammarConstraint
from .decoder import BlockDecoder
from .generation import generate
from .likelihood import prefix_logprobs

IDLE_TICK_SECONDS = 60.0  # well inside torch.distributed's default 30-minute timeout


class LocalCommands:
    """One process: a command is only run."""

    distributed = False
    idle_tick = None

    def __init__(self):
        self.lock = threading.RLock()

    def run(self, command: tuple, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`, which runs what `command` says to the other ranks."""
        with self.lock:
            return fn(*args, **kwargs)

    def tick(self) -> None:
        pass

    def stop(self) -> None:
        pass


class Commands(LocalCommands):
    """Rank 0's side: each command goes to the other ranks before rank 0 runs it."""

    distributed = True
    idle_tick = IDLE_TICK_SECONDS

    def run(self, command: tuple, fn, *args, **kwargs):
        with self.lock:
            _send(command)
            return fn(*args, **kwargs)

    def tick(self) -> None:
        self.run(("tick",), lambda: None)

    def stop(self) -> None:
        """The others leave their loop (rank 0 is shutting down)."""
        try:
            self.run(("stop",), lambda: None)
        except RankLost:
            pass  # they are gone already


def constraint_specs(constraints) -> list | None:
    return None if constraints is None else [None if c is None else c.spec() for c in constraints]


def placed_spec(placed) -> list | None:
    """Rows' placed pictures ((columns, soft tokens) or None each: `Transformer.place_images`) as
    a command carries them: on the CPU."""
    if placed is None:
        return None
    return [None if p is None else (p[0].cpu(), p[1].cpu()) for p in placed]


def _send(command: tuple) -> None:
    collective(dist.broadcast_object_list, [command], src=0)


def _receive() -> tuple:
    box = [None]
    try:
        collective(dist.broadcast_object_list, box, src=0)
    except RankLost as e:
        raise RankLost(f"rank 0 is gone ({e.__cause__})") from e
    return box[0]


def follow(model, tokenizer, policies=None, kv=None) -> None:
    """A rank other than 0: repeat rank 0's commands until it stops (returns) or is gone
    (RankLost), its decoders' K/V under `kv` (a `kv.KVRunner` of rank 0's budget). A command that
    fails here failed on rank 0 too (the same inputs): rank 0 answers for it, and this rank waits
    for the next one."""
    decoder: BlockDecoder | None = None
    stops = model.stop_token_ids
    while True:
        op, *args = _receive()
        try:
            if op == "stop":
                return
            if op == "new":
                (config,) = args
                decoder = BlockDecoder(model, config, policies=policies, kv=kv)
            elif op == "add":
                prompts, seeds, config, specs, placed = args
                constraints = None
                if specs is not None:
                    constraints = [s and GrammarConstraint.from_spec(s, tokenizer, stops) for s in specs]
                decoder.add(prompts, row_seeds=seeds, config=config, constraints=constraints, placed=placed)
            elif op == "step":
                decoder.step()
            elif op == "drop":
                (indices,) = args
                batch = decoder.batch
                decoder.drop([batch[i] for i in indices])
            elif op == "generate":
                prompts, config, images = args
                generate(model, prompts, config=config, images=images)
            elif op == "score":
                prompts, top, extra = args
                for p in prompts:
                    prefix_logprobs(model, p, top=top, extra=extra)
        except RankLost:
            raise
        except Exception:
            continue
