"""DiffusionGemma: our loop against transformers' `DiffusionGemmaForBlockDiffusion.generate` on
the same checkpoint, same seeds.

    python benchmarks/diffusion_gemma_reference.py [--dim 128 --layers 4 --experts 8]
        [--prompts 4] [--canvases 2] [--canvas 32] [--steps 48] [--threads 2] [--float64] [--shots N]
        [--compile | --cuda-graphs]
        [--images N [--image-budget 70] [--vision-dim 64] [--vision-layers 2]] [--profile] [--out FILE]

A random checkpoint made and saved by transformers' class (float32; sliding and full layers, a
mixture of experts), loaded by `fastdllm.load`. Both decode the same prompts under the same torch
seed with transformers' default decoding (bound 0.1, temperatures 0.8 to 0.4, adaptive stopping):
transformers one prompt at a time and as one batch (its batch draws every row from one stream, so
its batch is timed, not compared one by one), ours one at a time and as one batch. Reports tokens/s,
decoder forwards per answer, and how many answers are token-identical: in float32 the two round a logit differently
(~1e-6) and self-conditioning carries each step's logits into the next, so long runs can part;
with --float64 both compute the same logits and every answer should agree. With --images, each
prompt asks about N random pictures of different sizes (its vision tower made to that width): ours
is given the pictures (`generate(images=...)`), transformers its image processor's inputs for them;
the times include each side's vision tower and image processing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import AddedToken

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.embedded.recipe import build_tokenizer

IMAGE_TOKENS = ("<|image|>", "<|image>", "<image|>")  # Gemma 4's image, begin- and end-of-image tokens


def make_checkpoint(folder: Path, tok, a) -> None:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    text = dict(
        vocab_size=64 * -(-tok.vocab_size // 64),
        hidden_size=a.dim,
        intermediate_size=2 * a.dim,
        num_hidden_layers=a.layers,
        num_attention_heads=a.dim // 32,
        num_key_value_heads=max(1, a.dim // 128),
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        sliding_window=64,
        num_experts=a.experts,
        top_k_experts=2,
        moe_intermediate_size=a.dim // 2,
        max_position_embeddings=2048,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    v = a.vision_dim
    vision = dict(model_type="gemma4_vision", hidden_size=v, intermediate_size=4 * v,
                  num_hidden_layers=a.vision_layers, num_attention_heads=max(1, v // 32),
                  num_key_value_heads=max(1, v // 32), head_dim=min(v, 32))  # fmt: skip
    ids = dict(zip(("image_token_id", "boi_token_id", "eoi_token_id"), map(tok.token_to_id, IMAGE_TOKENS)))
    model = DiffusionGemmaForBlockDiffusion(
        DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=a.canvas, **ids)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_embedding_table"):
                p.copy_(torch.randn_like(p))  # its init is all ones: every patch in one place
            elif p.dim() > 1:
                p.mul_(6.0)  # sharper distributions, as a trained model's
    model.save_pretrained(folder)
    tok.save(folder)


# The work both loops must do, whoever runs it: the matmuls, attention's kernel, and the draws of
# the samples (torch.multinomial's exponential noise over the vocabulary).
ARITHMETIC = (
    "aten::mm",
    "aten::bmm",
    "aten::addmm",
    "aten::_grouped_mm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::exponential_",
)


def arithmetic_share(run) -> dict:
    """Seconds of CPU `run()` spends in ARITHMETIC's operators (self time) against its whole run
    under the profiler: the share no loop around the same arithmetic can take away."""
    from torch.profiler import profile

    with profile() as prof:
        started = time.perf_counter()
        run()
        seconds = time.perf_counter() - started
    arithmetic = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ARITHMETIC) / 1e6
    return {"seconds": seconds, "arithmetic_seconds": arithmetic, "share": arithmetic / seconds}


def picture(seed: int):
    """A random RGB picture of a size of its own."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(40, 400)), int(rng.integers(40, 400))
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def processed(pictures: list, budget: int) -> dict:
    from transformers import Gemma4ImageProcessorPil

    out = Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=pictures, return_tensors="pt")
    keep = ("pixel_values", "image_position_ids", "num_soft_tokens_per_image")
    return {k: out[k] for k in keep}


