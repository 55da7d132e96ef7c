"""Training rows of the `talk` mix: everyday questions, the `arith` stories, easy GSM8K problems,
arithmetic drills and general text, in every prompt format a user sends.

Prompt formats (what the model card documents):
- chat: the question as the user message of the chat template; the answer, then `<|eot_id|>`.
  A share of rows are two-turn conversations (an earlier question and its answer before).
- plain: no template, as `/v1/completions`, `generate_text` and lm-eval's default path send it:
  "Question: ...\\nAnswer:" (in the `plain` mix also behind 1-8 solved examples, lm-eval gsm8k's
  few-shot layout) or the bare question; the answer follows after a space and ends with the
  end-of-text token.
- tools (`fastdllm.embedded.tool_data`): a story with tools in the chat template's system turn, answered
  by a tool call, a call's arguments or a JSON object.
- text: general prose (Python's standard-library docstrings, PSF licence, `fastdllm/evaluation/data/`) as a
  plain prefix and its continuation, so that the model meets text it cannot predict with
  certainty and its confidence there looks like a real dLLM's.

Every row is (prompt ids, answer ids); `fastdllm.embedded.train.make_batch` lays rows into a batch.
Nothing here draws from a test split: `everyday` and `arith` stream their training problems,
GSM8K's rows are from its train split, and the docstrings of HELD_OUT_MODULES are left out.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import re

from ..evaluation.tasks import arith, everyday
from ..evaluation.tasks.base import DATA_DIR
from . import drills, tool_data

# Sources of a row and their shares (the `talk` mix's; each mix's are `embedded.mixes.MIXES`).
SOURCES = {"everyday": 0.45, "arith": 0.18, "gsm8k": 0.1, "drill": 0.12, "text": 0.15}
# Within a question row: the prompt format's shares.
FORMATS = {"chat": 0.5, "chat2": 0.12, "plain": 0.26, "plain-bare": 0.12}
# Docstrings of these modules are never trained on (the general-text measurements read them).
HELD_OUT_MODULES = frozenset(
    {"statistics", "difflib", "textwrap", "calendar", "heapq", "zipfile", "wave", "trace", "smtplib", "fractions"}
)


@functools.cache
def gsm8k_easy() -> tuple[arith.Problem, ...]:
    """GSM8K train rows with at most three steps and whole numbers up to 100; the calculator
    annotations (<<48/2=24>>) are dropped from the answers."""
    with gzip.open(DATA_DIR / "gsm8k_train_easy.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for row in rows:
        answer = re.sub(r"<<[^>]*>>", "", row["answer"])
        value = int(answer.rsplit("####", 1)[1].strip().replace(",", ""))
        out.append(arith.Problem(row["question"], answer, value))
    return tuple(out)


@functools.cache
def docstrings(held_out: bool = False) -> tuple[str, ...]:
    with gzip.open(DATA_DIR / "docstrings.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    held = {row["text"] for row in rows if row["module"] in HELD_OUT_MODULES}
    if held_out:
        return tuple(dict.fromkeys(row["text"] for row in rows if row["text"] in held))
    # a paragraph that two modules share (io's classes, re-exported) stays held out
    return tuple(dict.fromkeys(row["text"] for row in rows if row["text"] not in held))


def _draw(r: random.Random, shares: dict[str, float]) -> str:
    u, acc = r.random(), 0.0
    for name, share in shares.items():
        acc += share
        if u < acc:
            return name
    return name


def text_split(r: random.Random, tokenizer, text: str, room: int) -> tuple[list[int], list[int]]:
    """A paragraph as a plain prefix (its first 20-50% of words) and a continuation of at most
    `room` tokens that ends at a word boundary."""
    words = text.split()
    cut = max(1, int(len(words) * r.uniform(0.2, 0.5)))
    prompt = tokenizer.encode(" ".join(words[:cut]), add_special_tokens=False)
    rest, ids = words[cut:], []
    for word in rest:
        more = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(ids) + len(more) > room:
            break
        ids += more
    return prompt, ids


def talk_row(
    r: random.Random,
    tokenizer,
    region: int,
    streams: dict,
    sources: dict[str, float] | None = None,
    formats: dict[str, float] | None = None,
) -> tuple[list[int], list[int]] | list[tuple[list[int], list[int]]]:
    """One row: (prompt ids, answer ids including its end token), or a list of rows that belong
    in one batch (`paired_rows`); `sources` and `formats`: the shares of its sources and prompt
    formats (default `SOURCES`, `FORMATS`)."""
    eot, eos = tokenizer.token_to_id("<|eot_id|>"), tokenizer.eos_token_id
    source = _draw(r, sources or SOURCES)
    if source in ("paired", "paired-eot"):
        return paired_rows(r, tokenizer, streams, plain_eot=source == "paired-eot")
    if source == "paired-groups":
        if "arith-groups" not in streams:  # drawn only by the mixes that use it
            streams["arith-groups"] = arith.train_stream(r.randrange(1 << 30), GROUPS_TEMPLATES)
        return paired_rows(r, tokenizer, streams, stream="arith-groups")
    if source == "tools":
        return tool_data.tool_row(r, tokenizer)
    if source == "text":
        prompt, ids = text_split(r, tokenizer, r.choice(docstrings()), region - 1)
        return prompt, ids + [eos]
    if source == "drill":
        p = drills.drill_problem(r, weighting="fact", restate=False, phrasing=r.choice(["equation", "sentence"]))
        return arith.prompt_ids(tokenizer, p.question, [], bare=True), tokenizer.encode(
            p.answer, add_special_tokens=False
        ) + [eot]
    if source == "gsm8k":
        p = r.choice(gsm8k_easy())
    else:
        p = next(streams[source])
    form = _draw(r, formats or FORMATS)
    if form.startswith("plain"):
        text = p.question if form == "plain-bare" else f"Question: {p.question}\nAnswer:"
        if form == "plain" and source == "arith" and r.random() < 0.3:  # lm-eval gsm8k's few-shot layout
            text = arith.format_prompt(p.question, [next(streams["arith"]) for _ in range(r.randint(1, 8))])
        return tokenizer.encode(text, add_special_tokens=False), tokenizer.encode(
            " " + p.answer, add_special_tokens=False
        ) + [eos]
    messages = []
    if form == "chat2":
        earlier = next(streams["everyday"])
        messages += [{"role": "user", "content": earlier.question}, {"role": "assistant", "content": earlier.answer}]
    content = p.question
    if source == "arith" and r.random() < 0.5:  # the evaluation's "Question: ...\nAnswer:", 0- to 8-shot
        k = r.randint(1, 8) if r.random() < 0.2 else 0
        content = arith.format_prompt(p.question, [next(streams["arith"]) for _ in range(k)])
    messages.append({"role": "user", "content": content})
    return tokenizer.encode_chat(messages), tokenizer.encode(p.answer, add_special_tokens=False) + [eot]


# A paired question's text (the same in both rows): the bare question, "Question: ...\nAnswer:", or
# lm-eval gsm8k's few-shot layout behind 1-8 solved examples.
PAIRED_TEXTS = {"bare": 0.3, "question": 0.5, "fewshot": 0.2}
# the template whose three-step answers plain prompts got wrong most (docs/training-notes.md, "Where
# the plain gap lives")
GROUPS_TEMPLATES = (arith._groups,)


def paired_rows(
    r: random.Random, tokenizer, streams: dict, plain_eot: bool = False, stream: str = "arith"
) -> list[tuple[list[int], list[int]]]:
    """One arith problem (from `streams[stream]`) as two rows: its text as the chat template's user
    turn (answer, then `<|eot_id|>`), and the same text as a plain prompt, encoded as plain prompts
    are (with the tokenizer's own BOS where it adds one), answered by a space, the answer, then
    end-of-text, the padding token itself (with `plain_eot`, `<|eot_id|>`, as a chat answer ends)."""
    eot, eos = tokenizer.token_to_id("<|eot_id|>"), tokenizer.eos_token_id
    p = next(streams[stream])
    kind = _draw(r, PAIRED_TEXTS)
    if kind == "bare":
        text = p.question
    else:
        shots = [next(streams["arith"]) for _ in range(r.randint(1, 8))] if kind == "fewshot" else []
        text = arith.format_prompt(p.question, shots)
    chat = tokenizer.encode_chat([{"role": "user", "content": text}])
    plain = tokenizer.encode(text)
    return [
        (chat, tokenizer.encode(p.answer, add_special_tokens=False) + [eot]),
        (plain, tokenizer.encode(" " + p.answer, add_special_tokens=False) + [eot if plain_eot else eos]),
    ]


def talk_streams(r: random.Random) -> dict:
    return {"everyday": everyday.train_stream(r.randrange(1 << 30)), "arith": arith.train_stream(r.randrange(1 << 30))}
