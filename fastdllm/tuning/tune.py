"""`tune()`: the calibration and held-out splits, the race (`search.Race`), the held-out check and
the preset (`report`). `fastdllm tune` is its command line."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from ..config import GenerationConfig
from ..evaluation.harness import evaluate
from ..evaluation.tasks import get_task
from .search import Candidate, Race, TuneResult, candidates
from .stats import drop_interval, problems_needed

AGAINST = ("reference", "default")  # what a budget is counted from


def splits(num_docs: int, calibration: int, holdout: int, seed: int) -> tuple[list[int], list[int]]:
    """Disjoint calibration and held-out document indices, drawn with `seed`."""
    if calibration < 1:
        raise ValueError(f"limit: must be a positive number of calibration problems (got {calibration})")
    if holdout < 0:
        raise ValueError(f"holdout: must be >= 0 (got {holdout})")
    if calibration + holdout > num_docs:
        raise ValueError(f"limit: {calibration} calibration + {holdout} held-out problems exceed the task's {num_docs}")
    order = list(range(num_docs))
    random.Random(seed).shuffle(order)
    return sorted(order[:calibration]), sorted(order[calibration : calibration + holdout])


def evaluator(model, tokenizer, task, batch_size: int, data_dir=None) -> Callable:
    def run(config: GenerationConfig, indices: list[int]) -> tuple[list[dict], float]:
        res = evaluate(model, tokenizer, task, samples=indices, config=config, batch_size=batch_size, data_dir=data_dir)
        return res["samples"], res["generation_time_s"]

    return run


def tune(
    model,
    tokenizer,
    task: str,
    base: GenerationConfig,
    *,
    budget: float = 1.0,
    limit: int | None = None,
    holdout: int | None = None,
    confidence: float = 0.9,
    metric: str = "positions_per_token",
    time_budget: float | None = None,
    random_candidates: int = 16,
    fields: list[str] | None = None,
    seed: int = 0,
    batch_size: int = 16,
    data_dir=None,
    log: Callable[[str], None] = print,
    against: str = "reference",
) -> dict:
    """Tune `base` (fitted to the model) for `task`: the fastest setting whose accuracy is at most
    `budget` points below the family's reference decoding on `limit` calibration problems, at
    `confidence`, searching `fields` (default: every declared one); then checked on `holdout`
    other problems (defaults: 500 each, at most half the task's problems for calibration and the
    rest held out). `against`: what the budget is counted from: "reference" (the family's one token
    per step) or "default" (the defaults, `base`: "no worse than what I run now"). Returns the
    report (`report.preset`)."""
    from .report import preset

    task_obj = get_task(task)
    num_docs = len(task_obj.load(data_dir, None))
    limit = min(500, num_docs // 2) if limit is None else limit
    holdout = min(500, num_docs - limit) if holdout is None else holdout
    calib, held = splits(num_docs, limit, holdout, seed)
    base = GenerationConfig.for_model(model, base, checkpoint_defaults=False)
    keep = {"gen_length": base.gen_length, "block_length": base.block_length}
    # One token per step with a full refresh: for a block-causal family, with its exact cache (the
    # same tokens as no cache, and far fewer positions)
    if against not in AGAINST:
        raise ValueError(f"against: must be one of {', '.join(AGAINST)} (got {against!r})")
    reference = GenerationConfig.for_model(model, GenerationConfig.baseline(**keep), checkpoint_defaults=False)
    if against == "default":
        reference = base
    named = {"fast-dllm": GenerationConfig.fast_dllm(**keep).fit_to_model(model)}
    pool = candidates(model, base, named, random_candidates, seed, fields)
    log(
        f"tune: {task} on {len(calib)} calibration problems ({len(held)} held out), budget {budget} points at "
        f"{100 * confidence:.0f}% confidence, {len(pool)} settings, speed as {metric}"
    )
    needed = problems_needed(budget / 100, confidence)
    if needed > len(calib):
        log(
            f"tune: on {len(calib)} problems a setting is certified within {budget} points only where it "
            f"also solves problems the reference misses (without such gains it takes {needed} problems)"
        )
    run = evaluator(model, tokenizer, task, batch_size, data_dir)
    race = Race(
        run,
        reference,
        pool,
        calib,
        budget / 100,
        confidence,
        metric,
        time_budget=time_budget,
        log=log,
        reference_label=against,
    )
    result = race.run()
    deadline = None if time_budget is None else time.perf_counter() + time_budget
    held_out = check_held_out(result, run, held, pool, confidence, budget / 100, deadline, log) if held else None
    report = preset(model, task, budget, confidence, metric, seed, result, held_out)
    report["against"] = against
    return report


def check_held_out(
    result: TuneResult,
    run,
    held: list[int],
    pool: list[Candidate],
    confidence,
    budget,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
    chunk: int = 64,
) -> dict:
    """The chosen setting, the reference, the default and Fast-dLLM's, decoded side by side on
    problems the search never saw, `chunk` problems at a time until `deadline` (at least one chunk);
    the chosen one's drop there, with its bounds."""
    named = {"reference": result.reference.config, "chosen": result.chosen.config}
    for c in pool:
        if c.label in ("default", "fast-dllm"):
            named[c.label] = c.config
    decoded = {name: ([], 0.0, 0.0) for name in named}  # records, generation seconds, wall seconds
    checked: list[int] = []
    for k in range(0, len(held), chunk):
        if checked and deadline is not None and time.perf_counter() > deadline:
            log(f"tune: the time budget ran out: the held-out check read {len(checked)} of {len(held)} problems")
            break
        part = held[k : k + chunk]
        for name, config in named.items():
            t0 = time.perf_counter()
            records, seconds = run(config, part)
            before = decoded[name]
            decoded[name] = (before[0] + records, before[1] + seconds, before[2] + time.perf_counter() - t0)
        checked += part
        log(f"  held-out check: {len(checked)}/{len(held)} problems")
    rows, correct = {}, {}
    for name, (records, seconds, wall) in decoded.items():
        tokens = sum(r["num_tokens"] for r in records)
        positions = sum(r["forward_positions"] for r in records)
        correct[name] = [r["correct"] for r in sorted(records, key=lambda r: r["index"])]
        rows[name] = {
            "accuracy": sum(correct[name]) / len(records),
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "positions_per_token": positions / max(1, tokens),
            "nfe_per_sample": sum(r["nfe"] for r in records) / len(records),
            "wall_s": wall,
        }
    iv = drop_interval(correct["reference"], correct["chosen"], confidence)
    return {
        "problems": len(checked),
        "rows": rows,
        "drop": iv.drop,
        "drop_lower": iv.lower,
        "drop_upper": iv.upper,
        "exceeds_budget": iv.drop > budget,
    }
