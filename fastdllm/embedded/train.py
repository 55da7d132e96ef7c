"""`fastdllm train-tiny`: train the embedded default model (or its Dream-format twin) from a seed.

Objective: LLaDA's SFT recipe. The chat-formatted (possibly few-shot) prompt is never masked; the
answer, its end-of-turn token and the EOS padding that fills the rest of the generation region are
masked with ratio t ~ U(0, 1) (as p = (1 - 1e-3) t + 1e-3, LLaDA's eps), and the cross-entropy of
masked tokens is weighted by 1/p and normalised by the region's length. For the Dream twin the
prediction is shifted (the output at i-1 predicts token i), as Dream was trained.

The run is resumable: every `--save-every` steps it writes the model in its real checkpoint layout
plus the optimizer moments (safetensors) and the step; data and masks are drawn from RNGs seeded by
(seed, step), so a resumed run sees exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..evaluation.tasks import arith
from ..models import Transformer
from ..models.loading import load_model, save_pretrained
from ..text.tokenizer import Tokenizer, load_tokenizer
from . import drills, train_data
from .mixes import MIXES
from .recipe import SPECIAL_TOKENS, build_tokenizer, new_model

MASK_EPS = 1e-3


# ---- data --------------------------------------------------------------------------------------


# Share of 0-shot rows whose user message is the bare question (see arith.prompt_ids).
P_BARE_QUESTION = 0.3


def make_batch(tokenizer: Tokenizer, step: int, seed: int, token_budget: int, mix: str = "v1", max_len: int = 2048):
    """Deterministic in (seed, step): returns input ids (B, T) and the region start of each row;
    a row that would make T exceed `max_len` (the model's context) is drawn again."""
    r = random.Random(seed * 1_000_003 + step)
    eot, eos = tokenizer.token_to_id(SPECIAL_TOKENS["eot"]), tokenizer.eos_token_id
    m = MIXES[mix]
    k = 0 if r.random() < 1 - m.shots else r.randint(m.min_shots, 8)
    u = r.random()
    region = r.choice(next(lengths for cum, lengths in m.regions if u < cum))
    drill = m.drills is not None and r.random() < m.drills.share  # other mixes draw nothing here
    if m.sources is not None:
        streams = train_data.talk_streams(r)
        rows_of = lambda: train_data.talk_row(r, tokenizer, region, streams, m.sources, m.formats)  # noqa: E731
    elif drill:
        k, region = 0, 64
        # Mixes without sentence drills draw no extra random number, so their batches stay as before.
        sentence = m.drills.sentence and r.random() < m.drills.sentence
        phrasing = "sentence" if sentence else "equation"
        weighting, restate = m.drills.weighting, m.drills.restate
        stream = iter(lambda: drills.drill_problem(r, weighting=weighting, restate=restate, phrasing=phrasing), None)
    else:
        stream = arith.train_stream(r.randrange(1 << 30))
    if m.sources is None:

        def rows_of():
            shots = [next(stream) for _ in range(k)]
            p = next(stream)
            bare = not drill and k == 0 and r.random() < P_BARE_QUESTION
            return arith.prompt_ids(tokenizer, p.question, shots, bare=bare), tokenizer.encode(
                p.answer, add_special_tokens=False
            ) + [eot]

    rows = []
    redrawn = 0
    while True:
        drawn = rows_of()
        drawn = drawn if isinstance(drawn, list) else [drawn]  # a pair stays together
        drawn = [(pids, aids, max(region, len(aids) + 1)) for pids, aids in drawn]
        if max(len(p) for p, _, _ in rows + drawn) + max(n for *_, n in rows + drawn) > max_len:
            redrawn += 1
            if redrawn > 1000:
                raise ValueError(f"max_len: {max_len} tokens cannot hold the {mix!r} mix's rows")
            continue
        rows += drawn
        longest = max(len(a) for a, _, _ in rows) + max(n for *_, n in rows)
        if longest * (len(rows) + 1) > token_budget or len(rows) >= 256:
            break
    total = max(len(pids) for pids, _, _ in rows) + max(n for *_, n in rows)
    ids = torch.full((len(rows), total), eos, dtype=torch.long)
    starts = torch.empty(len(rows), dtype=torch.long)
    for i, (pids, aids, _) in enumerate(rows):
        ids[i, : len(pids)] = torch.tensor(pids)
        ids[i, len(pids) : len(pids) + len(aids)] = torch.tensor(aids)
        starts[i] = len(pids)
    return ids, starts


def sft_loss(
    model: Transformer, ids: torch.Tensor, starts: torch.Tensor, gen: torch.Generator, editing_noise: float = 0.0
) -> torch.Tensor:
    """LLaDA's SFT objective: the answer region masked at a ratio t per row, the masked tokens'
    cross-entropy weighted 1/t and normalised by the region length. A block-causal model sees the
    noisy sequence beside the clean one (`block_diffusion_logits`).

    `editing_noise` adds the token-to-token objective that LLaDA2.1's editing decodes with: that
    share of the answer's unmasked tokens is replaced by tokens drawn uniformly from the vocabulary
    (the random corruptions its released recipe trains on), and every unmasked answer position,
    corrupted or not, is also trained to give the clean token (cross-entropy normalised by the
    region length, no 1/t weight). A model trained on masks alone has untrained outputs at
    revealed positions, so editing rewrites them with noise; this teaches it to keep a right token
    and restore a wrong one. LLaDA2.1's exact mixture of the two objectives is not published in
    code we could read: this is our reading of it."""
    bsz, total = ids.shape
    pos = torch.arange(total, device=ids.device).expand(bsz, total)
    region = pos >= starts[:, None]
    # t ~ U(0, 1) for every row, stratified across the batch (one row per interval of width 1/B, in
    # random order): each row's t is still uniform, so the objective is LLaDA's, but a batch never
    # draws all-small or all-large ratios, which lowers the variance of the 1/t-weighted loss.
    t = (torch.randperm(bsz, generator=gen) + torch.rand(bsz, generator=gen)) / bsz
    p_mask = ((1 - MASK_EPS) * t + MASK_EPS).to(ids.device)
    masked = region & (torch.rand(bsz, total, generator=gen).to(ids.device) < p_mask[:, None])
    noisy = torch.where(masked, torch.full_like(ids, model.mask_token_id), ids)
    visible = region & ~masked if editing_noise else torch.zeros_like(masked)
    if editing_noise:
        corrupt = visible & (torch.rand(bsz, total, generator=gen).to(ids.device) < editing_noise)
        vocab = model.args.vocab_size
        drawn = torch.randint(0, vocab - 1, (bsz, total), generator=gen).to(ids.device)
        drawn = drawn + (drawn >= model.mask_token_id).long()  # any token but the mask
        noisy = torch.where(corrupt, drawn, noisy)
    if model.args.block_size:
        logits = block_diffusion_logits(model, noisy, ids, pos)
    else:
        logits = model(noisy)
        if model.args.shifted_logits:  # output at i-1 predicts token i
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    token_loss = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none")
    region_len = (total - starts).float()
    weights = (1.0 / p_mask[:, None] / region_len[:, None]).expand(bsz, total)[masked]
    loss = (token_loss * weights).sum() / bsz
    if editing_noise:
        kept = F.cross_entropy(logits[visible].float(), ids[visible], reduction="none")
        loss = loss + (kept / region_len[:, None].expand(bsz, total)[visible]).sum() / bsz
    return loss


# Share of rows trained with a self-conditioning signal (the rest with none, as a canvas's first step).
P_SELF_CONDITIONING = 0.5


def renoising_loss(
    model: Transformer, ids: torch.Tensor, starts: torch.Tensor, gen: torch.Generator, eot_id: int
) -> torch.Tensor:
    """A denoising objective for a family with no mask token (DiffusionGemma), as it decodes: a
    canvas of `canvas_length` answer positions (the one holding a part of the answer or its end,
    chosen per row) follows the clean prompt and the clean canvases before it; each of its positions
    is replaced by a uniformly drawn token with probability t ~ U(0, 1) (stratified across the
    batch), and the model, reading the prompt as its encoder does and the canvas as its decoder
    does, is trained to give the clean token at every canvas position (cross-entropy, the mean over
    the canvas, then over rows), since decoding keeps its accepted samples and renoises the rest.
    For `P_SELF_CONDITIONING` of the rows, the canvas first goes through the model without a
    signal (no gradient), and those logits are its self-conditioning signal in the trained forward
    (per-example self-conditioning, which transformers' `self_conditioning_mask` is for).
    DiffusionGemma's own training recipe is not published in code we could read: this is our
    reading of its decoding, without the encoder's autoregressive loss."""
    canvas = model.args.extra["canvas_length"]
    vocab = model.args.vocab_size
    bsz, total = ids.shape
    t = (torch.randperm(bsz, generator=gen) + torch.rand(bsz, generator=gen)) / bsz
    conditioned = torch.rand(bsz, generator=gen) < P_SELF_CONDITIONING
    rows, windows, clean = [], [], []
    for i in range(bsz):
        s = int(starts[i])
        ends = ((ids[i, s:] == eot_id) | (ids[i, s:] == model.args.eos_token_id)).nonzero()
        answer = int(ends[0]) + 1 if len(ends) else total - s
        k = int(torch.randint(0, (answer - 1) // canvas + 1, (1,), generator=gen))
        lo = s + k * canvas
        row = F.pad(ids[i, : lo + canvas], (0, max(0, lo + canvas - total)), value=model.args.eos_token_id)
        target = row[lo:].clone()
        noise = torch.randint(0, vocab, (canvas,), generator=gen)
        row[lo:] = torch.where(torch.rand(canvas, generator=gen) < t[i], noise.to(row.device), target)
        rows.append(row)
        clean.append(target)
        windows.append((i, 0, lo + canvas, lo + canvas, lo))
    x = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=model.args.eos_token_id)
    embeds = None
    if bool(conditioned.any()):
        with torch.no_grad():
            first = model.packed_logits(x, [w for w in windows if conditioned[w[0]]])
        embeds = {
            w[0]: (torch.arange(w[4], w[2], device=x.device), model.soft_input(logits))
            for w, logits in zip((w for w in windows if conditioned[w[0]]), first)
        }
    logits = model.packed_logits(x, windows, embeds=embeds)
    losses = [F.cross_entropy(out.float(), target) for out, target in zip(logits, clean)]
    return torch.stack(losses).mean()


# The draft blocks a two-pass model learns to fill: LinearSpec's and the diffusion mode's lengths.
DRAFT_LENGTHS = (4, 8, 16, 32)


def two_pass_loss(model: Transformer, ids: torch.Tensor, starts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """An objective for a model that decodes both causally and bidirectionally with the same weights
    (Nemotron-Labs-Diffusion): the answer's next-token cross-entropy from a causal pass, plus a
    block's: per row a block of a length drawn from `DRAFT_LENGTHS` opening at a random answer
    position, its first token clean and each of the others masked with probability t ~ U(0, 1)
    (stratified across the batch), the block bidirectional against the causal prefix as its
    decoding modes see it, its masked tokens' cross-entropy weighted 1/t over the block length.
    Its published recipe trains a block-diffusion objective beside the autoregressive one in
    code we could not read: this is our reading of what its decoders need."""
    bsz, total = ids.shape
    pos = torch.arange(total, device=ids.device).expand(bsz, total)
    causal = (pos[0][None, :] <= pos[0][:, None])[None, None]
    logits = model.head(model.hidden(ids, pos, causal))
    region = (pos >= starts[:, None])[:, 1:]
    ar = F.cross_entropy(logits[:, :-1][region].float(), ids[:, 1:][region])
    t = (torch.randperm(bsz, generator=gen) + torch.rand(bsz, generator=gen)) / bsz
    p_mask = ((1 - MASK_EPS) * t + MASK_EPS).to(ids.device)
    length = DRAFT_LENGTHS[int(torch.randint(len(DRAFT_LENGTHS), (1,), generator=gen))]
    lo = starts + (torch.rand(bsz, generator=gen) * (total - starts - 1).clamp_min(1)).long().to(ids.device)
    hi = (lo + length).clamp_max(total)
    block = (pos >= lo[:, None]) & (pos < hi[:, None])
    masked = block & (pos > lo[:, None]) & (torch.rand(bsz, total, generator=gen).to(ids.device) < p_mask[:, None])
    noisy = torch.where(masked, torch.full_like(ids, model.mask_token_id), ids)
    q, k = pos[:, :, None], pos[:, None, :]
    allowed = torch.where(block[:, :, None], k < hi[:, None, None], k <= q)
    draft = model.head(model.hidden(noisy, pos, allowed[:, None]))
    token_loss = F.cross_entropy(draft[masked].float(), ids[masked], reduction="none")
    weights = (1.0 / p_mask[:, None] / length).expand(bsz, total)[masked]
    return ar + (token_loss * weights).sum() / bsz


def batch_loss(model, tokenizer, ids, starts, gen, editing_noise: float = 0.0) -> torch.Tensor:
    """The family's objective on a batch: denoising uniform noise for a family with no mask token
    (`renoising_loss`), both passes' for a model that decodes both ways (`two_pass_loss`), else
    LLaDA's SFT objective (`sft_loss`)."""
    if model.two_passes:
        return two_pass_loss(model, ids, starts, gen)
    if model.family.rules.noise_canvas:
        return renoising_loss(model, ids, starts, gen, tokenizer.token_to_id(SPECIAL_TOKENS["eot"]))
    return sft_loss(model, ids, starts, gen, editing_noise)


def block_diffusion_logits(
    model: Transformer, noisy: torch.Tensor, clean: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """The block-diffusion objective's forward (BD3-LM's, as SDAR and Fast-dLLM v2 train): the noisy
    sequence and the clean one side by side, 2T positions with the same RoPE positions. A noisy
    position of block b attends to the noisy positions of its own block and to the clean positions
    of earlier blocks; a clean position attends block-causally to the clean ones. So every block
    learns to be denoised from a clean past, as decoding sees it, in one forward. Returns the noisy
    half's logits."""
    if model.args.shifted_logits:
        raise ValueError("arch: block-diffusion training of a shifted model is not implemented")
    total = noisy.shape[1]
    block = torch.arange(total, device=noisy.device) // model.args.block_size
    qb, kb = block[:, None], block[None, :]
    allowed = torch.cat(
        [
            torch.cat([qb == kb, kb < qb], 1),  # noisy queries: own block noisy, past clean
            torch.cat([torch.zeros_like(qb == kb), kb <= qb], 1),
        ],
        0,
    )  # clean: block-causal
    h = model.hidden(torch.cat([noisy, clean], 1), torch.cat([pos, pos], 1), allowed[None, None])
    return model.head(h[:, :total])


def lr_at(step: int, total: int, peak: float, warmup: int, decay_frac: float) -> float:
    """Warmup, hold, then a cosine decay over the last `decay_frac` of training (the decay phase
    was worth ~25 points of accuracy in our prototypes)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_start = int(total * (1 - decay_frac))
    if step < decay_start:
        return peak
    progress = (step - decay_start) / max(1, total - decay_start)
    return peak * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---- checkpoints -------------------------------------------------------------------------------
def save_checkpoint(out: Path, model, tokenizer, opt, step: int, meta: dict) -> None:
    ckpt = out / "checkpoint"
    tmp = out / "checkpoint.tmp"
    save_pretrained(model, tmp, tokenizer, dtype=torch.float32)
    state = {}
    for i, p in enumerate(model.parameters()):
        s = opt.state.get(p)
        if s:
            state[f"{i}.exp_avg"] = s["exp_avg"]
            state[f"{i}.exp_avg_sq"] = s["exp_avg_sq"]
    save_file(state, str(tmp / "optimizer.safetensors"))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **meta}, indent=2))
    if ckpt.exists():
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    tmp.rename(ckpt)


def load_checkpoint(ckpt: Path, model, opt) -> int:
    loaded = load_model(ckpt, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    state = load_file(str(ckpt / "optimizer.safetensors"))
    step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
    for i, p in enumerate(model.parameters()):
        if f"{i}.exp_avg" in state:
            opt.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": state[f"{i}.exp_avg"],
                "exp_avg_sq": state[f"{i}.exp_avg_sq"],
            }
    return step


def transplant_weights(model: Transformer, source: Transformer, sample: torch.Tensor | None = None) -> None:
    """Start `model` from `source`'s weights, also across families (a LLaDA model into a Dream twin).

    Every tensor is copied by name; separate q/k/v projections are stacked into a fused one. Where
    the target has fewer key/value heads, each group of source heads that will share one is
    mean-pooled into it (the GQA "uptraining" conversion of Ainslie et al., 2023; query head i reads
    key/value head i // group, as SDPA's enable_gqa does); biases the source lacks are set to zero,
    q/k norms to one. A dense source's MLPs become a mixture-of-experts target's experts: whole, as
    its shared expert, when that is as wide (sparse upcycling, Komatsuzaki et al., 2023; its routed
    experts add nothing until trained), or split between the shared and the routed experts
    (`split_upcycle`, which reads the MLPs' activations on the token ids `sample`). What does not
    carry over is the Dream twin's shifted prediction, the block-diffusion twin's q/k norms and
    block-causal attention, or the experts' routing: that is what their training then has to learn.
    """
    if model.args.dim != source.args.dim or model.args.n_layers != source.args.n_layers:
        raise ValueError("init_from: the model sizes differ (dim and n_layers must match)")
    src = dict(source.state_dict())
    upcycled = set()
    moe_layers = [i for i in range(model.args.n_layers) if model.args.is_moe_layer(i)]
    split = (
        bool(moe_layers) and not source.args.n_experts and model.args.shared_expert_hidden_dim != source.args.hidden_dim
    )
    if split:
        if sample is None:
            raise ValueError("init_from: splitting a dense MLP into experts needs sample token ids")
        src.update(split_upcycle(model.args, source, sample))
    elif moe_layers and not source.args.n_experts:
        # Sparse upcycling: a dense layer's MLP becomes the shared expert; the routed experts start
        # with a zero output projection, so the model computes exactly the source's function and
        # training grows the experts from there.
        for i in moe_layers:
            for w in ("w1", "w2", "w3"):
                src[f"layers.{i}.feed_forward.shared.{w}.weight"] = src[f"layers.{i}.feed_forward.{w}.weight"]
            upcycled |= {f"layers.{i}.feed_forward.{w}" for w in ("w1", "w2", "w3", "router.weight")}
    for i in range(model.args.n_layers):
        qkv = [src.get(f"layers.{i}.attention.{w}.weight") for w in ("wq", "wk", "wv")]
        if all(w is not None for w in qkv):
            src[f"layers.{i}.attention.wqkv.weight"] = torch.cat(qkv)
    head_dim = model.args.head_dim
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in upcycled:
                if name.endswith("w2"):
                    param.zero_()
                continue  # the routed experts and the router keep their fresh initialisation
            if name not in src:
                if name.endswith("bias"):
                    param.zero_()  # a bias the source lacks: zero keeps the source's function
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.fill_(1.0)  # a q/k norm the source lacks (Qwen3): its own init, learnt in training
                else:
                    raise ValueError(f"init_from: the source has no weight {name}")
                continue
            w = src[name]
            if w.shape != param.shape and name.endswith(("wk.weight", "wv.weight")):
                groups = source.args.n_kv_heads // model.args.n_kv_heads
                w = w.view(model.args.n_kv_heads, groups, head_dim, -1).mean(1).reshape(param.shape)
            if w.shape != param.shape:
                raise ValueError(f"init_from: {name} has shape {tuple(w.shape)}, expected {tuple(param.shape)}")
            param.copy_(w)


def split_upcycle(args, source: Transformer, sample: torch.Tensor, iters: int = 10) -> dict[str, torch.Tensor]:
    """The expert weights of `args`' mixture layers carved out of `source`'s dense MLPs, by name.

    The hidden units of each MLP are ranked by importance on `sample` (mean |activation| times the
    norm of the unit's output column); the most important `shared_expert_hidden_dim` become the
    shared expert. The rest are grouped by co-activation into `n_experts` experts of
    `moe_hidden_dim` units (balanced k-means on the units' |activation| profiles, MoEfication's
    construction, Zhang et al., 2022), and each expert's router row is the mean gate vector of its
    units, scaled to logits of unit spread. The output projections of the routed experts are scaled
    by k / `routed_scaling`, so that with equal router scores the k chosen experts add exactly
    their units' share of the dense MLP. The function is not kept whole (a token reaches only its
    chosen experts' units): training has to recover it, and so the routed experts carry part of
    what the model computes."""
    e, width, shared = args.n_experts, args.moe_hidden_dim, args.shared_expert_hidden_dim
    if shared + e * width != source.args.hidden_dim:
        raise ValueError(
            f"init_from: the shared ({shared}) and routed ({e} x {width}) experts' widths must add up "
            f"to the source MLP's {source.args.hidden_dim}"
        )
    inputs = {}
    hooks = [
        layer.feed_forward.register_forward_pre_hook(lambda mod, a, i=i: inputs.__setitem__(i, a[0].detach()))
        for i, layer in enumerate(source.layers)
        if args.is_moe_layer(i)
    ]
    with torch.no_grad():
        source(sample)
    for h in hooks:
        h.remove()
    out = {}
    gen = torch.Generator().manual_seed(0)
    for i, x in inputs.items():
        mlp = source.layers[i].feed_forward
        x = x.reshape(-1, x.shape[-1]).float()
        w1, w3, w2 = mlp.w1.weight.float(), mlp.w3.weight.float(), mlp.w2.weight.float()
        act = (F.silu(x @ w1.T) * (x @ w3.T)).abs()  # (tokens, hidden)
        rank = (act.mean(0) * w2.norm(dim=0)).argsort(descending=True)
        top, rest = rank[:shared], rank[shared:]
        profile = F.normalize(act[:, rest].T, dim=1)  # (units, tokens)
        centroids = profile[torch.randperm(len(rest), generator=gen)[:e]]
        for _ in range(iters):
            assign = _balanced_assign(profile @ centroids.T, width)
            centroids = F.normalize(torch.stack([profile[assign == j].mean(0) for j in range(e)]), dim=1)
        experts = [rest[assign == j] for j in range(e)]
        pre = f"layers.{i}.feed_forward"
        out[f"{pre}.shared.w1.weight"], out[f"{pre}.shared.w3.weight"] = w1[top], w3[top]
        out[f"{pre}.shared.w2.weight"] = w2[:, top]
        out[f"{pre}.w1"] = torch.stack([w1[u] for u in experts])
        out[f"{pre}.w3"] = torch.stack([w3[u] for u in experts])
        out[f"{pre}.w2"] = torch.stack([w2[:, u] for u in experts]) * (args.n_active_experts / args.routed_scaling)
        router = torch.stack([w1[u].mean(0) for u in experts])
        out[f"{pre}.router.weight"] = router / (x @ router.T).std().clamp_min(1e-6)
    return out


def _balanced_assign(similarity: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each row (unit) to a column (expert), best similarity first, no column over `capacity`."""
    n, e = similarity.shape
    assign = torch.full((n,), -1, dtype=torch.long)
    load = [0] * e
    for flat in similarity.flatten().argsort(descending=True).tolist():
        unit, expert = divmod(flat, e)
        if assign[unit] < 0 and load[expert] < capacity:
            assign[unit] = expert
            load[expert] += 1
    return assign


# Speed of the expert-bias balancing (DeepSeek-V3's bias update speed).
BIAS_UPDATE_SPEED = 1e-3


def balance_experts(model: Transformer, speed: float = BIAS_UPDATE_SPEED) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3's, which LLaDA2's `expert_bias` serves): after
    a step, each layer's bias rises by `speed` for the experts chosen less often than average in that
    step's forward and falls for those chosen more; the bias moves choices only, never weights."""
    with torch.no_grad():
        for layer in model.layers:
            moe = getattr(layer, "feed_forward", None)  # DiffusionGemma's layers route without a bias
            if hasattr(moe, "expert_bias") and getattr(moe, "load", None) is not None:
                load = moe.load.float()
                moe.expert_bias += speed * torch.sign(load.mean() - load)
                moe.load = None


TRAINABLE = ("all", "experts")


def trainable_parameters(model: Transformer, which: str) -> list[torch.nn.Parameter]:
    """The parameters a run updates; the rest are frozen (requires_grad False).

    "experts" trains a mixture's routed experts and routers only: upcycled from a finished dense
    model (`transplant_weights`), whose function the shared experts and attention keep exactly, the
    routed experts are then the only place new data can go, so they have to matter, and what the
    dense model knew is not unlearnt (the failure of fine-tuning the whole small model on new data,
    docs/training-notes.md)."""
    if which not in TRAINABLE:
        raise ValueError(f"trainable: {which!r} is not one of {', '.join(TRAINABLE)}")
    if which == "all":
        return list(model.parameters())
    if not model.args.n_experts:
        raise ValueError("trainable: 'experts' needs a mixture-of-experts arch (it has no routed experts)")
    routed = re.compile(r"layers\.\d+\.feed_forward\.(w1|w2|w3|router\.weight)$")
    chosen = []
    for name, p in model.named_parameters():
        p.requires_grad_(bool(routed.match(name)))
        if p.requires_grad:
            chosen.append(p)
    return chosen


# ---- evaluation during training ----------------------------------------------------------------
def heldout_accuracy(model, tokenizer, n: int, chat_template: bool = True, **config) -> dict:
    """Accuracy and NFE on the first `n` held-out arith problems, through `fastdllm.evaluation.harness`
    (the one arith evaluator), 0-shot, batches of 16; with `chat_template=False` as plain prompts
    (`fastdllm eval --no-chat-template`)."""
    from ..config import GenerationConfig
    from ..evaluation.harness import evaluate  # lazy: the engine and the harness sit above this module

    t0, was_training = time.time(), model.training
    model.eval()
    try:
        config = GenerationConfig.for_model(model, GenerationConfig(**config), **config)  # what its family needs
        r = evaluate(
            model, tokenizer, "arith", limit=n, num_fewshot=0, config=config, batch_size=16, chat_template=chat_template
        )
    finally:
        model.train(was_training)
    return {"accuracy": r["accuracy"], "nfe_per_sample": r["nfe_per_sample"], "eval_seconds": time.time() - t0}


# ---- main --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainSettings:
    """One training run (`fastdllm train-tiny` has a flag for each field)."""

    out: str  # run folder: checkpoint/, final/, train_log.jsonl
    arch: str = "llada"
    preset: str | None = None  # model size (default: the arch's)
    steps: int = 3600
    lr: float = 2e-3
    warmup: int = 100
    decay_frac: float = 0.4
    token_budget: int = 8192  # tokens per batch
    data_mix: str = "v1"  # the training data (`embedded.mixes.MIXES`)
    seed: int = 0
    device: str = "cpu"
    threads: int = 0  # 0: torch's default
    log_every: int = 10
    save_every: int = 100
    eval_every: int = 200
    eval_n: int = 64
    eval_plain: bool = False  # also evaluate plain prompts (no chat template) at each evaluation
    eval_block_length: int = (
        32  # the block length held-out answers are decoded in (families without blocks of their own)
    )
    keep_best: bool = False  # save OUT/best at the evaluation whose lowest accuracy (chat, plain) is highest
    resume: bool = False  # continue from OUT/checkpoint if present
    init_from: str | None = None  # start from this model folder's weights and tokenizer
    tokenizer_corpus: str = "arith"  # what a fresh run's BPE is trained on (embedded.TOKENIZER_CORPORA)
    vocab_size: int = 1024  # a fresh run's BPE vocabulary, special tokens included
    trainable: str = "all"  # "experts": only the routed experts and their routers learn (see trainable_parameters)
    editing_noise: float = 0.0  # share of unmasked answer tokens corrupted for the token-to-token objective (sft_loss)
    average_of: str | None = None  # comma-separated model folders: OUT/final is their weights' mean, no training
    command_line: str = ""  # recorded in the checkpoint's metadata


def _evaluate(model, tokenizer, n: int, chat_template: bool = True, block_length: int = 32) -> dict:
    """The run's held-out measure: 128-token answers at threshold 0.9, with the dual cache over
    blocks of `block_length` for a family without blocks of its own; for a family with no mask
    token, one canvas decoded as its published decoding does."""
    if model.family.rules.noise_canvas:
        config = {"gen_length": model.args.extra["canvas_length"]}
    elif model.args.block_size:
        config = {"gen_length": 128, "threshold": 0.9}
    else:
        config = {"gen_length": 128, "threshold": 0.9, "block_length": block_length, "cache": "dual"}
    try:
        return heldout_accuracy(model, tokenizer, n, chat_template=chat_template, **config)
    except Exception as e:  # the engine may be absent in a partial install: log, keep training
        return {"eval_error": f"{type(e).__name__}: {e}"}


def average_weights(folders: list[str], out: Path) -> Path:
    """A uniform model soup (Wortsman et al., 2022): `out`/final holds the element-wise mean, in
    float32, of the weights of `folders`, runs of one architecture fine-tuned from a shared start;
    the first folder's tokenizer and config go with it, saved in bfloat16 like a run's final weights."""
    if len(folders) < 2:
        raise ValueError(f"average_of: needs at least two model folders (got {', '.join(folders) or 'none'})")
    model = load_model(folders[0], dtype=torch.float32)
    total = {k: v.clone() for k, v in model.state_dict().items()}
    for folder in folders[1:]:
        other = load_model(folder, dtype=torch.float32)
        if other.args != model.args:
            raise ValueError(f"average_of: {folder} is not the architecture of {folders[0]}")
        for k, v in other.state_dict().items():
            total[k] += v
    model.load_state_dict({k: v / len(folders) for k, v in total.items()})
    return save_pretrained(model, out / "final", load_tokenizer(folders[0]), dtype=torch.bfloat16, remote_code=False)


def train(args: TrainSettings) -> Path:
    if args.average_of is not None:
        return average_weights([f for f in args.average_of.split(",") if f], Path(args.out))
    if not 0.0 <= args.editing_noise < 1.0:
        raise ValueError(f"editing_noise: must be in [0, 1) (got {args.editing_noise!r})")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    if args.resume and ckpt.is_dir():
        tokenizer = load_tokenizer(ckpt)
    elif args.init_from:
        tokenizer = load_tokenizer(args.init_from)
    else:
        tokenizer = build_tokenizer(args.vocab_size, seed=args.seed, corpus=args.tokenizer_corpus)
    model = new_model(args.arch, args.preset or args.arch, tokenizer, seed=args.seed).to(args.device)
    params = trainable_parameters(model, args.trainable)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = 0
    if args.resume and ckpt.is_dir():
        step = load_checkpoint(ckpt, model, opt)
        print(f"resumed from {ckpt} at step {step}", flush=True)
    elif args.init_from:
        # Continue training a finished model (e.g. the shipped one) with a fresh optimizer and schedule.
        sample, _ = make_batch(tokenizer, 0, args.seed, args.token_budget, args.data_mix, model.args.max_seq_len)
        transplant_weights(model, load_model(args.init_from, dtype=torch.float32), sample)
        print(f"initialised weights from {args.init_from}", flush=True)
    best = out / "best" / "trainer_state.json"
    best_score = json.loads(best.read_text())["score"] if args.resume and best.is_file() else -1.0
    log = (out / "train_log.jsonl").open("a")
    model.train()
    t_start, tokens = time.time(), 0
    meta = {
        "command": args.command_line,
        "arch": args.arch,
        "preset": args.preset or args.arch,
        "seed": args.seed,
        "data_mix": args.data_mix,
    }
    while step < args.steps:
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.decay_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, starts = make_batch(tokenizer, step, args.seed, args.token_budget, args.data_mix, model.args.max_seq_len)
        gen = torch.Generator().manual_seed(args.seed * 7919 + step)
        loss = batch_loss(model, tokenizer, ids.to(args.device), starts.to(args.device), gen, args.editing_noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balance_experts(model)
        step += 1
        tokens += ids.numel()
        if step % args.log_every == 0:
            rec = {
                "step": step,
                "loss": round(loss.item(), 4),
                "lr": lr,
                "tokens": tokens,
                "elapsed_s": round(time.time() - t_start, 1),
            }
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(out, model, tokenizer, opt, step, meta)
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            blocks = args.eval_block_length
            rec = {"step": step, "heldout": _evaluate(model, tokenizer, args.eval_n, block_length=blocks)}
            if args.eval_plain:
                rec["heldout_plain"] = _evaluate(
                    model, tokenizer, args.eval_n, chat_template=False, block_length=blocks
                )
            score = min(r.get("accuracy", -1.0) for k, r in rec.items() if k.startswith("heldout"))
            if args.keep_best and score > best_score:
                best_score = score
                save_pretrained(model, out / "best", tokenizer, dtype=torch.bfloat16, remote_code=False)
                best.write_text(json.dumps({"step": step, "score": score, **meta}, indent=2))
                rec["best"] = True
            rec["elapsed_s"] = round(time.time() - t_start, 1)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
    final = out / "final"
    save_pretrained(model, final, tokenizer, dtype=torch.bfloat16, remote_code=False)  # the embedded assets
    return final
