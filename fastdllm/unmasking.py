"""Unmasking policies: given the current block's logits, which masked positions become tokens.

An `UnmaskingStrategy` is one policy, built once from a config (`UnmaskingStrategy.from_config`
reads the precedence factor > threshold > schedule in one place) and passed to the loop; a new
policy is a new strategy (or SelectionRule subclass), not edits here. Two separate choices make
a policy:

1. **Proposal and confidence** (`propose`): the token proposed for each masked position and a
   confidence score.
   - LLaDA (`alg=None`): argmax of the logits, with Gumbel-max noise in float64 when
     temperature > 0; confidence = softmax probability of the proposed token
     (`remasking='low_confidence'`) or uniform noise (`remasking='random'`).
   - Dream (`alg` = 'origin' | 'maskgit_plus' | 'topk_margin' | 'entropy'): tokens sampled from
     softmax(logits / temperature) (argmax at temperature 0, after optional top-p / top-k);
     confidence = that token's probability (maskgit_plus, and origin when combined with a
     threshold), top-1 minus top-2 probability (topk_margin), or negative entropy (entropy).
     With a threshold or factor rule the confidence is always the token's probability, whatever
     `alg` says: those rules are defined on probabilities, as in Fast-dLLM's Dream code.
2. **How many / which** (`select`):
   - `Threshold` (Fast-dLLM): every masked position with confidence >= threshold, and always at
     least the most confident one.
   - `Factor` (Fast-dLLM, Theorem 1): sort confidences c_1 >= c_2 >= ...; take the top n for the
     largest n such that c_m >= 1 - factor / (m + 1) for every m <= n, i.e. (m + 1)(1 - c_m) <=
     factor; always at least one. *Deliberate difference*: the reference code also takes every
     token when the first failing rank is the last one (an off-by-one in its loop); we take
     exactly the ranks that pass, as the paper's rule says.
   - `LinearSchedule` (LLaDA): step i of a block unmasks the k_i most confident positions, the
     block's masks split evenly over its steps, the remainder going to the first steps.
   - `DreamSchedule` (Dream): timesteps linspace(1, eps, steps + 1); step i unmasks
     int(n_masked * (1 - s / t)) positions (all of them at the last step), by top-k confidence or,
     with `alg_temp` > 0, sampled from softmax(confidence / alg_temp). With alg='origin' each
     masked position is instead revealed independently with probability 1 - s / t.
     *Deliberate difference*: Dream averages the mask count over the batch; we count per row, so
     that a row decodes the same in a batch as alone.

Ties in confidence are broken towards the leftmost position. LLaDA's confidence (the proposed
token's softmax probability) is computed in float64, as the reference does: it decides a top-k
ranking, and confident positions that tie in float32 (0.99999237 for several at once) are
ordered by their float64 values, as there. Dream's confidences are float32, as in Dream's code.
Randomness comes from one generator per row, drawn only for rows that still have masks in the
block, so batched and single runs consume identical random streams.
"""

from __future__ import annotations

import torch

from .config import DREAM_ALGS
NEG_INF = float("-inf")


# ---- proposals ---------------------------------------------------------------------------------
def _rows_rand(shape, generators, rows, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Uniform draws, row i from generators[rows[i]]. A row named None has nothing to reveal at this
    step (its block is done while other rows' are not): it draws nothing and gets 0.5, so that its
    stream advances exactly as when it is decoded alone."""
    out = torch.full((len(rows),) + tuple(shape), 0.5, dtype=dtype, device=device)
    for i, r in enumerate(rows):
        if r is not None:
            out[i] = torch.rand(shape, generator=generators[r], dtype=dtype, device=device)
    return out


def propose(logits: torch.Tensor, config, generators, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, confidence), each (B, T), for logits (B, T, V), under `config`'s strategy."""
    return UnmaskingStrategy.from_config(config).propose(logits, generators, rows)


def _propose_llada(logits, config, generators, rows):
    if config.temperature > 0:
        # Gumbel-max in float64 (LLaDA's add_gumbel_noise): argmax of exp(l) / (-log u)^temperature.
        l64 = logits.double()
        noise = _rows_rand(logits.shape[1:], generators, rows, torch.float64, logits.device)
        tokens = (l64.exp() / (-torch.log(noise)) ** config.temperature).argmax(-1)
        chosen_logit = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    else:
        chosen_logit, tokens = logits.max(-1)
    if config.remasking == "random":
        conf = _rows_rand(logits.shape[1:2], generators, rows, torch.float32, logits.device)
    else:  # float64, as the reference's softmax: it decides the ranking of near-certain positions
        conf = (chosen_logit.double() - logits.double().logsumexp(-1)).exp()
    return tokens, conf


def _filter_top_p_top_k(logits, top_p, top_k):
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), NEG_INF)
    return logits


