"""AUP, Accuracy Under Parallelism (d3LLM's leaderboard score): one number for a decoder's
accuracy-parallelism curve, which rewards tokens per forward only while accuracy holds.

For points (rho_i, y_i) sorted by rho (tokens per forward; accuracy y in percent), keeping only
those with y >= y_1 - 5 (y_1: the accuracy at the lowest parallelism):

    AUP = rho_1 y_1 + sum_i (rho_i - rho_{i-1}) (y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2,
    W(y) = min(exp(-3 (1 - y / y_max)), 1),

y_max the best accuracy of every method compared. As d3LLM's `aup_utils.get_aup` computes it,
but for its refusals: a curve that loses more than 5 points is scored on the points that remain
(the reference asserts instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def quality_weight(y: float, y_max: float, alpha: float = 3.0) -> float:
    return min(math.exp(-alpha * (1 - y / y_max)), 1.0)


def aup(rho: Sequence[float], y: Sequence[float], y_max: float, alpha: float = 3.0, drop: float = 5.0) -> float:
    """The AUP of points (rho_i tokens per forward, y_i accuracy in percent), against `y_max`."""
    if len(rho) != len(y) or not rho:
        raise ValueError("rho: one accuracy per parallelism, at least one point")
    if any(r <= 0 for r in rho):
        raise ValueError("rho: tokens per forward must be positive")
    if not y_max > 0:
        raise ValueError(f"y_max: the best accuracy, in percent, must be > 0 (got {y_max})")
    points = sorted(zip(rho, y), key=lambda p: p[0])
    floor = points[0][1] - drop
    points = [(r, a) for r, a in points if a >= floor]
    total = points[0][0] * points[0][1]
    for (r0, a0), (r1, a1) in zip(points, points[1:]):
        total += 0.5 * (r1 - r0) * (a1 * quality_weight(a1, y_max, alpha) + a0 * quality_weight(a0, y_max, alpha))
    return total
