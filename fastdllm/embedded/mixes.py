"""The training data mixes of the embedded models, one record each (`Mix`): what a batch of the mix
looks like. `fastdllm.embedded.train.make_batch` draws batches from them; the stages that used them
are `fastdllm.embedded.recipe.RECIPES`; why each mix changed from the one before, and what it
measured, is in docs/training-notes.md."""

from __future__ import annotations

from dataclasses import dataclass

from .train_data import SOURCES


@dataclass(frozen=True)
class Drills:
    """Arithmetic drills (`drills.drill_problem`) among a mix's batches: the share of batches that
    are drills, how their facts are drawn ("op": by operation, "fact": uniformly over the task's
    facts), whether a drill restates the operation in its question, and the share of drills whose
    answer writes the fact in an answer's own sentence."""

    share: float
    weighting: str
    restate: bool
    sentence: float = 0.0


@dataclass(frozen=True)
class Mix:
    """One mix. A batch is either drawn row by row from `sources` (`train_data.talk_row`, each row a
    source and a prompt format by their shares; `formats` None: `train_data.FORMATS`), or it is
    one arith batch: k-shot with probability `shots` (k from `min_shots` to 8), else 0-shot; the
    region length from `regions` ((cumulative probability, lengths to choose among), ...); with
    `drills`, that share of batches drills instead."""

    shots: float
    regions: tuple[tuple[float, tuple[int, ...]], ...]
    min_shots: int = 1
    drills: Drills | None = None
    sources: dict | None = None
    formats: dict | None = None


# Region shapes shared by several mixes.
FOCUS = ((0.72, (64,)), (0.86, (96, 128)), (0.96, (256,)), (1.0, (512, 1024)))
STORY = ((0.5, (64,)), (0.62, (96, 128)), (0.76, (256,)), (1.0, (512, 1024)))
LONG = ((0.35, (64,)), (0.45, (96, 128)), (0.65, (256,)), (1.0, (512, 1024)))
TALK = ((0.45, (64,)), (0.65, (96, 128)), (0.85, (256,)), (1.0, (512, 1024)))
# short regions mostly: an answer token's weight is over its region's length, and a new skill's
# answers are ~50 tokens
SHORT = ((0.55, (64,)), (0.7, (96, 128)), (0.85, (256,)), (1.0, (512, 1024)))
STORY_DRILLS = Drills(0.5, "fact", False, 0.5)

MIXES: dict[str, Mix] = {
    # long regions (mostly EOS padding) and few-shot prompts in a fifth of the batches
    "v1": Mix(0.2, ((0.6, (64, 96, 128)), (0.9, (256,)), (1.0, (512, 1024)))),
    # more of each batch on answer tokens, still some long regions to learn the EOS fill
    "dense": Mix(0.1, ((0.75, (32, 48, 64)), (0.95, (256,)), (1.0, (512, 1024)))),
    # mostly 0-shot with a region just long enough for the answer (answers are 20-57 tokens), so
    # nearly every masked token is answer content; a quarter still teaches the EOS fill of
    # 96-1024-token regions and 8-shot prompts
    "focus": Mix(0.08, FOCUS),
    # with drills: a model that only copies results between the lines of a worked answer has to
    # compute them from a drill
    "drill": Mix(0.08, FOCUS, drills=Drills(0.25, "op", True)),
    # drills drawn uniformly over the task's facts, and 12% of word problems few-shot
    "facts": Mix(0.12, FOCUS, drills=Drills(0.5, "fact", True)),
    # as facts; its drills do not restate the operations in the question (no worked answer does)
    "recall": Mix(0.12, FOCUS, drills=Drills(0.5, "fact", False)),
    # half the drills write each fact in an answer's own sentence; a quarter of the word problems
    # in 512/1024-token regions, where answers must hold up behind ~1000 masked positions
    "story": Mix(0.12, STORY, drills=STORY_DRILLS),
    # story with more word problems in long regions (256: 20%, 512/1024: 35%)
    "long": Mix(0.12, LONG, drills=STORY_DRILLS),
    # long with 40% of word problems few-shot, 4-8 exemplars: long regions behind 8-shot prompts
    "shots": Mix(0.4, LONG, min_shots=4, drills=STORY_DRILLS),
    # shots with 55% of word problems in 512/1024-token regions and 35% of batches drills
    "tail": Mix(
        0.4,
        ((0.2, (64,)), (0.3, (96, 128)), (0.45, (256,)), (1.0, (512, 1024))),
        min_shots=4,
        drills=Drills(0.35, "fact", False, 0.5),
    ),
    # every prompt format and source of `train_data`, drawn per row
    "talk": Mix(0.0, TALK, sources=SOURCES),
    # the same shapes; the arith stories a larger share, so that the old task is kept while the new
    # one is learnt
    "talk-arith": Mix(0.0, TALK, sources={"everyday": 0.35, "arith": 0.35, "gsm8k": 0.05, "drill": 0.15, "text": 0.1}),
    # the arith model's own prompts, with tool calls and JSON answers among them; chat only
    "tools": Mix(0.0, SHORT, sources={"arith": 0.45, "drill": 0.15, "tools": 0.4}, formats={"chat": 1.0}),
    # the arith model's own questions behind the plain wrappers users send, half the rows still as
    # it was trained (chat)
    "plain": Mix(
        0.0,
        SHORT,
        sources={"arith": 0.85, "drill": 0.15},
        formats={"chat": 0.5, "plain": 0.35, "plain-bare": 0.15},
    ),
    # each arith question twice in one batch, as a chat turn and behind the same text without the
    # template (`train_data.paired_rows`): the wrapper is the only difference the loss sees
    "paired": Mix(0.0, SHORT, sources={"paired": 0.8, "drill": 0.2}),
    # paired rows, with chat-only arith rows besides (62% of rows chat): chat slid under the pairs alone
    "paired-chat": Mix(0.0, SHORT, sources={"paired": 0.6, "arith": 0.25, "drill": 0.15}, formats={"chat": 1.0}),
    # paired-chat, with each plain answer closed by `<|eot_id|>` as a chat answer is, rather than by
    # EOS, the padding token: plain answers ran one step too long where nothing marked their end
    "paired-eot-chat": Mix(
        0.0, SHORT, sources={"paired-eot": 0.6, "arith": 0.25, "drill": 0.15}, formats={"chat": 1.0}
    ),
    # paired-chat, with 40% of its pairs drawn from the one template (`_groups`, three steps)
    # whose plain answers ran a step long
    "paired-groups-chat": Mix(
        0.0,
        SHORT,
        sources={"paired": 0.35, "paired-groups": 0.25, "arith": 0.25, "drill": 0.15},
        formats={"chat": 1.0},
    ),
}
