"""Paired statistics for an accuracy drop: a setting and the reference answer the same problems.

Each problem falls in one of four cells: both right, both wrong, a regression (the reference right,
the setting wrong) or a gain. The drop in accuracy is r - g, with r and g the two discordant cells'
probabilities. `drop_interval` bounds it at a stated confidence with exact (Clopper-Pearson) bounds
on r and g, each at half the error rate (Bonferroni): the upper bound is U(r) - L(g), the lower bound
L(r) - U(g). Unlike a bootstrap, or McNemar's test conditioned on the discordant count, it does
not read "no regressions seen" as "no regressions": with none in n problems the upper bound is
1 - (alpha / 2) ** (1 / n), about 3 / n at 90 %, so a budget of one point needs some 300 clean
problems. The bound is one-sided, as the question is: a setting whose true drop exceeds the budget
is certified within it at most a share 1 - confidence of the time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    # log P(X = i), from P(X = 0) by the ratio of successive terms
    step, t = math.log(p) - math.log1p(-p), n * math.log1p(-p)
    logs = [t]
    for i in range(k):
        t += math.log(n - i) - math.log(i + 1) + step
        logs.append(t)
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


def upper_bound(k: int, n: int, alpha: float) -> float:
    """The exact one-sided upper bound on a binomial probability after k successes in n trials:
    the p at which k or fewer successes have probability alpha."""
    if n == 0 or k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(48):  # 2**-48: far below any rate a test set can show
        mid = (lo + hi) / 2
        if _binom_cdf(k, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def lower_bound(k: int, n: int, alpha: float) -> float:
    """The exact one-sided lower bound: the p at which k or more successes have probability alpha."""
    if n == 0 or k <= 0:
        return 0.0
    return 1.0 - upper_bound(n - k, n, alpha)


@dataclass(frozen=True)
class DropInterval:
    n: int
    regressions: int  # the reference right, the setting wrong
    gains: int  # the reference wrong, the setting right
    drop: float  # reference accuracy - setting accuracy, in [-1, 1]
    lower: float
    upper: float
    confidence: float

    def within(self, budget: float) -> bool:
        """Certified: the drop is at most `budget` at the stated confidence."""
        return self.upper <= budget

    def over(self, budget: float) -> bool:
        """Clearly over: the drop exceeds `budget` at the stated confidence."""
        return self.lower > budget


def drop_interval(reference: Sequence[bool], setting: Sequence[bool], confidence: float = 0.9) -> DropInterval:
    """The accuracy drop of `setting` against `reference` on the same problems (paired), with its
    one-sided bounds at `confidence` (see the module docstring). Drops are fractions (0.01: a point)."""
    if len(reference) != len(setting):
        raise ValueError("reference and setting must score the same problems")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence: must be in [0.5, 1) (got {confidence})")
    n = len(reference)
    r = sum(1 for a, b in zip(reference, setting) if a and not b)
    g = sum(1 for a, b in zip(reference, setting) if b and not a)
    half = (1 - confidence) / 2
    if n == 0:
        return DropInterval(0, 0, 0, 0.0, -1.0, 1.0, confidence)
    upper = upper_bound(r, n, half) - lower_bound(g, n, half)
    lower = lower_bound(r, n, half) - upper_bound(g, n, half)
    return DropInterval(n, r, g, (r - g) / n, lower, upper, confidence)


def problems_needed(budget: float, confidence: float = 0.9) -> int:
    """The fewest problems on which a setting with no regressions at all is certified within
    `budget` (a fraction): below it, no setting can be."""
    if budget <= 0:
        return 0
    if budget >= 1:
        return 1
    return math.ceil(math.log((1 - confidence) / 2) / math.log(1 - budget))
