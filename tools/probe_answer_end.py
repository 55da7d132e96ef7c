"""Where an arith model expects its answer to end, through its chat template and behind a plain
prompt: for each held-out problem, one forward over the prompt and a region of [MASK]; the
predicted end is the first position from which the model's top-1 guess is an end token (EOS or
`<|eot_id|>`) eight times in a row. Printed per form and per group of problems (the `_groups`
template, three steps, against the others): how far that end lies from the worked answer's own
end (its length, and its `<|eot_id|>` in chat), and the share of problems where it is exact.

What it found is in docs/training-notes.md ("Where the plain gap lives").

    python tools/probe_answer_end.py [MODEL_DIR] [--n 500] [--region 256]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fastdllm
from fastdllm.evaluation.tasks import arith

RUN = 8  # end tokens in a row that count as the answer's end


def groups_problem(question: str) -> bool:
    return "equally among" in question and "Then each friend gets" in question


def predicted_end(model, tok, prompt: list[int], region: int) -> int:
    ends = {tok.eos_token_id, tok.token_to_id("<|eot_id|>")}
    x = torch.tensor([prompt + [model.mask_token_id] * region])
    with torch.no_grad():
        top = model.logits_for(x, len(prompt), len(prompt) + region)[0].argmax(-1).tolist()
    return next((i for i in range(region - RUN) if all(t in ends for t in top[i : i + RUN])), region)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="llada-arith")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--region", type=int, default=256)
    args = ap.parse_args()
    model, tok = fastdllm.load(args.model, dtype="float32")
    offsets: dict[tuple[str, str], list[int]] = {}
    for p in arith.test_split()[: args.n]:
        text, kind = arith.format_prompt(p.question, []), "groups" if groups_problem(p.question) else "other"
        chat = tok.encode_chat([{"role": "user", "content": text}])
        answer = tok.encode(p.answer, add_special_tokens=False)
        offsets.setdefault(("chat", kind), []).append(predicted_end(model, tok, chat, args.region) - len(answer))
        plain_answer = tok.encode(" " + p.answer, add_special_tokens=False)
        end = predicted_end(model, tok, tok.encode(text), args.region)
        offsets.setdefault(("plain", kind), []).append(end - len(plain_answer))
    for (form, kind), d in sorted(offsets.items()):
        exact = sum(x == 0 for x in d) / len(d)
        print(f"{form:5} {kind:6} n {len(d):3}  mean offset {statistics.mean(d):+.2f}  exact {exact:.0%}")


if __name__ == "__main__":
    main()
