"""The search: candidate settings from GenerationConfig's declarations, raced on a calibration
split against the family's reference decoding.

Successive halving with racing: every candidate decodes the first rung's problems; one whose drop
is over the budget at the stated confidence (`stats.drop_interval`) is dropped, as is every one
slower than two settings already certified within the budget (a certificate on part of the split
can fail on the rest: the two fastest certified ones go on as incumbent and backup); of the rest
the faster half (those whose observed drop is within the budget first) goes on to twice as many
problems, until the last rung decodes the whole calibration split. The chosen setting is the
fastest one certified there; when none is, the reference itself. Speed is positions per token
(machine-independent) unless told tokens/s; both are recorded.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..config import ConfigError, GenerationConfig
from ..evaluation.aup import aup
from .stats import DropInterval, drop_interval

# What "fastest" means: work per token, wall-clock speed, or d3LLM's AUP of the two-point curve
# (the reference's tokens per forward and accuracy, then the setting's; `evaluation.aup`).
METRICS = ("positions_per_token", "tokens_per_second", "aup")
# A block-causal model's cache is exact and no later block is visible to it: these fields change
# no token and little work there, so its search leaves them as its family sets them.
EXACT_CACHE_FIELDS = ("cache", "suffix_window", "refresh", "refresh_every")


@dataclass
class Candidate:
    label: str
    config: GenerationConfig
    records: dict[int, dict] = field(default_factory=dict)  # doc index -> its per-sample record
    seconds: float = 0.0  # generation time of every record so far
    status: str = "racing"
    interval: DropInterval | None = None

    def accuracy(self, indices: Sequence[int]) -> float:
        return sum(self.records[i]["correct"] for i in indices) / max(1, len(indices))

    def positions_per_token(self, indices: Sequence[int]) -> float:
        tokens = sum(self.records[i]["num_tokens"] for i in indices)
        return sum(self.records[i]["forward_positions"] for i in indices) / max(1, tokens)

    def tokens_per_second(self) -> float:
        tokens = sum(r["num_tokens"] for r in self.records.values())
        return tokens / self.seconds if self.seconds > 0 else 0.0

    def tokens_per_forward(self, indices: Sequence[int]) -> float:
        """AUP's parallelism: generated tokens per forward (NFE) of each problem, summed over them."""
        return sum(self.records[i]["num_tokens"] for i in indices) / max(
            1, sum(self.records[i]["nfe"] for i in indices)
        )

    def aup(self, reference: Candidate, indices: Sequence[int], y_max: float) -> float:
        """AUP of the curve from the reference's point to this setting's (accuracy in percent)."""
        y = [100 * reference.accuracy(indices), 100 * self.accuracy(indices)]
        rho = [reference.tokens_per_forward(indices), self.tokens_per_forward(indices)]
        return aup(rho, y, y_max)

    def cost(self, metric: str, indices: Sequence[int]) -> float:
        """Lower is faster (AUP: `Race.cost`, which compares every setting against one y_max)."""
        return self.positions_per_token(indices) if metric == "positions_per_token" else -self.tokens_per_second()

    def summary(self, indices: Sequence[int]) -> dict:
        iv = self.interval
        return {
            "label": self.label,
            "status": self.status,
            "problems": len(indices),
            "accuracy": self.accuracy(indices),
            "drop": iv.drop if iv else 0.0,
            "drop_upper": iv.upper if iv else 0.0,
            "positions_per_token": self.positions_per_token(indices),
            "tokens_per_second": self.tokens_per_second(),
            "tokens_per_forward": self.tokens_per_forward(indices),
            "config": self.config.to_dict(),
        }


# ---- the space ----------------------------------------------------------------------------------
def search_space(model, fields: Sequence[str] | None = None) -> dict[str, tuple]:
    """GenerationConfig's declared search values that make sense for this model's family;
    `fields`: only these (each must declare search values)."""
    family = getattr(model, "family", None)
    rules = family.rules if family is not None else None
    space = dict(GenerationConfig.search_space())
    if fields is not None:
        unknown = [f for f in fields if f not in space]
        if unknown:
            raise ValueError(f"search: {', '.join(unknown)} declare no search values; choose from {', '.join(space)}")
        space = {f: space[f] for f in fields}
    if model.args.block_size:
        for name in EXACT_CACHE_FIELDS:
            space.pop(name, None)
        space.pop("prefix_cache", None)  # block-causal: the shared prompt K/V are exact either way
        if rules is None or not rules.any_decoding_block:
            space.pop("block_length", None)
    if rules is None or not rules.edits:
        space.pop("editing_threshold", None)
    return space