def reference_inputs(model, ids: list[int], pictures: list, budget: int) -> tuple[list[int], dict, list[int]]:
    """transformers' inputs for a prompt with one placeholder per picture: its ids with each
    placeholder placed as its processor places it, its processor's outputs for `generate`, and the
    pictures' soft-token counts."""
    if not pictures:
        return list(ids), {}, []
    e = model.args.extra
    out = processed(pictures, budget)
    counts = out.pop("num_soft_tokens_per_image").tolist()
    placed, k = [], 0
    for t in ids:
        if t == e["image_token_id"]:
            placed += [e["boi_token_id"]] + [t] * counts[k] + [e["eoi_token_id"]]
            k += 1
        else:
            placed.append(t)
    out["mm_token_type_ids"] = (torch.tensor([placed]) == e["image_token_id"]).long()
    return placed, out, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--canvases", type=int, default=2)
    p.add_argument("--canvas", type=int, default=32)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--float64", action="store_true")
    p.add_argument("--compile", action="store_true", help="ours with compile=True (warmed up alone and batched)")
    p.add_argument(
        "--cuda-graphs", action="store_true", help="ours with cuda_graphs=True (compiled; warmed up alone and batched)"
    )
    p.add_argument("--shots", type=int, default=0, help="worked examples before each question (a longer prompt)")
    p.add_argument("--images", type=int, default=0, help="pictures per prompt")
    p.add_argument("--image-budget", type=int, default=70, help="soft tokens per picture at most (its processor's)")
    p.add_argument("--vision-dim", type=int, default=64)
    p.add_argument("--vision-layers", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="also the share of each batch's time in arithmetic both do")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import DiffusionGemmaForBlockDiffusion

    tok = build_tokenizer()
    tok.fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS])
    dtype = torch.float64 if a.float64 else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "dg")
        make_checkpoint(folder, tok, a)
        (folder / "processor_config.json").write_text(
            json.dumps({"image_processor": {"max_soft_tokens": a.image_budget}})
        )
        # its grouped-matmul experts take no float64: the eager ones (the same arithmetic) there
        experts = {"experts_implementation": "eager"} if a.float64 else {}
        reference = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, dtype=dtype, **experts).eval()
        model, _ = fastdllm.load(str(folder), dtype="float32")
    model = model.to(dtype)
    model.setup_rope()
    eos = tok.eos_token_id
    model.stop_token_ids = [eos]
    shots = "".join(f"Question: what is {j} + {2 * j}? Answer: {3 * j}\n" for j in range(a.shots))
    prompts = [tok.encode(f"{shots}Question: what is {i} + {i + 3}? Answer:") for i in range(a.prompts)]
    pictures = [[picture(i * a.images + j) for j in range(a.images)] for i in range(a.prompts)]
    placeholder = [tok.token_to_id(IMAGE_TOKENS[0])] * a.images
    prompts = [placeholder + ids for ids in prompts]  # ours: one placeholder per picture
    inputs = [reference_inputs(model, ids, imgs, a.image_budget) for ids, imgs in zip(prompts, pictures)]
    placed = [ids for ids, _, _ in inputs]
    images = {"images": pictures} if a.images else {}
    gen = a.canvases * a.canvas
    config = GenerationConfig.for_model(model, gen_length=gen, max_denoising_steps=a.steps, stop_at_eos=False)
    config = config.replace(compile=a.compile, cuda_graphs=a.cuda_graphs)

    def theirs(i: int) -> tuple[torch.Tensor, dict]:
        """transformers' request i: its placed ids and its processor's outputs (computed here: its
        processor's work is part of its request, as placing is part of ours)."""
        placed, kwargs, _ = reference_inputs(model, prompts[i], pictures[i], a.image_budget)
        return torch.tensor([placed]), kwargs

    torch.manual_seed(0)
    x, kwargs = theirs(0)
    reference.generate(x, **kwargs, max_new_tokens=gen, max_denoising_steps=a.steps)  # warm-up
    answers, started = [], time.perf_counter()
    for i in range(len(prompts)):
        torch.manual_seed(i)
        x, kwargs = theirs(i)
        out = reference.generate(x, **kwargs, max_new_tokens=gen, max_denoising_steps=a.steps)
        answers.append((out.sequences[0, x.shape[1] :].tolist(), round(gen / float(out.tokens_per_forward[0]))))
    reference_seconds = time.perf_counter() - started
    # its own batch (left-padded, with an attention mask): the same forwards, its rows drawn from
    # one stream, so timed but not compared token for token
    width = max(len(ids) for ids in placed)
    padded = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in placed])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in placed])
    batch_inputs = {}
    torch.manual_seed(0)
    started = time.perf_counter()
    if a.images:
        batch_inputs = processed([p for imgs in pictures for p in imgs], a.image_budget)
        del batch_inputs["num_soft_tokens_per_image"]
        batch_inputs["mm_token_type_ids"] = (padded == tok.token_to_id(IMAGE_TOKENS[0])).long()
    reference.generate(
        padded, attention_mask=attention, max_new_tokens=gen, max_denoising_steps=a.steps, **batch_inputs
    )
    reference_batch_seconds = time.perf_counter() - started
    first = {"images": pictures[:1]} if a.images else {}
    fastdllm.generate(model, [prompts[0]], config=config.replace(seed=0), **first)  # warm-up
    if a.compile or a.cuda_graphs:  # the batch's shapes too
        fastdllm.generate(model, prompts, config=config, row_seeds=list(range(len(prompts))), **images)
    started = time.perf_counter()
    alone = [
        fastdllm.generate(
            model, [ids], config=config.replace(seed=i), **({"images": [pictures[i]]} if a.images else {})
        )
        for i, ids in enumerate(prompts)
    ]
    alone_seconds = time.perf_counter() - started
    started = time.perf_counter()
    batch = fastdllm.generate(model, prompts, config=config, row_seeds=list(range(len(prompts))), **images)
    batch_seconds = time.perf_counter() - started
    tokens = gen * len(prompts)
    result = {
        "checkpoint": dict(
            dim=a.dim,
            layers=a.layers,
            experts=a.experts,
            canvas=a.canvas,
            dtype=str(dtype),
            vision=dict(dim=a.vision_dim, layers=a.vision_layers) if a.images else None,
        ),  # fmt: skip
        "settings": dict(
            prompts=a.prompts,
            prompt_tokens=[len(ids) for ids in placed],
            images_per_prompt=a.images,
            soft_tokens_per_image=[n for _, _, counts in inputs for n in counts],
            canvases=a.canvases,
            max_denoising_steps=a.steps,
            threads=a.threads,
            cache=config.cache,
            compile=a.compile,
            cuda_graphs=a.cuda_graphs,
        ),
        "reference": {"seconds": reference_seconds, "tokens_per_s": tokens / reference_seconds},
        "reference_batched": {"seconds": reference_batch_seconds, "tokens_per_s": tokens / reference_batch_seconds},
        "ours_one_at_a_time": {"seconds": alone_seconds, "tokens_per_s": tokens / alone_seconds},
        "ours_batched": {"seconds": batch_seconds, "tokens_per_s": tokens / batch_seconds},
        "forwards_per_answer": {"reference": [f for _, f in answers], "ours": [o.nfe for o in alone]},
        "identical_answers": {
            "one_at_a_time": sum(o.sequences[0].tolist() == t for o, (t, _) in zip(alone, answers)),
            "batched": sum(batch.sequences[i].tolist() == t for i, (t, _) in enumerate(answers)),
            "of": len(prompts),
        },
    }
    if a.profile:
        result["arithmetic_share"] = {
            "reference_batched": arithmetic_share(
                lambda: reference.generate(
                    padded, attention_mask=attention, max_new_tokens=gen, max_denoising_steps=a.steps, **batch_inputs
                )
            ),
            "ours_batched": arithmetic_share(
                lambda: fastdllm.generate(model, prompts, config=config, row_seeds=list(range(len(prompts))), **images)
            ),
        }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
