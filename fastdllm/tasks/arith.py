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

import functools
import random
from dataclasses import dataclass

MAX_VALUE = 50
TEST_SEED = 1_000_003
FEWSHOT_SEED = 2_000_003
TEST_SIZE = 1000
FEWSHOT_POOL_SIZE = 16

NAMES = [
    "Tom", "Ann", "Mia", "Sam", "Ben", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Nora",
    "Owen", "Ruby", "Liam", "Ella", "Noah", "Grace", "Ryan", "Chloe",
]
PRONOUN = {n: ("she" if n in {"Ann", "Mia", "Lily", "Emma", "Zoe", "Nora", "Ruby", "Ella", "Grace", "Chloe"} else "he")
           for n in NAMES}
ITEMS = [
    "apples", "pencils", "books", "stickers", "marbles", "cookies", "cards", "shells", "coins", "eggs",
    "toys", "stamps", "candies", "flowers", "balloons", "oranges", "cupcakes", "beads", "rocks", "plums",
]
PRICED = ["pen", "notebook", "toy car", "ball", "kite", "puzzle", "cup", "sandwich", "comic", "hat"]
ACTIVITIES = [("reads", "pages"), ("runs", "laps"), ("writes", "lines"), ("picks", "berries"),
              ("paints", "pictures"), ("folds", "cranes")]


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
            story.append(f"Then the number of {item} {word}." if k <= 3 else
                         f"Then {he} ends up with {k} times as many {item}.")
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
    question = (f"{name} shares {n} {item} equally among {g} friends. Then each friend gets {k} more {item}. "
                f"How many {item} do the friends have in all?")
    lines = [f"Each friend first gets {n} / {g} = {per} {item}.",
             f"Then each friend has {per} + {k} = {each} {item}.",
             f"In all the friends have {each} * {g} = {total} {item}."]
    return Problem(question, "\n".join(lines + [f"#### {total}"]), total)


TEMPLATES = [_running_total, _running_total, _shopping, _rate, _compare, _groups]


def make_problem(r: random.Random) -> Problem:
    while True:
        try:
            return r.choice(TEMPLATES)(r)
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


def train_stream(seed: int):
    """An endless stream of training problems, never one of the held-out questions."""
    held_out, r = held_out_questions(), random.Random(seed)
    while True:
        p = make_problem(r)
        if p.question not in held_out:
            yield p


