"""Teacher-forced probe of an arith model: mask ONE token of a held-out worked answer, keep everything
else visible, and check the model's top-1 guess. Reported separately for words and numbers, and
for tokens that also occur in the question (copying) or not (computed results).

Free decoding must get every token of an answer right from an all-[MASK] start, so its accuracy
lags; this probe shows what the model has learned so far (see docs/training-notes.md).

    python tools/probe_numbers.py [MODEL_DIR] [--problems 40]
"""

from __future__ import annotations

import argparse

import torch

import fastdllm
from fastdllm.evaluation.tasks import arith
from fastdllm.evaluation.tasks.arith import prompt_ids


def probe(model, tokenizer, problems: int) -> dict[str, tuple[float, int]]:
    counts: dict[str, list[int]] = {}
    for p in arith.test_split()[:problems]:
        pids, answer = prompt_ids(tokenizer, p.question, []), tokenizer.encode(p.answer)
        in_question = set(pids)
        # A region of 64 like the training mix's short one: the answer, then EOS padding.
        row = pids + answer + [tokenizer.eos_token_id] * max(4, 64 - len(answer))
        x = torch.tensor([row] * len(answer))
        for j in range(len(answer)):  # row j masks answer token j
            x[j, len(pids) + j] = model.mask_token_id
        with torch.no_grad():
            logits = model(x)
        for j, tok in enumerate(answer):
            kind = ("number" if tokenizer.decode([tok]).strip().isdigit() else "word") + (
                " in question" if tok in in_question else " not in question"
            )
            hit = int(logits[j, len(pids) + j].argmax()) == tok
            c = counts.setdefault(kind, [0, 0])
            c[0] += hit
            c[1] += 1
    return {k: (right / n, n) for k, (right, n) in sorted(counts.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--problems", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = fastdllm.load(args.model, dtype="float32")
    for kind, (acc, n) in probe(model, tokenizer, args.problems).items():
        print(f"{kind:<22} top-1 {100 * acc:5.1f}%  ({n} tokens)")


if __name__ == "__main__":
    main()