LOOKAHEAD_FIELDS = ("block_add_threshold", "decoded_token_threshold", "lookahead_threshold")


def _normal(config: GenerationConfig, base: GenerationConfig) -> GenerationConfig:
    """Settings that decode alike made equal, so that each is tried once: without a cache the
    refresh rule does nothing, refresh_every only counts with the vicinity refresh, and the
    multi-block thresholds only with parallel_blocks > 1."""
    changes = {}
    if config.parallel_blocks == 1:
        changes.update({name: getattr(base, name) for name in LOOKAHEAD_FIELDS})
    if config.cache == "none":
        changes.update(refresh=base.refresh, refresh_every=base.refresh_every, prefix_cache=base.prefix_cache)
    elif config.refresh != "vicinity":
        changes.update(refresh_every=None)
    return config.replace(**changes) if changes else config


def _label(config: GenerationConfig, base: GenerationConfig) -> str:
    a, b = config.to_dict(), base.to_dict()
    diff = [f"{k}={a[k]}" for k in a if a[k] != b[k]]
    return ", ".join(diff) or "default"


def candidates(
    model,
    base: GenerationConfig,
    extra: dict[str, GenerationConfig],
    random_count: int = 16,
    seed: int = 0,
    fields: Sequence[str] | None = None,
) -> list[Candidate]:
    """`base` and the `extra` named settings; `base` with each searched field moved to each of
    its values; and `random_count` random combinations of the searched fields. Invalid settings
    (a block that does not divide gen_length, ...) are left out."""
    space = search_space(model, fields)
    out: dict[tuple, Candidate] = {}

    def add(label: str | None, changes: dict | GenerationConfig) -> None:
        try:
            config = changes if isinstance(changes, GenerationConfig) else base.replace(**changes)
        except ConfigError:
            return
        if model.args.block_size and config.block_length != model.args.block_size:
            family = getattr(model, "family", None)
            if family is None or not family.rules.any_decoding_block:
                return
        config = _normal(config, base)
        key = tuple(sorted(config.to_dict().items()))
        if key not in out:
            out[key] = Candidate(label or _label(config, base), config)

    add("default", {})
    for name, config in extra.items():
        add(name, config)
    for name, values in space.items():
        for v in values:
            # a multi-block threshold moves with several blocks at once, where it decodes anything
            several = name in LOOKAHEAD_FIELDS and base.parallel_blocks == 1
            add(None, {name: v, "parallel_blocks": 2} if several else {name: v})
    r = random.Random(seed)
    names = list(space)
    for _ in range(random_count):
        add(None, {n: r.choice(space[n]) for n in names})
    return list(out.values())


# ---- the race -----------------------------------------------------------------------------------
Evaluator = Callable[[GenerationConfig, list[int]], tuple[list[dict], float]]


@dataclass
class TuneResult:
    chosen: Candidate
    reference: Candidate
    candidates: list[Candidate]
    indices: list[int]  # the calibration problems the final decision read
    rungs: list[int]
    stopped_early: bool  # the time budget ran out before the last rung
    seconds: float
    kept_default: bool = False  # nothing faster than the default was certified: the default stays


