"""Log-likelihood of a continuation: the Monte-Carlo ELBO under a masked diffusion model, or the
exact sum of a causal pass's log-probabilities where the model has one (`loglikelihood`).

A masked diffusion LM has no left-to-right factorisation; what it offers is a lower bound on
log p(target | prefix) (the ELBO of its training objective), estimated as LLaDA's and Dream's
reference evaluation code do: for each Monte-Carlo sample, mask k of the L target tokens (k drawn
so that the batch covers 1..L evenly: one uniform draw, then stratified), predict them in one
forward, and weight the masked tokens' cross-entropy by L / k (the 1/t weighting with t = k / L).
The estimate is minus the mean over samples of that weighted sum; it converges as `mc_num` grows.
The prefix is never masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.inference_mode()
def elbo_loglikelihood(
    model, prefix: list[int], target: list[int], mc_num: int = 128, batch_size: int = 16, seed: int = 0
) -> float:
    """The ELBO estimate of log p(target | prefix), from `mc_num` masked samples in batches."""
    if not target:
        raise ValueError("target: the continuation is empty")
    if not isinstance(mc_num, int) or mc_num < 1:
        raise ValueError(f"mc_num: must be a positive integer (got {mc_num!r})")
    if not isinstance(batch_size, int) or batch_size < 1 or mc_num % batch_size:
        raise ValueError(f"batch_size: must be a positive integer dividing mc_num={mc_num} (got {batch_size!r})")
    if model.args.shifted_logits and not prefix:
        raise ValueError("prefix: a model with shifted logits (Dream) needs at least one token before the target")
    gen = torch.Generator().manual_seed(seed)
    device = model.device
    p, n = len(prefix), len(target)
    seq = torch.tensor(prefix + target, dtype=torch.long)
    tgt = torch.tensor(target, dtype=torch.long, device=device)
    total = 0.0
    for _ in range(mc_num // batch_size):
        k0 = int(torch.randint(1, n + 1, (), generator=gen))
        ks = torch.round(torch.linspace(float(k0), k0 + (batch_size - 1) * (n / batch_size), batch_size)).long()
        ks = (ks - 1) % n + 1
        x = seq.repeat(batch_size, 1)
        masked = torch.zeros(batch_size, n, dtype=torch.bool)
        for i, k in enumerate(ks.tolist()):
            masked[i, torch.randperm(n, generator=gen)[:k]] = True
        x[:, p:][masked] = model.mask_token_id
        logits = model.logits_for(x.to(device), p, p + n).float()  # (B, n, V)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.repeat(batch_size), reduction="none")
        ce = ce.view(batch_size, n) * masked.to(device)
        weight = (n / ks.to(device).float())[:, None]  # 1 / t, t = k / n
        total += float((ce * weight).sum()) / batch_size
    return -total / (mc_num // batch_size)


@torch.inference_mode()
def loglikelihood(model, prefix: list[int], target: list[int], mc_num: int = 128, batch_size: int = 16, seed: int = 0):
    """log p(target | prefix): exact where the model also runs causally (`two_passes`:
    Nemotron-Labs-Diffusion's autoregressive pass, the sum of its log-probabilities of each target
    token given the tokens before it), else the ELBO (`elbo_loglikelihood`)."""
    if not getattr(model, "two_passes", False):
        return elbo_loglikelihood(model, prefix, target, mc_num, batch_size, seed)
    if not target or not prefix:
        raise ValueError("target: the continuation is empty" if not target else "prefix: needs at least one token")
    x = torch.tensor([prefix + target], dtype=torch.long, device=model.device)
    logits = model.logits_for(x, len(prefix), len(prefix) + len(target)).float()[0]
    tgt = torch.tensor(target, dtype=torch.long, device=model.device)
    return float(logits.log_softmax(-1).gather(-1, tgt[:, None]).sum())


@torch.inference_mode()
def is_greedy(model, prefix: list[int], target: list[int]) -> bool:
    """Whether the target is the model's argmax at every position with the whole target masked (a
    model that also runs causally: given the target tokens before each, as its causal pass decodes)."""
    if getattr(model, "two_passes", False):
        x = torch.tensor([prefix + target], dtype=torch.long, device=model.device)
        logits = model.logits_for(x, len(prefix), len(prefix) + len(target))
        return logits[0].argmax(-1).tolist() == list(target)
    x = torch.tensor([prefix + [model.mask_token_id] * len(target)], dtype=torch.long, device=model.device)
    logits = model.logits_for(x, len(prefix), len(prefix) + len(target))
    return logits[0].argmax(-1).tolist() == list(target)


@torch.inference_mode()
def prefix_logprobs(model, ids: list[int], top: int = 1, extra: int = 0, batch_size: int = 16):
    """Per position j of `ids` (and `extra` positions after them): log p(token j | tokens before j)
    with every later position masked, and the `top` most likely tokens there as (id, logprob).

    This is the chain rule in left-to-right order: summed over any span [c, L) it scores the span
    given everything before it, whatever c is, which is what a caller that does not say where its
    continuation starts needs (lm-eval's `local-completions` asks the server so: echo + logprobs).
    The ELBO (`elbo_loglikelihood`) needs the split and averages over random maskings; this needs
    neither and is deterministic, at one forward per position. Position 0 has no context and gets
    None (as OpenAI's API reports it); an `extra` position's token is the argmax (max_tokens=1).
    Returns (token ids, [logprob or None], [[(id, logprob)] or None])."""
    if not ids:
        raise ValueError("prompt: empty")
    if extra not in (0, 1):
        raise ValueError(f"extra: 0 or 1 generated positions (got {extra})")
    n = len(ids) + extra
    seq = torch.tensor(list(ids) + [model.mask_token_id] * extra, dtype=torch.long)
    first = 1
    tokens, logprobs, tops = list(ids), [None], [None]
    positions = list(range(first, n))
    for lo in range(0, len(positions), batch_size):
        chunk = positions[lo : lo + batch_size]
        x = seq.repeat(len(chunk), 1)
        for r, j in enumerate(chunk):
            x[r, j:] = model.mask_token_id
        # the head over this chunk's positions only: row r needs position chunk[r]
        logits = model.logits_for(x.to(model.device), chunk[0], chunk[-1] + 1).float().log_softmax(-1)
        for r, j in enumerate(chunk):
            row = logits[r, j - chunk[0]]
            if j >= len(ids):  # a generated position: its argmax
                tok = int(row.argmax())
                tokens.append(tok)
                seq[j] = tok
            tok = tokens[j]
            logprobs.append(float(row[tok]))
            values, idx = row.topk(max(1, top))
            tops.append(list(zip(idx.tolist(), values.tolist())))
    return tokens, logprobs, tops
