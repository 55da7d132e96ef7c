"""`arith`: GSM8K-like word problems that the embedded model is trained and evaluated on.

Each problem is a few sentences about people, items, prices and rates, solved in 2-4 arithmetic
steps (+ - * /). The worked answer states every intermediate result, one step per line, and ends
with `#### N` exactly like GSM8K's solutions, so the same answer extraction scores both.

The arithmetic facts are deliberately few: every value stays in 0..MAX_VALUE, additions and
subtractions use a second operand of at most 10, and products and quotients use factors 2..5. A
small model can learn these facts; what it must still learn is to read the story, copy the right
numbers and chain the steps (later results depend on earlier ones, which is what makes parallel
unmasking risky).

Splits are fixed by seed: the test split (TEST_SIZE problems) and the few-shot exemplar pool never
appear in training, which filters them out by question text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Doc, Task, apply_limit, score_final_number

MAX_VALUE = 50
TEST_SEED = 1_000_003
FEWSHOT_SEED = 2_000_003
TEST_SIZE = 1000
FEWSHOT_POOL_SIZE = 16

NAMES = [
    "Tom",
    "Ann",
    "Mia",
    "Sam",
    "Ben",
    "Lily",
    "Max",
    "Emma",
    "Leo",
    "Zoe",
    "Jack",
    "Nora",
    "Owen",
    "Ruby",
    "Liam",
    "Ella",
    "Noah",
    "Grace",
    "Ryan",
    "Chloe",
]
PRONOUN = {
    n: ("she" if n in {"Ann", "Mia", "Lily", "Emma", "Zoe", "Nora", "Ruby", "Ella", "Grace", "Chloe"} else "he")
    for n in NAMES
}
ITEMS = [
    "apples",
    "pencils",
    "books",
    "stickers",
    "marbles",
    "cookies",
    "cards",
    "shells",
    "coins",
    "eggs",
    "toys",
    "stamps",
    "candies",
    "flowers",
    "balloons",
    "oranges",
    "cupcakes",
    "beads",
    "rocks",
    "plums",
]
PRICED = ["pen", "notebook", "toy car", "ball", "kite", "puzzle", "cup", "sandwich", "comic", "hat"]
ACTIVITIES = [
    ("reads", "pages"),
    ("runs", "laps"),
    ("writes", "lines"),
    ("picks", "berries"),
    ("paints", "pictures"),
    ("folds", "cranes"),
]


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # worked solution ending in "#### N"
    value: int


class _Reject(Exception):
    pass


def _check(v: int) -> int:
    if not 0 <= v <= MAX_VALUE:
        raise _Reject
    return v


def _running_total(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    he = PRONOUN[name]
    value = r.randint(2, 20)
    story = [f"{name} has {value} {item}."]
    lines = []
    for _ in range(r.randint(2, 4)):
        kind = r.choice(["add", "sub", "mul", "div"])
        if kind == "add":
            k = r.randint(2, 10)
            verb = r.choice(["buys", "finds", "gets"])
            new = _check(value + k)
            story.append(f"{he.capitalize()} {verb} {k} more {item}.")
            lines.append(f"After that {name} has {value} + {k} = {new} {item}.")
        elif kind == "sub":
            k = r.randint(2, 10)
            other = r.choice([n for n in NAMES if n != name])
            new = _check(value - k)
            story.append(f"{he.capitalize()} gives {k} {item} to {other}.")
            lines.append(f"After giving some away {name} has {value} - {k} = {new} {item}.")
        elif kind == "mul":
            k = r.randint(2, 5)
            new = _check(value * k)
            word = {2: "doubles", 3: "triples"}.get(k, f"multiplies by {k}")
            story.append(
                f"Then the number of {item} {word}." if k <= 3 else f"Then {he} ends up with {k} times as many {item}."
            )
            lines.append(f"Then {name} has {value} * {k} = {new} {item}.")
        else:
            k = r.randint(2, 5)
            if value % k:
                raise _Reject
            new = value // k
            story.append(f"{he.capitalize()} splits the {item} into {k} equal piles and keeps one pile.")
            lines.append(f"One pile has {value} / {k} = {new} {item}.")
        value = new
    story.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(story), "\n".join(lines + [f"#### {value}"]), value)


def _shopping(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    a_item, b_item = r.sample(PRICED, 2)
    pa, na = r.randint(2, 10), r.randint(2, 5)
    ta = _check(na * pa)
    lines = [f"The {a_item}s cost {na} * {pa} = {ta} dollars."]
    question = f"A {a_item} costs {pa} dollars. {name} buys {na} {a_item}s"
    if r.random() < 0.5:
        pb = r.randint(2, 10)
        total = _check(ta + pb)
        question += f" and one {b_item} for {pb} dollars. How much does {name} spend?"
        lines.append(f"With the {b_item} {name} spends {ta} + {pb} = {total} dollars.")
    else:
        off = r.randint(2, 10)
        total = _check(ta - off)
        question += f" and gets {off} dollars off. How much does {name} pay?"
        lines.append(f"With the discount {name} pays {ta} - {off} = {total} dollars.")
    return Problem(question, "\n".join(lines + [f"#### {total}"]), total)


def _rate(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    he = PRONOUN[name]
    verb, unit = r.choice(ACTIVITIES)
    per, days = r.randint(2, 10), r.randint(2, 5)
    done = _check(per * days)
    lines = [f"In {days} days {name} {verb} {days} * {per} = {done} {unit}."]
    extra = r.randint(2, 10)
    if r.random() < 0.5:
        total = _check(done + extra)
        story = f"On the last day {he} {verb} {extra} more {unit}."
        lines.append(f"With the last day that is {done} + {extra} = {total} {unit}.")
    else:
        total = _check(done - extra)
        story = f"Then {he} loses {extra} of the {unit}."
        lines.append(f"After losing some that is {done} - {extra} = {total} {unit}.")
    question = f"{name} {verb} {per} {unit} every day for {days} days. {story} How many {unit} does {name} have?"
    return Problem(question, "\n".join(lines + [f"#### {total}"]), total)


def _compare(r: random.Random) -> Problem:
    a, b = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    x, d = r.randint(2, 30), r.randint(2, 10)
    more = r.random() < 0.5
    y = _check(x + d if more else x - d)
    rel, op = ("more", "+") if more else ("fewer", "-")
    k = r.randint(2, 5)
    if r.random() < 0.5:
        z = _check(y * k)
        last = f"Then {b} gets {k} times as many {item}."
        line = f"Then {b} has {y} * {k} = {z} {item}."
    else:
        if y % k:
            raise _Reject
        z = y // k
        last = f"Then {b} keeps only one of {k} equal parts of them."
        line = f"One part is {y} / {k} = {z} {item}."
    question = f"{a} has {x} {item}. {b} has {d} {rel} {item} than {a}. {last} How many {item} does {b} have now?"
    lines = [f"{b} has {x} {op} {d} = {y} {item}.", line]
    return Problem(question, "\n".join(lines + [f"#### {z}"]), z)


def _groups(r: random.Random) -> Problem:
    item = r.choice(ITEMS)
    g = r.randint(2, 5)
    per = r.randint(2, 10)
    n = _check(g * per)
    name = r.choice(NAMES)
    k = r.randint(2, 10)
    each = _check(per + k)
    total = _check(each * g)
    question = (
        f"{name} shares {n} {item} equally among {g} friends. Then each friend gets {k} more {item}. "
        f"How many {item} do the friends have in all?"
    )
    lines = [
        f"Each friend first gets {n} / {g} = {per} {item}.",
        f"Then each friend has {per} + {k} = {each} {item}.",
        f"In all the friends have {each} * {g} = {total} {item}.",
    ]
    return Problem(question, "\n".join(lines + [f"#### {total}"]), total)


TEMPLATES = [_running_total, _running_total, _shopping, _rate, _compare, _groups]


def make_problem(r: random.Random, templates=TEMPLATES) -> Problem:
    while True:
        try:
            return r.choice(templates)(r)
        except _Reject:
            continue


def _unique(seed: int, count: int, exclude: set[str] = frozenset()) -> list[Problem]:
    r, seen, out = random.Random(seed), set(exclude), []
    while len(out) < count:
        p = make_problem(r)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


_cache: dict[str, list[Problem]] = {}


def fewshot_pool() -> list[Problem]:
    if "fewshot" not in _cache:
        _cache["fewshot"] = _unique(FEWSHOT_SEED, FEWSHOT_POOL_SIZE)
    return _cache["fewshot"]


def test_split() -> list[Problem]:
    if "test" not in _cache:
        _cache["test"] = _unique(TEST_SEED, TEST_SIZE, {p.question for p in fewshot_pool()})
    return _cache["test"]


def held_out_questions() -> set[str]:
    return {p.question for p in test_split()} | {p.question for p in fewshot_pool()}


def train_stream(seed: int, templates=TEMPLATES):
    """An endless stream of training problems (of `templates`), never one of the held-out
    questions."""
    held_out, r = held_out_questions(), random.Random(seed)
    while True:
        p = make_problem(r, templates)
        if p.question not in held_out:
            yield p


def format_prompt(question: str, shots: list[Problem]) -> str:
    """The user message: k worked exemplars, then the question (GSM8K-style "Question/Answer")."""
    parts = [f"Question: {s.question}\nAnswer: {s.answer}" for s in shots]
    parts.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(parts)


def prompt_ids(tokenizer, question: str, shots: list[Problem], bare: bool = False) -> list[int]:
    """The chat-formatted prompt: the "Question: ...\nAnswer:" message (with k shots), or with
    `bare` the question alone, as a user types it into `fastdllm generate` or a chat. Training
    and evaluation both build their prompts here."""
    content = question if bare else format_prompt(question, shots)
    return tokenizer.encode_chat([{"role": "user", "content": content}])


def fewshot_exemplars(k: int) -> list[Problem]:
    if not 0 <= k <= FEWSHOT_POOL_SIZE:
        raise ValueError(f"num_fewshot: must be in 0..{FEWSHOT_POOL_SIZE}, got {k}")
    return fewshot_pool()[:k]


# ---- the task ---------------------------------------------------------------------------------
class ArithTask(Task):
    """1000 GSM8K-like test problems of the generator above, 0-shot by default (k-shot from
    `fewshot_exemplars`). Prompts are built exactly as in training: `format_prompt`, in the chat
    template (`prompt_ids`) or as plain text; scored like GSM8K."""

    name = "arith"
    default_num_fewshot = 0
    description = "the embedded model's GSM8K-like word problems (generated, 1000 test items)"

    @property
    def max_num_fewshot(self) -> int:
        return FEWSHOT_POOL_SIZE

    def load(self, data_dir=None, limit=None) -> list[Doc]:
        docs = [
            Doc(f"arith/{i}", i, {"question": p.question, "answer": p.answer}, str(p.value))
            for i, p in enumerate(test_split())
        ]
        return apply_limit(docs, limit)

    def fewshot(self, k: int, data_dir=None):
        return fewshot_exemplars(k)

    def prompt_text(self, doc, shots):
        return format_prompt(doc.data["question"], shots)

    def stop_strings(self, chat):
        return ["Question:"]

    def score_one(self, doc, completion):
        return score_final_number(doc, completion)