class Race:
    """Successive halving with racing (module docstring). `evaluate(config, indices)` returns the
    per-sample records (index, correct, forward_positions, num_tokens) and the generation time."""

    def __init__(
        self,
        evaluate: Evaluator,
        reference: GenerationConfig,
        pool: list[Candidate],
        calibration: list[int],
        budget: float,
        confidence: float = 0.9,
        metric: str = "positions_per_token",
        rungs: int = 3,
        keep: float = 0.5,
        min_keep: int = 3,
        time_budget: float | None = None,
        log: Callable[[str], None] = lambda s: None,
        reference_label: str = "reference",
    ):
        if metric not in METRICS:
            raise ValueError(f"metric: must be one of {', '.join(METRICS)} (got {metric!r})")
        if not 0 <= budget < 1:
            raise ValueError(f"budget: must be in [0, 1) as a fraction (got {budget})")
        if not calibration:
            raise ValueError("calibration: no problems to tune on")
        self.evaluate, self.pool, self.calibration = evaluate, pool, list(calibration)
        self.reference = Candidate(reference_label, reference)
        self.budget, self.confidence, self.metric = budget, confidence, metric
        n = len(self.calibration)
        self.rungs = sorted({max(1, math.ceil(n * keep ** (rungs - 1 - k))) for k in range(rungs)})
        self.keep, self.min_keep, self.time_budget, self.log = keep, min_keep, time_budget, log
        self.t0 = time.perf_counter()
        self.stopped_early = False

    def out_of_time(self) -> bool:
        return self.time_budget is not None and time.perf_counter() - self.t0 > self.time_budget

    def decode(self, c: Candidate, indices: list[int]) -> None:
        todo = [i for i in indices if i not in c.records]
        if todo:
            records, seconds = self.evaluate(c.config, todo)
            c.records.update({r["index"]: r for r in records})
            c.seconds += seconds

    def run(self) -> TuneResult:
        racing, last = list(self.pool), []
        for k, size in enumerate(self.rungs):
            idx = self.calibration[:size]
            self.log(f"  rung {k + 1}/{len(self.rungs)}: the {self.reference.label} on {size} problems")
            self.decode(self.reference, idx)
            ref = [self.reference.records[i]["correct"] for i in idx]
            done = []
            for j, c in enumerate(racing):
                if self.out_of_time():
                    self.stopped_early = True
                    break
                self.decode(c, idx)
                self.log(
                    f"  rung {k + 1}/{len(self.rungs)}: {j + 1}/{len(racing)} settings decoded on {size} problems "
                    f"({time.perf_counter() - self.t0:.0f} s)"
                )
                c.interval = drop_interval(ref, [c.records[i]["correct"] for i in idx], self.confidence)
                if c.interval.over(self.budget):
                    c.status = f"over budget at {size} problems"
                done.append(c)
            for c in racing[len(done) :]:
                c.status = "not decoded (time budget)"
            racing = [c for c in done if c.status == "racing"]
            last = idx
            self.log(self.rung_line(k, idx, racing, done))
            racing = self.thin(racing, idx, final=k == len(self.rungs) - 1 or self.stopped_early)
            if self.stopped_early:
                break
        certified = [c for c in racing if c.interval is not None and c.interval.within(self.budget)]
        chosen = min(certified, key=lambda c: self.cost(c, last)) if certified else self.reference
        # never slower than the default the race measured (on the problems both decoded, where it
        # left the race early): with nothing faster certified, it stays
        default = next((c for c in self.pool if c.label == "default"), None)
        both = [] if default is None else [i for i in self.calibration if i in default.records and i in chosen.records]
        kept_default = bool(both) and self.cost(chosen, both) > self.cost(default, both)
        if kept_default:  # its evidence: the problems it decoded
            chosen, last = default, [i for i in last if i in default.records] or both
        chosen.status = "chosen"
        return TuneResult(
            chosen,
            self.reference,
            self.pool,
            last,
            self.rungs,
            self.stopped_early,
            time.perf_counter() - self.t0,
            kept_default,
        )

    def thin(self, racing: list[Candidate], idx: list[int], final: bool) -> list[Candidate]:
        """Racing: drop what is slower than two settings already certified (a certificate on part
        of the split can still fail on the rest, so the fastest two stay as incumbent and
        backup); halving: keep the faster part, the certified two always among it."""
        certified = sorted((c for c in racing if c.interval.within(self.budget)), key=lambda c: self.cost(c, idx))[:2]
        if len(certified) == 2:
            bar = self.cost(certified[1], idx)
            for c in racing:
                if self.cost(c, idx) > bar:
                    c.status = f"slower than two certified settings at {len(idx)} problems"
            racing = [c for c in racing if c.status == "racing"]
        if final:
            return racing
        ranked = sorted(racing, key=lambda c: (c.interval.drop > self.budget, self.cost(c, idx)))
        kept = ranked[: max(self.min_keep, math.ceil(len(ranked) * self.keep))]
        kept += [c for c in certified if c not in kept]
        for c in ranked:
            if c not in kept:
                c.status = f"cut at {len(idx)} problems (slower half)"
        return kept

    def cost(self, c: Candidate, idx: list[int]) -> float:
        """Lower is better: the metric's cost; for AUP, minus the AUP of the reference's point and
        the setting's, y_max the best accuracy of every setting decoded on these problems."""
        if self.metric != "aup":
            return c.cost(self.metric, idx)
        decoded = [x for x in (self.reference, *self.pool) if all(i in x.records for i in idx)]
        y_max = 100 * max(x.accuracy(idx) for x in decoded)
        return -c.aup(self.reference, idx, max(y_max, 1e-9))

    def rung_line(self, k: int, idx: list[int], racing: list[Candidate], done: list[Candidate]) -> str:
        ref_acc = self.reference.accuracy(idx)
        within = sum(1 for c in racing if c.interval.within(self.budget))
        return (
            f"rung {k + 1}/{len(self.rungs)}: {len(idx)} problems, reference {100 * ref_acc:.1f}%, "
            f"{len(done)} decoded, {len(done) - len(racing)} over budget, {within} certified within it "
            f"({time.perf_counter() - self.t0:.0f} s)"
        )
