"""Which arithmetic facts an arith model knows: every fact of the task (`drills.arithmetic_facts()`,
964 of them) is written in drill rows of eight (answer "45 - 10 = 35\n3 + 4 = 7 ..."), every result
is masked at once, and the model's top-1 guess for each is checked in one forward. Reported per
operation and by operand size.

A result of a worked answer is usually also written elsewhere in it (the next line's operand, the
`####` line), so answer-level probes can be passed by copying; here a result can only be known.
By default the question is "Work out these.", as in a worked answer, where nothing restates the
operation; `--restate` lists the operations in the question ("Work out 45 - 10, ...") as the
`drill` and `facts` training mixes do. What it found during training is in docs/training-notes.md.

`--answers N` probes the same facts where they matter: inside the worked answers of N held-out
problems, with every result and the `####` value masked at once and the operands shown.

    python tools/probe_facts.py [MODEL_DIR] [--repeats 2] [--restate] [--answers 300]
"""

from __future__ import annotations

import argparse
import random

import torch

import fastdllm
from fastdllm.embedded import drills
from fastdllm.evaluation.tasks import arith
from fastdllm.evaluation.tasks.arith import prompt_ids


def _masked_top1(model, target: torch.Tensor, where: list[int]) -> list[bool]:
    """Mask the positions `where` of the one-row `target` together; is each top-1 guess right?"""
    x = target.clone()
    x[0, where] = model.mask_token_id
    with torch.no_grad():  # row j predicts token 1 + j, for either family (Dream shifts)
        logits = model.logits_for(x, 1, x.shape[1])
    return (logits[0, [w - 1 for w in where]].argmax(-1) == target[0, where]).tolist()


def probe(model, tokenizer, repeats: int = 2, restate: bool = False) -> dict[tuple[int, str, int, int], float]:
    """Per fact: the share of the `repeats` shuffled drill placements in which its result was right."""
    facts = drills.arithmetic_facts()
    equals = tokenizer.encode(" =")[-1]
    hits: dict[tuple[int, str, int, int], list[bool]] = {f: [] for f in facts}
    for rep in range(repeats):
        order = list(facts)
        random.Random(rep).shuffle(order)
        for i in range(0, len(order), 8):
            chunk = order[i : i + 8]
            drill = drills.drill_from_facts(chunk, restate)
            pids, answer = prompt_ids(tokenizer, drill.question, []), tokenizer.encode(drill.answer)
            target = torch.tensor([pids + answer])
            where = [len(pids) + j + 1 for j, tok in enumerate(answer) if tok == equals]  # each result
            for fact, ok in zip(chunk, _masked_top1(model, target, where)):
                hits[fact].append(ok)
    return {f: sum(h) / len(h) for f, h in hits.items()}


def probe_answers(model, tokenizer, problems: int) -> tuple[dict[str, list[int]], float]:
    """Per operation (and "####"): [right, total] over the results of held-out worked answers, with
    all of an answer's results masked together; and the share of answers with every result right."""
    equals, hashes = tokenizer.encode(" =")[-1], tokenizer.encode("####")[-1]
    counts: dict[str, list[int]] = {}
    all_right = 0
    for p in arith.test_split()[:problems]:
        pids, answer = prompt_ids(tokenizer, p.question, []), tokenizer.encode(p.answer)
        # As trained and decoded: <|eot_id|>, then EOS padding to a 64-token region.
        tail = [tokenizer.token_to_id("<|eot_id|>")] + [tokenizer.eos_token_id] * max(3, 63 - len(answer))
        target = torch.tensor([pids + answer + tail])
        # Each result follows " =" (its operation two tokens earlier) or "####".
        marks = [j for j, tok in enumerate(answer) if tok in (equals, hashes)]
        where = [len(pids) + j + 1 for j in marks]
        ops = [tokenizer.decode([answer[j - 2]]).strip() if answer[j] == equals else "####" for j in marks]
        right = _masked_top1(model, target, where)
        for op, ok in zip(ops, right):
            c = counts.setdefault(op, [0, 0])
            c[0] += ok
            c[1] += 1
        all_right += all(right)
    return counts, all_right / problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "model", nargs="?", default=None, help="model folder or embedded name (default: the embedded model)"
    )
    ap.add_argument("--repeats", type=int, default=2, help="shuffled placements of every fact")
    ap.add_argument("--restate", action="store_true", help="list the operations in the question")
    ap.add_argument(
        "--answers",
        type=int,
        default=0,
        metavar="N",
        help="instead, probe the results inside the worked answers of N held-out problems",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = fastdllm.load(args.model, dtype="float32")
    if args.answers:
        counts, all_right = probe_answers(model, tokenizer, args.answers)
        for op, (right, n) in sorted(counts.items()):
            print(f"  {op:<6} {100 * right / n:5.1f}% of {n}")
        print(f"answers with every result right: {100 * all_right:.1f}%")
        return
    known = probe(model, tokenizer, args.repeats, args.restate)

    def share(facts) -> str:
        facts = list(facts)
        return f"{100 * sum(known[f] for f in facts) / len(facts):5.1f}% of {len(facts):3d}" if facts else "    -"

    print(f"all facts  {share(known)}")
    for op in "+-*/":
        mine = [f for f in known if f[1] == op]
        print(
            f"  {op}        {share(mine)}   first operand <= 20: {share(f for f in mine if f[0] <= 20)}"
            f"   > 20: {share(f for f in mine if f[0] > 20)}"
        )


if __name__ == "__main__":
    main()
