"""`everyday`: one- to four-step arithmetic questions in everyday words, held out by construction.

`arith` has five story templates; a model trained on them learns those templates, not arithmetic
in language. This generator writes each operation in many ways (plus, sum, total, more, fewer,
left, each, per, times as many, half, a quarter, share equally, change from a bill, rates, ages,
distances, bare "What is 17 plus 25?"), with varied names, items, containers and units, numbers
in digits or in words, and distractor sentences that carry numbers the answer must ignore. Answers
explain each step in a sentence of their own and end with `#### N`, as GSM8K's and `arith`'s do.

Held out by construction: every phrasing slot has alternatives used only by the test split, and
the test split draws its names, items, containers and vehicles from sets that training never sees.
So a test question differs from every training question in its wording and its entities, not
only in its numbers. The test split (TEST_SIZE problems) is fixed by seed.

Arithmetic facts: sums up to 99 with a second operand up to 30, differences of such, products of
2..12 by 2..10 up to 99, and the quotients that invert them. Every value stays in 0..99.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .arith import Problem
from .base import Doc, Task, apply_limit, score_final_number

TEST_SEED = 3_000_017
TEST_SIZE = 500
MAX_VALUE = 99

# Entity sets: (train, test). The test sets are disjoint from the training ones.
NAMES = (
    [
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
        "Eva",
        "Luke",
        "Amy",
        "Dan",
        "Kate",
        "Paul",
        "Rosa",
        "Adam",
        "Lucy",
        "Carl",
        "Jane",
        "Ivan",
        "Sara",
        "Nick",
        "Beth",
        "Alex",
    ],
    ["Omar", "Priya", "Hugo", "Ivy", "Kai", "Maya", "Felix", "Hana", "Theo", "Lena", "Jonas", "Rita"],
)
FEMALE = {
    "Ann",
    "Mia",
    "Lily",
    "Emma",
    "Zoe",
    "Nora",
    "Ruby",
    "Ella",
    "Grace",
    "Chloe",
    "Eva",
    "Amy",
    "Kate",
    "Rosa",
    "Lucy",
    "Jane",
    "Sara",
    "Beth",
    "Priya",
    "Ivy",
    "Maya",
    "Hana",
    "Lena",
    "Rita",
}
ITEMS = (
    [
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
        "bananas",
        "pens",
        "crackers",
        "grapes",
        "muffins",
        "socks",
        "shirts",
        "carrots",
        "lemons",
        "candles",
    ],
    ["pears", "crayons", "buttons", "tickets", "cherries", "peaches", "markers", "ribbons"],
)
CONTAINERS = (["box", "bag", "basket", "jar", "pack", "bowl", "tray"], ["crate", "tin", "bucket"])
PRICED = (
    [
        "pen",
        "notebook",
        "toy car",
        "ball",
        "kite",
        "puzzle",
        "cup",
        "sandwich",
        "comic",
        "hat",
        "lamp",
        "scarf",
        "game",
        "plant",
    ],
    ["wallet", "bottle", "mug", "poster"],
)
VEHICLES = (["car", "bus", "train", "bike", "truck"], ["boat", "tram", "scooter"])
UNITS = (["miles", "kilometers"], ["miles", "kilometers"])
JOBS = (["earns", "makes", "is paid"], ["gets"])
WORDS = {
    1: "one",
    2: "two",
    3: "three",
    4: "four",
    5: "five",
    6: "six",
    7: "seven",
    8: "eight",
    9: "nine",
    10: "ten",
    11: "eleven",
    12: "twelve",
    13: "thirteen",
    14: "fourteen",
    15: "fifteen",
    16: "sixteen",
    17: "seventeen",
    18: "eighteen",
    19: "nineteen",
    20: "twenty",
    30: "thirty",
    40: "forty",
    50: "fifty",
}
P_WORD_NUMBER = 0.2
P_DISTRACTOR = 0.3


class _Reject(Exception):
    pass


def _ok(v: int) -> int:
    if not 0 <= v <= MAX_VALUE:
        raise _Reject
    return v


@dataclass
class _Writer:
    """Draws phrasings and entities for one split: `test` picks from the held-out alternatives."""

    r: random.Random
    test: bool

    def pick(self, options: tuple[list, list]):
        return self.r.choice(options[1] if self.test else options[0])

    def say(self, train: list[str], test: list[str], **slots) -> str:
        return self.r.choice(test if self.test else train).format(**slots)

    def num(self, n: int) -> str:
        return WORDS[n] if n in WORDS and self.r.random() < P_WORD_NUMBER else str(n)

    def names(self, k: int) -> list[str]:
        return self.r.sample(NAMES[1] if self.test else NAMES[0], k)


def _he(name: str) -> str:
    return "she" if name in FEMALE else "he"


def _his(name: str) -> str:
    return "her" if name in FEMALE else "his"


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("x", "s", "sh", "ch")) else "s")


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# ---- one-step questions ------------------------------------------------------------------------
def _bare(w: _Writer):
    """A bare calculation, as a user types it: "What is 9 times 7?"."""
    r = w.r
    op = r.choice("+-*/")
    if op == "+":
        a, b = r.randint(1, 69), r.randint(1, 30)
        c = _ok(a + b)
        q = w.say(
            [
                "What is {a} plus {b}?",
                "What is the sum of {a} and {b}?",
                "Add {a} and {b}.",
                "How much is {a} + {b}?",
                "What is {a} + {b}?",
                "{a} plus {b} is how much?",
            ],
            ["Calculate {a} plus {b}.", "What do you get if you add {b} to {a}?", "Work out {a} + {b}."],
            a=a,
            b=b,
        )
    elif op == "-":
        b, c = r.randint(1, 30), r.randint(0, 69)
        a = _ok(b + c)
        q = w.say(
            [
                "What is {a} minus {b}?",
                "What is {a} - {b}?",
                "Subtract {b} from {a}.",
                "How much is {a} take away {b}?",
                "What is the difference between {a} and {b}?",
            ],
            ["Calculate {a} minus {b}.", "What is left if you take {b} from {a}?", "Work out {a} - {b}."],
            a=a,
            b=b,
        )
    elif op == "*":
        a, b = r.randint(2, 12), r.randint(2, 10)
        c = _ok(a * b)
        q = w.say(
            [
                "What is {a} times {b}?",
                "What is {a} * {b}?",
                "Multiply {a} by {b}.",
                "What is the product of {a} and {b}?",
                "How much is {a} times {b}?",
            ],
            ["Calculate {a} times {b}.", "What do you get if you multiply {a} by {b}?", "Work out {a} x {b}."],
            a=a,
            b=b,
        )
    else:
        b, c = r.randint(2, 10), r.randint(2, 12)
        a = _ok(b * c)
        q = w.say(
            [
                "What is {a} divided by {b}?",
                "What is {a} / {b}?",
                "Divide {a} by {b}.",
                "How much is {a} split into {b} equal parts?",
            ],
            ["Calculate {a} divided by {b}.", "How many times does {b} go into {a}?", "Work out {a} / {b}."],
            a=a,
            b=b,
        )
    sym = {"*": "*", "/": "/", "+": "+", "-": "-"}[op]
    return q, [f"{a} {sym} {b} = {c}."], c


@dataclass(frozen=True)
class OneStep:
    """One kind of one-step story, as data: its numbers, its phrasings, its worked line.

    `draw(r)` gives the numbers (the answer as `c`) and any fixed words; `picks` are entity slots
    drawn next, in order; `spoken` are the number slots that the question writes in digits or in
    words (the worked line always in digits). `question` and `ask` are (train, test) phrasings; the
    question is the story, then the ask when there is one. A `draw` that returns a `form` hands the
    phrasing to that entry of ONE_STEP (one story, two directions)."""

    question: tuple[list[str], list[str]] = ([], [])
    work: str = ""
    draw: Callable[[random.Random], dict] | None = None
    ask: tuple[list[str], list[str]] | None = None
    picks: tuple[tuple[str, tuple[list, list]], ...] = ()
    spoken: tuple[str, ...] = ()


def _more(r):
    a, b = r.randint(1, 60), r.randint(1, 30)
    return {"a": a, "b": b, "c": _ok(a + b)}


def _less(r):
    b, c = r.randint(1, 30), r.randint(0, 60)
    return {"a": _ok(b + c), "b": b, "c": c}


def _fewer(r):
    c, b = r.randint(1, 30), r.randint(0, 60)
    return {"a": _ok(b + c), "b": b, "c": c}


def _product(r, x: str, y: str, hi: int):
    a, k = r.randint(2, 12), r.randint(2, hi)
    return {x: a, y: k, "c": _ok(a * k)}


def _share(r):
    b, c = r.randint(2, 10), r.randint(1, 12)
    return {"a": _ok(b * c), "b": b, "c": c}


def _part(r):
    k = r.choice([2, 2, 4, 3])
    frac = {2: "half", 3: "a third", 4: "a quarter"}[k]
    c = r.randint(1, 24)
    return {"a": _ok(k * c), "k": k, "c": c, "frac": frac, "frac_cap": _cap(frac)}


def _change(r):
    bill = r.choice([10, 20, 50])
    price = r.randint(1, bill - 1)
    return {"bill": bill, "p": price, "c": bill - price}


def _age(r):
    a, d = r.randint(2, 60), r.randint(1, 30)
    if r.random() < 0.5:
        return {"a": a, "d": d, "c": _ok(a + d), "form": "older"}
    return {"a": a, "d": d, "c": _ok(a - d), "form": "younger"}


_HOW_MANY_NOW = (
    ["How many {item} does {A} have now?", "How many {item} are there now?", "How many {item} does {he} have?"],
    ["What is the number of {item} now?", "How many {item} is that in the end?"],
)

ONE_STEP: dict[str, OneStep] = {
    "more": OneStep(
        draw=_more,
        question=(
            [
                "{A} has {a} {item}. {He} buys {b} more.",
                "{A} had {a} {item} and found {b} more.",
                "{A} has {a} {item}. {B} gives {him} {b} more {item}.",
                "There are {a} {item} on the table. {A} puts {b} more on it.",
            ],
            [
                "{A} starts with {a} {item}, then collects another {b}.",
                "{A} owns {a} {item} and receives {b} extra {item} as a gift.",
            ],
        ),
        ask=_HOW_MANY_NOW,
        spoken=("a", "b"),
        work="{a} + {b} = {c} {item}.",
    ),
    "together": OneStep(
        draw=_more,
        question=(
            ["{A} has {a} {item} and {B} has {b} {item}.", "{A} picked {a} {item}. {B} picked {b}."],
            ["{A} brought {a} {item} while {B} brought {b} {item}."],
        ),
        ask=(
            [
                "How many {item} do they have altogether?",
                "How many {item} do they have in total?",
                "What is the total number of {item}?",
                "How many {item} are there in all?",
            ],
            ["How many {item} do the two of them have combined?", "Together, how many {item} is that?"],
        ),
        spoken=("a", "b"),
        work="Together they have {a} + {b} = {c} {item}.",
    ),
    "left": OneStep(
        draw=_less,
        question=(
            [
                "{A} has {a} {item}. {He} gives {b} of them to {B}.",
                "{A} had {a} {item} and ate {b}.",
                "{A} has {a} {item}. {He} sells {b} {item}.",
                "There were {a} {item}. {A} used {b} of them.",
            ],
            [
                "{A} began with {a} {item} but lost {b} on the way home.",
                "Out of {a} {item}, {A} hands {b} over to {B}.",
            ],
        ),
        ask=(
            ["How many {item} are left?", "How many {item} does {A} have left?", "How many {item} does {he} have now?"],
            ["How many {item} remain?", "What number of {item} is still there?"],
        ),
        spoken=("a", "b"),
        work="{a} - {b} = {c} {item} are left.",
    ),
    "fewer": OneStep(
        draw=_fewer,
        question=(
            ["{A} has {a} {item}. {B} has {b} {item}.", "{A} counted {a} {item} and {B} counted {b}."],
            ["{B} collected {b} {item}; {A} collected {a}."],
        ),
        ask=(
            ["How many more {item} does {A} have than {B}?", "How many fewer {item} does {B} have than {A}?"],
            ["By how many {item} is {A} ahead of {B}?", "What is the difference between their {item}?"],
        ),
        spoken=("a", "b"),
        work="The difference is {a} - {b} = {c} {item}.",
    ),
    "each": OneStep(
        draw=lambda r: _product(r, "a", "b", 10),
        picks=(("box", CONTAINERS),),
        question=(
            [
                "A {box} holds {a} {item}. How many {item} are in {b} {boxes}?",
                "There are {b} {boxes} with {a} {item} in each. How many {item} are there in all?",
                "{A} buys {b} {boxes} of {item}. Each {box} has {a} {item}. How many {item} does {he} buy?",
            ],
            [
                "Every {box} contains {a} {item}. How many {item} do {b} {boxes} contain?",
                "{A} fills {b} {boxes} with {a} {item} apiece. How many {item} did {he} use?",
            ],
        ),
        spoken=("a", "b"),
        work="{b} {boxes} hold {b} * {a} = {c} {item}.",
    ),
    "times": OneStep(
        draw=lambda r: _product(r, "a", "k", 8),
        question=(
            [
                "{A} has {a} {item}. {B} has {k} times as many {item}.",
                "{A} has {a} {item}, and {B} has {k} times as many as {A}.",
            ],
            ["{B} owns {k} times the number of {item} that {A} owns, and {A} owns {a}."],
        ),
        ask=(["How many {item} does {B} have?"], ["How many {item} belong to {B}?"]),
        spoken=("a", "k"),
        work="{B} has {a} * {k} = {c} {item}.",
    ),
    "share": OneStep(
        draw=_share,
        question=(
            [
                "{A} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
                "{a} {item} are split into {b} equal groups. How many {item} are in each group?",
                "{A} puts {a} {item} into {b} bags with the same number in each. How many {item} go in each bag?",
            ],
            ["{a} {item} are divided evenly between {b} children. How many does each child receive?"],
        ),
        spoken=("a", "b"),
        work="Each one gets {a} / {b} = {c} {item}.",
    ),
    "part": OneStep(
        draw=_part,
        question=(
            [
                "{A} has {a} {item} and gives {frac} of them to {B}. How many {item} does {A} give away?",
                "What is {frac} of {a}?",
                "{A} had {a} {item}. {He} ate {frac} of them. How many did {he} eat?",
            ],
            ["{frac_cap} of the {a} {item} in the shop are sold. How many {item} is that?"],
        ),
        spoken=("a",),
        work="{frac_cap} of {a} is {a} / {k} = {c}.",
    ),
    "change": OneStep(
        draw=_change,
        picks=(("thing", PRICED),),
        question=(
            [
                "{A} buys a {thing} for {p} dollars and pays with a {bill} dollar bill. How much change does {he} get?",
                "A {thing} costs {p} dollars. {A} pays with {bill} dollars. How much change does {A} get back?",
            ],
            ["{A} hands over {bill} dollars for a {thing} that costs {p} dollars. How much money comes back?"],
        ),
        spoken=("p",),
        work="The change is {bill} - {p} = {c} dollars.",
    ),
    "rate": OneStep(
        draw=lambda r: _product(r, "r", "h", 8),
        picks=(("job", JOBS),),
        question=(
            [
                "{A} {job} {r} dollars an hour. How much does {he} earn in {h} hours?",
                "{A} {job} {r} dollars per hour and works for {h} hours. How much money does {he} make?",
            ],
            ["For every hour of work {A} {job} {r} dollars. What does {he} earn for {h} hours?"],
        ),
        spoken=("r", "h"),
        work="In {h} hours {A} earns {h} * {r} = {c} dollars.",
    ),
    "distance": OneStep(
        draw=lambda r: _product(r, "s", "h", 8),
        picks=(("v", VEHICLES), ("u", UNITS)),
        question=(
            [
                "A {v} travels {s} {u} per hour. How far does it go in {h} hours?",
                "A {v} goes {s} {u} every hour. How many {u} does it travel in {h} hours?",
            ],
            ["Moving at {s} {u} an hour, how many {u} does a {v} cover in {h} hours?"],
        ),
        spoken=("s", "h"),
        work="In {h} hours it travels {h} * {s} = {c} {u}.",
    ),
    "age": OneStep(draw=_age),
    "older": OneStep(
        question=(
            [
                "{A} is {a} years old. {B} is {d} years older than {A}. How old is {B}?",
                "{A} is {a} years old. How old will {A} be in {d} years?",
            ],
            ["{B} was born {d} years before {A}, who is now {a}. How old is {B}?"],
        ),
        spoken=("a", "d"),
        work="{a} + {d} = {c} years old.",
    ),
    "younger": OneStep(
        question=(
            [
                "{A} is {a} years old. {B} is {d} years younger than {A}. How old is {B}?",
                "{A} is {a} years old. How old was {A} {d} years ago?",
            ],
            ["{B} is {a}; {A} is {d} years younger. How old is {A}?"],
        ),
        spoken=("a", "d"),
        work="{a} - {d} = {c} years old.",
    ),
}
STORY_KINDS = [
    "more",
    "together",
    "left",
    "fewer",
    "each",
    "times",
    "share",
    "part",
    "change",
    "rate",
    "distance",
    "age",
]


def _story_one(w: _Writer):
    """A one-step story of one of STORY_KINDS, written from its ONE_STEP entry."""
    kind = w.r.choice(STORY_KINDS)
    a_name, b_name = w.names(2)
    he, item = _he(a_name), w.pick(ITEMS)
    slots = ONE_STEP[kind].draw(w.r)
    story = ONE_STEP[slots.pop("form", kind)]
    for slot, pool in story.picks:
        slots[slot] = w.pick(pool)
    if "box" in slots:
        slots["boxes"] = _plural(slots["box"])
    him = "her" if he == "she" else "him"
    words = {"A": a_name, "B": b_name, "He": _cap(he), "he": he, "him": him, "item": item, **slots}
    said = {**words, **{s: w.num(slots[s]) for s in story.spoken}}
    question = w.say(*story.question, **said)
    if story.ask is not None:
        question += " " + w.say(*story.ask, **said)
    return question, [story.work.format(**words)], slots["c"]


# ---- several steps -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ChainStep:
    """One change of a chain's count, as data. `draw(r, value)` gives `k` and the new value (`new`);
    a phrasing is a string, or (slot, if-set, if-not) where it depends on a drawn word; `line` is
    the answer's line, `said_line` = (word, line) replaces it when the chosen sentence has that word."""

    draw: Callable[[random.Random, int], dict]
    sentence: tuple[list, list]
    line: str
    spoken: tuple[str, ...] = ("k",)
    said_line: tuple[str, str] | None = None


