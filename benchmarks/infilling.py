"""Suffix infilling on held-out arith problems whose worked answer has three lines or more: the
prompt is the question (chat template) and the answer's first line, the suffix is the answer's
lines after the second, and the region is exactly as long as the second line's tokens. Counts
the fills equal to the true second line, with the suffix and without it (the same region), under
LLaDA's baseline (no cache, one token per step) and the default config. One thread.

    python benchmarks/infilling.py --problems 100 [--model dream-arith]
"""

from __future__ import annotations

import argparse
import json

import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.evaluation.tasks import arith


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llada-arith")
    ap.add_argument("--problems", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = fastdllm.load(args.model, dtype="float32")
    cases = [p for p in arith.test_split() if p.answer.count("\n") >= 2][: args.problems]
    configs = {"baseline": GenerationConfig.baseline(), "default": GenerationConfig()}
    results = {"model": args.model, "problems": len(cases)}
    example = None
    for name, base in configs.items():
        right = {"suffix": 0, "no_suffix": 0}
        for p in cases:
            lines = p.answer.split("\n")
            prefix = tok.render_chat([{"role": "user", "content": p.question}]) + lines[0] + "\n"
            suffix = "\n" + "\n".join(lines[2:]) + "<|eot_id|>"
            n = len(tok.encode(lines[1], add_special_tokens=False))
            config = base.fit_to_model(model).replace(gen_length=n, block_length=n, steps=None)
            with_suffix = fastdllm.generate_text(model, tok, prefix, config=config, suffix=suffix).text
            alone = fastdllm.generate_text(model, tok, prefix, config=config).text
            right["suffix"] += with_suffix.strip() == lines[1].strip()
            right["no_suffix"] += alone.strip() == lines[1].strip()
            if example is None and with_suffix.strip() == lines[1].strip() != alone.strip():
                example = {"question": p.question, "prefix": lines[0], "suffix": suffix, "fill": with_suffix}
                example["without_suffix"] = alone
        results[name] = {k: round(v / len(cases), 3) for k, v in right.items()}
    results["example"] = example
    print(json.dumps(results))


if __name__ == "__main__":
    main()
