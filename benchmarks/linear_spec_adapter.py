"""LinearSpec with and without a draft adapter: trains a LoRA adapter on a Nemotron-Labs-Diffusion
twin's attention output projections (`o_proj`, as its `linear_spec_lora` is) by self-distillation,
then decodes held-out arith problems with LinearSpec without it and with it on the drafts
(`draft_adapter`). Reports acceptance lengths, forwards, tokens/s and whether the answers stay the
autoregressive mode's (they must: verification decides them).

The adapter learns to draft what the model's own causal pass predicts: per training sequence, a
block of `--block` positions opening at a random answer position, every position after its first
masked, drafted bidirectionally against the causal prefix (the adapter on), with the causal pass's
argmax at each position (teacher-forced on the true text, the adapter off) as the target. Its
published recipe is not in code we could read: this is our reading of what raises acceptance.

    python benchmarks/linear_spec_adapter.py --model <twin> --steps 200 --problems 64 --out <folder>
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.embedded.train import make_batch
from fastdllm.evaluation.tasks import arith


def train_adapter(model, tok, steps: int, rank: int, alpha: int, block: int, lr: float, seed: int):
    """LoRA factors (A, B) per layer's `wo`, trained as the module docstring says."""
    torch.manual_seed(seed)
    scale = alpha / rank
    factors = []
    for layer in model.layers:
        wo = layer.attention.wo
        a = torch.nn.Parameter(torch.randn(rank, wo.in_features) / rank)
        b = torch.nn.Parameter(torch.zeros(wo.out_features, rank))
        factors.append((a, b))
    on = [False]

    def hook(i):
        def add(module, inputs, output):
            if not on[0]:
                return output
            a, b = factors[i]
            return output + (inputs[0] @ a.T @ b.T) * scale

        return add

    handles = [layer.attention.wo.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]
    opt = torch.optim.AdamW([p for ab in factors for p in ab], lr=lr, weight_decay=0.0)
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids, starts = make_batch(tok, step, seed, 2048, "v1", model.args.max_seq_len)
        bsz, total = ids.shape
        pos = torch.arange(total).expand(bsz, total)
        with torch.no_grad():
            on[0] = False
            causal = (pos[0][None, :] <= pos[0][:, None])[None, None]
            teacher = model.head(model.hidden(ids, pos, causal)).argmax(-1)  # column c predicts c + 1
        lo = starts + (torch.rand(bsz, generator=gen) * (total - starts - block).clamp_min(1)).long()
        hi = lo + block
        in_block = (pos >= lo[:, None]) & (pos < hi[:, None])
        masked = in_block & (pos > lo[:, None])
        noisy = torch.where(masked, torch.full_like(ids, model.mask_token_id), ids)
        q, k = pos[:, :, None], pos[:, None, :]
        allowed = torch.where(in_block[:, :, None], k < hi[:, None, None], k <= q)
        on[0] = True
        draft = model.head(model.hidden(noisy, pos, allowed[:, None]))
        target = torch.cat([ids[:, :1], teacher[:, :-1]], 1)  # position c: the causal prediction from c - 1
        loss = F.cross_entropy(draft[masked].float(), target[masked])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4)}), flush=True)
    for h in handles:
        h.remove()
    return factors, scale


def save_peft(factors, rank: int, alpha: int, out: Path) -> None:
    """The factors as PEFT saves a LoRA adapter over the model's own classes (o_proj)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, (a, b) in enumerate(factors):
        name = f"base_model.model.encoder.layers.{i}.self_attn.o_proj"
        tensors[f"{name}.lora_A.weight"] = a.detach().contiguous()
        tensors[f"{name}.lora_B.weight"] = b.detach().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["o_proj"], "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))


def decode(model, prompts, config) -> dict:
    t0 = time.perf_counter()
    answers, forwards, acceptances, tokens = [], 0, [], 0
    for p in prompts:
        out = generate(model, [p], config)
        answers.append(out.sequences[0].tolist()[: out.num_tokens[0]])
        forwards += out.nfe
        tokens += out.num_tokens[0]
        acceptances += out.acceptances[0]
    seconds = time.perf_counter() - t0
    return {
        "forwards": forwards,
        "tokens": tokens,
        "mean_acceptance_length": round(sum(acceptances) / len(acceptances), 3),
        "tokens_per_second": round(tokens / seconds, 1),
        "answers": answers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--out", required=True, help="a copy of the model folder with the adapter in linear_spec_lora/")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = fastdllm.load(args.model, dtype="float32")
    factors, _ = train_adapter(model, tok, args.steps, args.rank, args.alpha, args.block, args.lr, args.seed)
    out = Path(args.out)
    import shutil

    shutil.copytree(args.model, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("optimizer*", "trainer_state*"))
    save_peft(factors, args.rank, args.alpha, out / "linear_spec_lora")
    model, tok = fastdllm.load(out, dtype="float32")  # the adapter loads by its folder's name
    prompts = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[: args.problems]]
    config = GenerationConfig.nemotron_labs_diffusion_linear_spec(gen_length=64)
    with torch.inference_mode():
        without = decode(model, prompts, config)
        with_adapter = decode(model, prompts, config.replace(draft_adapter="linear_spec_lora"))
    same = sum(a == b for a, b in zip(without.pop("answers"), with_adapter.pop("answers")))
    print(
        json.dumps(
            {
                "model": args.model,
                "steps": args.steps,
                "problems": len(prompts),
                "without": without,
                "with_adapter": with_adapter,
                "same_answers": same,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