def _chain_add(r, value):
    k = r.randint(1, 20)
    return {"k": k, "new": _ok(value + k)}


def _chain_sub(r, value):
    k = r.randint(1, min(20, value) if value else 1)
    return {"k": k, "new": _ok(value - k)}


def _chain_mul(r, value):
    k = r.randint(2, 4)
    return {"k": k, "new": _ok(value * k), "word": {2: "doubles", 3: "triples"}.get(k)}


def _chain_div(r, value):
    k = r.choice([2, 2, 3, 4])
    if value % k or value == 0:
        raise _Reject
    return {"k": k, "n": k, "new": value // k, "halves": k == 2}


CHAIN_STEPS: dict[str, ChainStep] = {
    "add": ChainStep(
        draw=_chain_add,
        sentence=(
            ["{He} buys {k} more.", "Then {he} finds {k} more {item}.", "{B} gives {him} {k} {item}."],
            ["After that {he} collects another {k}.", "Later {B} hands {him} {k} extra {item}."],
        ),
        line="Adding {k} gives {value} + {k} = {new} {item}.",
    ),
    "sub": ChainStep(
        draw=_chain_sub,
        sentence=(
            ["{He} gives {k} to {B}.", "Then {he} loses {k} {item}.", "{He} eats {k} of them."],
            ["After that {he} drops {k}.", "{B} takes {k} of the {item} away."],
        ),
        line="Taking away {k} leaves {value} - {k} = {new} {item}.",
    ),
    "mul": ChainStep(
        draw=_chain_mul,
        sentence=(
            [
                ("word", "Then the number of {item} {word}.", "Then {he} ends up with {k} times as many {item}."),
                "Then {he} gets {k} times as many {item}.",
            ],
            ["Later {his} pile of {item} grows to {k} times its size."],
        ),
        line="{k} times as many is {value} * {k} = {new} {item}.",
    ),
    "div": ChainStep(
        draw=_chain_div,
        sentence=(
            [
                ("halves", "{He} gives away half of them.", "{He} splits them into {k} equal piles and keeps one."),
                "{He} shares them equally among {n} people, {him}self included, and keeps {his} share.",
            ],
            ["{He} keeps only one of {k} equal parts."],
        ),
        spoken=("k", "n"),
        line="One part is {value} / {k} = {new} {item}.",
        said_line=("half", "Half of {value} is {value} / 2 = {new}, so {new} {item} are left."),
    ),
}


def _phrasing(entry, slots: dict) -> str:
    if isinstance(entry, str):
        return entry
    slot, if_set, if_not = entry
    return if_set if slots.get(slot) else if_not


def _chain(w: _Writer):
    """A count that changes two to four times (CHAIN_STEPS: buys, gives away, doubles, halves,
    shares), asked for at the end; every change is one line of the answer."""
    r = w.r
    (name, other), item = w.names(2), w.pick(ITEMS)
    he = _he(name)
    words = {"A": name, "B": other, "He": _cap(he), "he": he, "him": "her" if he == "she" else "him"}
    words |= {"his": _his(name), "item": item}
    value = r.randint(2, 30)
    story = [
        w.say(
            ["{A} has {a} {item}.", "{A} starts the day with {a} {item}."],
            ["At first {A} owns {a} {item}."],
            a=w.num(value),
            **words,
        )
    ]
    lines = [f"{name} starts with {value} {item}."]
    for _ in range(r.randint(2, 4)):
        step = CHAIN_STEPS[r.choice(["add", "sub", "mul", "div"])]
        slots = {**words, **step.draw(r, value), "value": value}
        said = {**slots, **{s: w.num(slots[s]) for s in step.spoken}}
        train, test = ([_phrasing(e, slots) for e in group] for group in step.sentence)
        story.append(w.say(train, test, **said))
        line = step.line
        if step.said_line is not None and step.said_line[0] in story[-1]:
            line = step.said_line[1]
        lines.append(line.format(**slots))
        value = slots["new"]
    story.append(
        w.say(
            ["How many {item} does {A} have now?", "How many {item} does {A} have at the end?"],
            ["In the end, how many {item} are left with {A}?"],
            **words,
        )
    )
    return " ".join(story), lines, value


def _shopping(w: _Writer):
    """Two or three steps with money: items at a price, a second purchase, change from a bill."""
    r = w.r
    name = w.names(1)[0]
    he = _he(name)
    thing, other = r.sample(PRICED[1] if w.test else PRICED[0], 2)
    n, price = r.randint(2, 6), r.randint(2, 9)
    cost = _ok(n * price)
    lines = [f"{n} {thing}s cost {n} * {price} = {cost} dollars."]
    story = w.say(
        ["{A} buys {n} {t}s that cost {p} dollars each.", "A {t} costs {p} dollars. {A} buys {n} of them."],
        ["{A} picks up {n} {t}s priced at {p} dollars apiece."],
        A=name,
        n=w.num(n),
        t=thing,
        p=w.num(price),
    )
    extra = r.random() < 0.5
    total = cost
    if extra:
        p2 = r.randint(1, 15)
        total = _ok(cost + p2)
        story += " " + w.say(
            ["{He} also buys a {o} for {p} dollars.", "Then {he} gets a {o} for {p} dollars."],
            ["A {o} for {p} dollars goes in the basket too."],
            He=_cap(he),
            he=he,
            o=other,
            p=w.num(p2),
        )
        lines.append(f"With the {other} that is {cost} + {p2} = {total} dollars.")
    if r.random() < 0.5:
        bill = next((b for b in (10, 20, 50, 100) if b > total), None)
        if bill is None or bill > 99:
            raise _Reject
        change = bill - total
        story += " " + w.say(
            ["{He} pays with a {b} dollar bill. How much change does {he} get?"],
            ["{He} hands the cashier {b} dollars. How much money does {he} get back?"],
            He=_cap(he),
            he=he,
            b=bill,
        )
        lines.append(f"The change is {bill} - {total} = {change} dollars.")
        return story, lines, change
    story += " " + w.say(
        ["How much does {A} spend?", "How much money does {A} spend in all?"], ["What does {A} pay altogether?"], A=name
    )
    return story, lines, total


def _two_people(w: _Writer):
    """Two steps across two people: one has more (or k times as many) than the other, then totals."""
    r = w.r
    (a_name, b_name), item = w.names(2), w.pick(ITEMS)
    a = r.randint(2, 30)
    if r.random() < 0.5:
        d = r.randint(1, 20)
        b = _ok(a + d)
        rel = w.say(
            ["{B} has {d} more {item} than {A}."],
            ["{B} owns {d} {item} more than {A} does."],
            A=a_name,
            B=b_name,
            d=w.num(d),
            item=item,
        )
        first = f"{b_name} has {a} + {d} = {b} {item}."
    else:
        k = r.randint(2, 4)
        b = _ok(a * k)
        rel = w.say(
            ["{B} has {k} times as many {item} as {A}."],
            ["{B} holds {k} times the {item} that {A} holds."],
            A=a_name,
            B=b_name,
            k=w.num(k),
            item=item,
        )
        first = f"{b_name} has {a} * {k} = {b} {item}."
    total = _ok(a + b)
    story = w.say(
        ["{A} has {a} {item}.", "{A} collected {a} {item}."],
        ["{A} keeps {a} {item} in a drawer."],
        A=a_name,
        a=w.num(a),
        item=item,
    )
    ask = w.say(
        ["How many {item} do they have together?", "How many {item} do {A} and {B} have in all?"],
        ["How many {item} do the two have combined?"],
        A=a_name,
        B=b_name,
        item=item,
    )
    return f"{story} {rel} {ask}", [first, f"Together they have {a} + {b} = {total} {item}."], total


def _distractor(w: _Writer, names_used: str) -> str:
    r = w.r
    name = r.choice([n for n in (NAMES[1] if w.test else NAMES[0]) if n not in names_used])
    return w.say(
        [
            "{N} has {x} {item} at home.",
            "It is a sunny day.",
            "{N} is {x} years old.",
            "The shop opens at {h} o'clock.",
        ],
        ["{N} owns {x} {item} too, but they are not part of this.", "The weather is cold."],
        N=name,
        x=r.randint(2, 40),
        item=w.pick(ITEMS),
        h=r.randint(7, 10),
    )


GENERATORS = [_bare, _story_one, _story_one, _story_one, _chain, _shopping, _two_people]


def make_problem(r: random.Random, test: bool = False) -> Problem:
    w = _Writer(r, test)
    while True:
        try:
            question, lines, value = r.choice(GENERATORS)(w)
            break
        except _Reject:
            continue
    if r.random() < P_DISTRACTOR and question.count(". ") >= 1:
        sentences = question.split(". ")
        at = r.randint(1, len(sentences) - 1)
        sentences.insert(at, _distractor(w, question).rstrip("."))
        question = ". ".join(sentences)
    return Problem(question, "\n".join(lines + [f"#### {value}"]), value)


_cache: dict[str, list[Problem]] = {}


def test_split() -> list[Problem]:
    if "test" not in _cache:
        r, seen, out = random.Random(TEST_SEED), set(), []
        while len(out) < TEST_SIZE:
            p = make_problem(r, test=True)
            if p.question not in seen:
                seen.add(p.question)
                out.append(p)
        _cache["test"] = out
    return _cache["test"]


def train_stream(seed: int):
    """An endless stream of training problems: training phrasings and entities only, so no test
    question can appear (they differ in wording and names, not only numbers)."""
    r = random.Random(seed)
    while True:
        yield make_problem(r, test=False)


# Hand-written questions in the words a new user types; no generator template writes them.
PROBE = [
    ("Tom has 5 apples. He buys 3 more. How many apples does he have?", 8),
    ("What is 9 times 7?", 63),
    ("A box holds 12 pencils. How many pencils are in 4 boxes?", 48),
    ("Eva earns 12 dollars an hour. How much does she earn in 5 hours?", 60),
    ("What is 17 plus 25?", 42),
    ("Sara had 20 candies and ate 6 of them. How many candies does she have left?", 14),
    ("There are 30 students and they sit in 5 equal rows. How many students are in each row?", 6),
    ("A pizza costs 8 dollars. How much do 3 pizzas cost?", 24),
    ("What is half of 18?", 9),
    ("Ben is 9 years old. His sister is 4 years older. How old is his sister?", 13),
    ("I have 15 dollars and spend 7. How much money do I have now?", 8),
    ("What is 45 minus 18?", 27),
    ("Lily reads 6 pages every day. How many pages does she read in 7 days?", 42),
    ("Max has 24 stickers and shares them equally with 3 friends. How many stickers does each friend get?", 8),
    ("A bus travels 10 miles per hour. How far does it go in 6 hours?", 60),
    ("What is 56 divided by 8?", 7),
    ("Ann has 7 marbles and Sam has 9 marbles. How many marbles do they have together?", 16),
    ("A shirt costs 13 dollars. Jack pays with a 20 dollar bill. How much change does he get?", 7),
    ("What is the sum of 33 and 14?", 47),
    ("Mia has 40 cards. She gives a quarter of them to her brother. How many cards does she give away?", 10),
    ("Leo had 12 coins. He found 8 more and then spent 5. How many coins does he have now?", 15),
    ("Each bag has 6 oranges. How many oranges are in 8 bags?", 48),
    ("Zoe has 3 times as many books as Owen. Owen has 7 books. How many books does Zoe have?", 21),
    ("What is 6 times 8?", 48),
    ("Noah buys 4 pens at 3 dollars each. How much does he spend?", 12),
    ("A farmer has 50 eggs and sells 22. How many eggs are left?", 28),
    ("Emma is 11. How old will she be in 9 years?", 20),
    ("There are 9 birds on a tree. 4 fly away. How many birds are still on the tree?", 5),
    ("Grace has 14 flowers. Ruby has 6 more flowers than Grace. How many flowers does Ruby have?", 20),
    ("What is 72 divided by 9?", 8),
    ("Ryan runs 4 laps each day for 5 days, then 3 more laps. How many laps does he run in all?", 23),
    ("Chloe has 25 beads. She uses 10 for a bracelet and buys 12 more. How many beads does she have?", 27),
]


class EverydayTask(Task):
    """500 held-out questions of the generator above (test phrasings and entities), 0-shot, scored
    like GSM8K. The prompt is the question itself: in the chat template as the user message, or as
    plain text "Question: ...\\nAnswer:" where the evaluation runs without it."""

    name = "everyday"
    description = "arithmetic in everyday words (generated; phrasings and entities held out; 500 test items)"

    def load(self, data_dir=None, limit=None) -> list[Doc]:
        docs = [
            Doc(f"everyday/{i}", i, {"question": p.question, "answer": p.answer}, str(p.value))
            for i, p in enumerate(test_split())
        ]
        return apply_limit(docs, limit)

    def prompt_text(self, doc, shots):
        return doc.data["question"]

    def plain_text(self, doc, shots):
        return f"Question: {doc.data['question']}\nAnswer:"

    def stop_strings(self, chat):
        return ["Question:"]

    def score_one(self, doc, completion):
        return score_final_number(doc, completion)


class EverydayProbeTask(EverydayTask):
    """32 hand-written questions in the words a new user types (`PROBE`): a sanity probe, not a
    held-out split by construction."""

    name = "everyday-probe"
    description = "32 hand-written everyday arithmetic questions (a probe of how a user's words fare)"

    def load(self, data_dir=None, limit=None) -> list[Doc]:
        docs = [
            Doc(f"everyday-probe/{i}", i, {"question": q, "answer": f"#### {v}"}, str(v))
            for i, (q, v) in enumerate(PROBE)
        ]
        return apply_limit(docs, limit)