def _propose_dream(logits, config, generators, rows, score):
    if config.temperature > 0:
        logits = logits / config.temperature
    logits = _filter_top_p_top_k(logits, config.top_p, config.top_k)
    probs = logits.softmax(-1)
    if config.temperature > 0:
        tokens = torch.stack(
            [probs[i].argmax(-1) if r is None else torch.multinomial(probs[i], 1, generator=generators[r]).squeeze(-1)
             for i, r in enumerate(rows)]
        )
        conf = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    else:
        conf, tokens = probs.max(-1)
    if score == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif score == "entropy":
        conf = (probs * torch.log(probs + 1e-10)).sum(-1)
    return tokens, conf


# ---- selection rules ---------------------------------------------------------------------------
def _ranks(conf: torch.Tensor) -> torch.Tensor:
    """Rank of each position by descending confidence (0 = most confident), leftmost first on ties."""
    order = conf.argsort(dim=-1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))


def _top_k_mask(conf: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, the k[row] most confident positions (leftmost first on ties)."""
    kmax = int(k.max()) if k.numel() else 0
    if kmax == 0:
        return torch.zeros_like(conf, dtype=torch.bool)
    if kmax == 1:  # the common one-token step: argmax already prefers the leftmost maximum
        return torch.zeros_like(conf, dtype=torch.bool).scatter_(-1, conf.argmax(-1, keepdim=True), True) & (
            k.unsqueeze(-1) >= 1
        )
    return _ranks(conf) < k.unsqueeze(-1)


class SelectionRule:
    """Decides which masked positions of a block to reveal at one step."""

    def begin_block(self, masked: torch.Tensor, steps: int, generators, rows) -> None:
        """Called when a block starts; `masked` (B, T) is the block's mask pattern."""

    def select(self, conf, masked, step, generators, rows) -> torch.Tensor:
        raise NotImplementedError


class Threshold(SelectionRule):
    def __init__(self, threshold: float):
        self.threshold = threshold

    def select(self, conf, masked, step, generators, rows):
        conf = conf.masked_fill(~masked, NEG_INF)
        chosen = masked & (conf >= self.threshold)
        best = conf.argmax(-1, keepdim=True)  # argmax returns the first maximum: leftmost on ties
        has_mask = masked.any(-1, keepdim=True)
        return chosen | (torch.zeros_like(masked).scatter_(-1, best, True) & has_mask)


class Factor(SelectionRule):
    def __init__(self, factor: float):
        self.factor = factor

    def select(self, conf, masked, step, generators, rows):
        conf = conf.masked_fill(~masked, NEG_INF)
        sorted_conf = conf.sort(dim=-1, descending=True, stable=True).values
        rank = torch.arange(1, conf.shape[-1] + 1, device=conf.device, dtype=conf.dtype)  # m = 1, 2, ...
        passes = sorted_conf >= 1 - self.factor / (rank + 1)
        passes[..., 0] = True  # always at least one
        count = passes.long().cumprod(-1).sum(-1)
        count = torch.minimum(count, masked.sum(-1))
        return _top_k_mask(conf, count) & masked


def linear_schedule(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's get_num_transfer_tokens: (B,) mask counts -> (B, steps) tokens per step."""
    base = num_masked // steps
    remainder = num_masked % steps
    counts = base.unsqueeze(-1).repeat(1, steps)
    counts += (torch.arange(steps, device=num_masked.device) < remainder.unsqueeze(-1)).long()
    return counts


class LinearSchedule(SelectionRule):
    def begin_block(self, masked, steps, generators, rows):
        self.counts = linear_schedule(masked.sum(-1), steps)
        self.steps = steps

    def select(self, conf, masked, step, generators, rows):
        k = self.counts[:, step] if step < self.steps else masked.sum(-1)
        return _top_k_mask(conf.masked_fill(~masked, NEG_INF), k) & masked


class DreamSchedule(SelectionRule):
    def __init__(self, alg: str, eps: float, alg_temp: float | None):
        self.alg, self.eps, self.alg_temp = alg, eps, alg_temp

    def begin_block(self, masked, steps, generators, rows):
        self.steps = steps
        self.timesteps = torch.linspace(1, self.eps, steps + 1, device=masked.device)

    def select(self, conf, masked, step, generators, rows):
        last = step >= self.steps - 1
        t, s = (self.timesteps[step], self.timesteps[step + 1]) if not last else (None, None)
        if self.alg == "origin":
            if last:
                return masked.clone()
            p_transfer = 1 - s / t
            u = _rows_rand(masked.shape[1:], generators, rows, torch.float32, masked.device)
            return masked & (u < p_transfer)
        n_masked = masked.sum(-1)
        k = n_masked if last else (n_masked.float() * (1 - s / t)).long()
        conf = conf.masked_fill(~masked, NEG_INF)
        if not self.alg_temp:
            return _top_k_mask(conf, k) & masked
        chosen = torch.zeros_like(masked)
        weights = (conf / self.alg_temp).softmax(-1)
        for i, r in enumerate(rows):
            if k[i] > 0 and r is not None:
                picked = torch.multinomial(weights[i], int(k[i]), replacement=False, generator=generators[r])
                chosen[i, picked] = True
        return chosen & masked


class FirstPositionAtBlockStart(SelectionRule):
    """Fast-dLLM's Dream with a block cache: the block-start forward (the one that refreshes the
    cache) reveals exactly the block's first masked position, whatever the rule; the rule decides
    the cached steps after it (a schedule counts the block-start step as its step 0)."""

    def __init__(self, inner: SelectionRule):
        self.inner = inner

    def begin_block(self, masked, steps, generators, rows):
        self.inner.begin_block(masked, steps, generators, rows)

    def select(self, conf, masked, step, generators, rows):
        if step > 0:
            return self.inner.select(conf, masked, step, generators, rows)
        first = masked.long().argmax(-1, keepdim=True)  # leftmost masked position
        return torch.zeros_like(masked).scatter_(-1, first, True) & masked.any(-1, keepdim=True)


class UnmaskingStrategy:
    """One unmasking policy: how tokens and confidences are proposed, which rule selects the
    positions to reveal, and whether it draws randomness (then each row gets a generator).

    `from_config(config, family, cached)`: for the Dream family decoding with a block cache
    (`cached`), the reference's block start is followed (`FirstPositionAtBlockStart`), as
    Fast-dLLM's Dream code does; pass another strategy to `generate` to decode otherwise."""

    def __init__(self, config, make_rule, score: str, draws_randomness: bool):
        self.config, self.make_rule, self.score, self.draws_randomness = config, make_rule, score, draws_randomness

    @classmethod
    def from_config(cls, config, family: str | None = None, cached: bool = False) -> "UnmaskingStrategy":
        strategy = cls._from_config(config)
        if family == "dream" and cached:
            inner = strategy.make_rule
            strategy.make_rule = lambda: FirstPositionAtBlockStart(inner())  # noqa: E731
        return strategy

    @classmethod
    def _from_config(cls, config) -> "UnmaskingStrategy":
        parallel = config.factor is not None or config.threshold is not None
        if config.factor is not None:
            make_rule = lambda: Factor(config.factor)  # noqa: E731
        elif config.threshold is not None:
            make_rule = lambda: Threshold(config.threshold)  # noqa: E731
        elif config.alg is None:
            make_rule = LinearSchedule
        else:
            make_rule = lambda: DreamSchedule(config.alg, config.eps, config.alg_temp)  # noqa: E731
        # Parallel decoding compares probabilities with the threshold / factor rule (Fast-dLLM's
        # Dream "confidence_threshold"): a margin or a negative entropy is on another scale (an
        # entropy score is never >= 0.9, so every step would reveal one token).
        score = "probability"
        if config.alg is not None and not parallel:
            score = {"topk_margin": "margin", "entropy": "entropy"}.get(config.alg, "probability")
        draws = (config.temperature > 0 or config.remasking == "random"
                 or (config.alg == "origin" and not parallel) or bool(config.alg_temp))
        return cls(config, make_rule, score, draws)

    def propose(self, logits: torch.Tensor, generators, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, confidence), each (B, T), for logits (B, T, V). `rows[i]` names the generator
        of batch row i, or is None for a row with nothing to reveal (it draws nothing)."""
        logits = logits.float()
        if self.config.alg is None:
            return _propose_llada(logits, self.config, generators, rows)
        return _propose_dream(logits, self.config, generators, rows, self.score)

    def new_rule(self) -> SelectionRule:
        """A fresh selection rule for one generation (rules keep per-block state)."""
        return self.make_rule()