@functools.cache
def arithmetic_facts() -> tuple[tuple[int, str, int, int], ...]:
    """Every (a, op, b, result) that a worked answer of this task can contain.

    Sums and differences take a second operand of 2..10, products a second factor of 2..5 (and
    shopping and rates write 2..5 * 2..10), quotients a divisor of 2..5; every value stays in
    0..MAX_VALUE.
    """
    facts = []
    for a in range(MAX_VALUE + 1):
        for b in range(2, 11):
            if a + b <= MAX_VALUE:
                facts.append((a, "+", b, a + b))
            if a - b >= 0:
                facts.append((a, "-", b, a - b))
        for b in range(2, 6):
            if a * b <= MAX_VALUE:
                facts.append((a, "*", b, a * b))
            if a % b == 0:
                facts.append((a, "/", b, a // b))
    for a in range(2, 6):  # 2..5 times 6..10 (shopping prices, daily rates) as written in answers
        for b in range(6, 11):
            facts.append((a, "*", b, a * b))
    return tuple(sorted(set(facts)))


@functools.cache
def _facts_by_op() -> dict[str, list[tuple[int, str, int, int]]]:
    by_op: dict[str, list[tuple[int, str, int, int]]] = {}
    for fact in arithmetic_facts():
        by_op.setdefault(fact[1], []).append(fact)
    return by_op


# Answer sentences of the five templates, per operation, as drills in "sentence" phrasing write them:
# {e} is "a op b", {c} the result; the other slots are filled at random.
ANSWER_PHRASES = {
    "+": ["After that {name} has {e} = {c} {item}.", "With the last day that is {e} = {c} {unit}.",
          "Then each friend has {e} = {c} {item}.", "With the {priced} {name} spends {e} = {c} dollars.",
          "{name} has {e} = {c} {item}."],
    "-": ["After giving some away {name} has {e} = {c} {item}.", "After losing some that is {e} = {c} {unit}.",
          "With the discount {name} pays {e} = {c} dollars.", "{name} has {e} = {c} {item}."],
    "*": ["Then {name} has {e} = {c} {item}.", "The {priced}s cost {e} = {c} dollars.",
          "In {a} days {name} {verb} {e} = {c} {unit}.", "In all the friends have {e} = {c} {item}."],
    "/": ["One pile has {e} = {c} {item}.", "One part is {e} = {c} {item}.",
          "Each friend first gets {e} = {c} {item}."],
}


def drill_problem(r: random.Random, n_lines: int = 8, weighting: str = "op", restate: bool = True,
                  phrasing: str = "equation") -> Problem:
    """A training-only drill: several unrelated facts, each result written exactly once.

    In a worked answer each result reappears (as the next line's operand and after `####`), so a
    model can learn to copy a result instead of computing it; here the only way to fill a masked
    result is to know the fact.

    weighting "op" draws an operation, then one of its facts: the 87 products and 67 quotients are
    then seen ~5x as often each as the 405 sums and 405 differences (v3 learned 90% of the former,
    13% of the latter). "fact" draws uniformly over all facts.

    restate=True lists the operations in the question ("Work out 45 - 10, 3 + 4 ..."). A model
    trained on such drills learns to compute a result from the question's copy of its operation
    and not from its own line: v4's first 1000 steps knew 70% of the facts when the question
    restated them and 3% when it did not, and worked answers never restate. restate=False asks
    "Work out these." so a result can only come from the operands on its own line.

    phrasing "equation" writes each line as "a op b = c". "sentence" wraps it in one of the
    answers' own sentences with a random name and item ("After that Mia has 16 + 9 = 25 toys."):
    v4 knew 93% of the sums as bare equations but got 80% of them right inside worked answers
    (every result masked, operands shown), so the recall has to hold in the answers' wording too.
    """
    if phrasing not in ("equation", "sentence"):
        raise ValueError(f"phrasing: must be 'equation' or 'sentence', got {phrasing!r}")
    if weighting == "op":
        by_op = _facts_by_op()
        ops = sorted(by_op)
        picked = [r.choice(by_op[r.choice(ops)]) for _ in range(n_lines)]
    elif weighting == "fact":
        facts = arithmetic_facts()
        picked = [r.choice(facts) for _ in range(n_lines)]
    else:
        raise ValueError(f"weighting: must be 'op' or 'fact', got {weighting!r}")
    lines = None
    if phrasing == "sentence":
        lines = []
        for a, op, b, c in picked:
            verb, unit = r.choice(ACTIVITIES)
            phrases = [f for f in ANSWER_PHRASES[op] if a >= 2 or "days" not in f]  # no "In 1 days"
            lines.append(r.choice(phrases).format(
                e=f"{a} {op} {b}", c=c, a=a, name=r.choice(NAMES), item=r.choice(ITEMS),
                priced=r.choice(PRICED), verb=verb, unit=unit))
    return drill_from_facts(picked, restate, lines)


def drill_from_facts(facts, restate: bool = True, lines: list[str] | None = None) -> Problem:
    """The drill whose answer writes these (a, op, b, result) facts, one per line, in this order
    (as `lines`, when given, phrase them; by default "a op b = c")."""
    if restate:
        question = "Work out " + ", ".join(f"{a} {op} {b}" for a, op, b, _ in facts[:-1])
        question += f" and {facts[-1][0]} {facts[-1][1]} {facts[-1][2]}."
    else:
        question = "Work out these."
    if lines is None:
        lines = [f"{a} {op} {b} = {c}" for a, op, b, c in facts]
    return Problem(question, "\n".join(lines), facts[-1][3])


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
