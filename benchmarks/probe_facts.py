"""Which arithmetic facts an arith model knows: every fact of the task (`arith.arithmetic_facts()`,
964 of them) is written in drill rows of eight (answer "45 - 10 = 35\n3 + 4 = 7 ..."), every result
is masked at once, and the model's top-1 guess for each is checked in one forward. Reported per
operation and by operand size.

A result of a worked answer is usually also written elsewhere in it (the next line's operand, the
`####` line), so answer-level probes can be passed by copying; here a result can only be known.
By default the question is "Work out these.", as in a worked answer, where nothing restates the
operation; `--restate` lists the operations in the question ("Work out 45 - 10, ...") as the
`drill` and `facts` training mixes did. What we found with it (docs/model-card.md): v3 knew ~90% of
the products and quotients and ~13% of the sums and differences with the operations restated, and
3% of all facts without.

    python benchmarks/probe_facts.py [MODEL_DIR] [--repeats 2] [--restate]
"""

from __future__ import annotations

import argparse
import random

import torch

import fastdllm
from fastdllm.tasks import arith
from fastdllm.train import prompt_ids


def probe(model, tokenizer, repeats: int = 2, restate: bool = False) -> dict[tuple[int, str, int, int], float]:
    """Per fact: the share of the `repeats` shuffled drill placements in which its result was right."""
    facts = arith.arithmetic_facts()
    equals = tokenizer.encode(" =")[-1]
    hits: dict[tuple[int, str, int, int], list[bool]] = {f: [] for f in facts}
    for rep in range(repeats):
        order = list(facts)
        random.Random(rep).shuffle(order)
        for i in range(0, len(order), 8):
            chunk = order[i : i + 8]
            drill = arith.drill_from_facts(chunk, restate)
            pids, answer = prompt_ids(tokenizer, drill.question, []), tokenizer.encode(drill.answer)
            target = torch.tensor([pids + answer])
            where = [len(pids) + j + 1 for j, tok in enumerate(answer) if tok == equals]  # each result
            x = target.clone()
            x[0, where] = model.mask_token_id
            with torch.no_grad():  # row j predicts token 1 + j, for either family (Dream shifts)
                logits = model.logits_for(x, 1, x.shape[1])
            right = (logits[0, [w - 1 for w in where]].argmax(-1) == target[0, where]).tolist()
            for fact, ok in zip(chunk, right):
                hits[fact].append(ok)
    return {f: sum(h) / len(h) for f, h in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="model folder or embedded name (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=2, help="shuffled placements of every fact")
    ap.add_argument("--restate", action="store_true", help="list the operations in the question")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = fastdllm.load(args.model, dtype="float32")
    known = probe(model, tokenizer, args.repeats, args.restate)

    def share(facts) -> str:
        facts = list(facts)
        return f"{100 * sum(known[f] for f in facts) / len(facts):5.1f}% of {len(facts):3d}" if facts else "    -"

    print(f"all facts  {share(known)}")
    for op in "+-*/":
        mine = [f for f in known if f[1] == op]
        print(f"  {op}        {share(mine)}   first operand <= 20: {share(f for f in mine if f[0] <= 20)}"
              f"   > 20: {share(f for f in mine if f[0] > 20)}")


if __name__ == "__main__":
    main()
