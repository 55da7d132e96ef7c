"""Training-only arithmetic drills for the `arith` task: every fact of the task, and problems made
of unrelated facts whose results appear exactly once (see `drill_problem`). The task module
(`fastdllm.evaluation.tasks.arith`) holds what evaluation needs; these are used by `fastdllm.embedded.train` and
`tools/probe_facts.py` only."""

from __future__ import annotations

import functools
import random

from ..evaluation.tasks.arith import ACTIVITIES, ITEMS, MAX_VALUE, NAMES, PRICED, Problem


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
    "+": [
        "After that {name} has {e} = {c} {item}.",
        "With the last day that is {e} = {c} {unit}.",
        "Then each friend has {e} = {c} {item}.",
        "With the {priced} {name} spends {e} = {c} dollars.",
        "{name} has {e} = {c} {item}.",
    ],
    "-": [
        "After giving some away {name} has {e} = {c} {item}.",
        "After losing some that is {e} = {c} {unit}.",
        "With the discount {name} pays {e} = {c} dollars.",
        "{name} has {e} = {c} {item}.",
    ],
    "*": [
        "Then {name} has {e} = {c} {item}.",
        "The {priced}s cost {e} = {c} dollars.",
        "In {a} days {name} {verb} {e} = {c} {unit}.",
        "In all the friends have {e} = {c} {item}.",
    ],
    "/": [
        "One pile has {e} = {c} {item}.",
        "One part is {e} = {c} {item}.",
        "Each friend first gets {e} = {c} {item}.",
    ],
}


def drill_problem(
    r: random.Random, n_lines: int = 8, weighting: str = "op", restate: bool = True, phrasing: str = "equation"
) -> Problem:
    """A training-only drill: several unrelated facts, each result written exactly once.

    In a worked answer each result reappears (as the next line's operand and after `####`), so a
    model can learn to copy a result instead of computing it; here the only way to fill a masked
    result is to know the fact.

    weighting "op" draws an operation, then one of its facts (the 87 products and 67 quotients are
    then seen ~5x as often each as the 405 sums and 405 differences); "fact" draws uniformly over
    all facts.

    restate=True lists the operations in the question ("Work out 45 - 10, 3 + 4 ..."): a model
    can then compute a result from the question's copy of its operation, which no worked answer
    offers. restate=False asks "Work out these." so a result can only come from the operands on
    its own line.

    phrasing "equation" writes each line as "a op b = c". "sentence" wraps it in one of the
    answers' own sentences with a random name and item ("After that Mia has 16 + 9 = 25 toys."),
    so that the recall holds in the answers' wording too.
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
            lines.append(
                r.choice(phrases).format(
                    e=f"{a} {op} {b}",
                    c=c,
                    a=a,
                    name=r.choice(NAMES),
                    item=r.choice(ITEMS),
                    priced=r.choice(PRICED),
                    verb=verb,
                    unit=unit,
                )
            )
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
