"""How well an arith model fills a worked answer as the generation region grows: each of N held-out
answers is placed at the start of a 64-, 256- or 1024-token region (the rest EOS padding, as in
training), every answer token is masked, and the model's top-1 guess for each is checked in one
forward. With `padding masked` the padding is masked too, which is what block-wise decoding sees
while it writes the answer's first blocks; with `padding shown` it is visible.

What it found during training is in docs/training-notes.md.

    python tools/probe_long_region.py [MODEL_DIR] [--n 48] [--regions 64 256 1024]
"""

from __future__ import annotations

import argparse

import torch

import fastdllm
from fastdllm.evaluation.tasks import arith


def answer_top1(model, tok, problems, region: int, suffix_visible: bool) -> float:
    eos, eot, mask = tok.eos_token_id, tok.token_to_id("<|eot_id|>"), model.mask_token_id
    right = total = 0
    for p in problems:
        pids = arith.prompt_ids(tok, p.question, [])
        aids = tok.encode(p.answer) + [eot]
        ids = torch.tensor([pids + aids + [eos] * (region - len(aids))])
        start, end = len(pids), len(pids) + len(aids)
        noisy = ids.clone()
        noisy[0, start : end if suffix_visible else None] = mask
        with torch.no_grad():  # row j predicts token start + j, for either family (Dream shifts)
            logits = model.logits_for(noisy, start, end)
        right += (logits[0].argmax(-1) == ids[0, start:end]).sum().item()
        total += end - start
    return right / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--n", type=int, default=48, help="held-out answers")
    ap.add_argument("--regions", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = fastdllm.load(args.model, dtype="float32")
    problems = arith.test_split()[: args.n]
    longest = max(len(tok.encode(p.answer)) + 1 for p in problems)
    if min(args.regions) < longest:
        raise ValueError(f"--regions: {min(args.regions)} tokens cannot hold a {longest}-token answer")
    for region in args.regions:
        for visible in (False, True):
            acc = answer_top1(model, tok, problems, region, visible)
            print(
                f"region {region:5d}, padding {'shown ' if visible else 'masked'}: answer top-1 {acc:.1%}", flush=True
            )


if __name__ == "__main__":
    main()
