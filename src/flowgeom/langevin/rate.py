"""Hitting times ``τ(ε)`` of suboptimality curves: the measurement behind ``O(log 1/ε)`` (seed ``004_…``, Thm. 3.3).

Given, per arm, times ``t_j`` and suboptimalities ``d_j = E[V(θ_{t_j})] − L*``,
``τ(ε) = min{t_j : d_j ≤ ε}`` on a geometric grid of ε from half the largest
initial suboptimality down to the best value any arm reached (floored at
``floor_ratio`` of the top). ``slope`` is the least-squares slope of ``τ``
against ``log(1/ε)`` over the ε an arm reached: a straight line is the
``O(log 1/ε)`` law.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def fit_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``y`` on ``x``; ``None`` with fewer than two distinct ``x``."""
    if len(points) < 2:
        return None
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    var = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else None


def hitting_times(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, n_eps: int = 8,
                  floor_ratio: float = 1e-3) -> dict[str, Any]:
    """``{"eps", "log_inv_eps", "tau", "slope", "reached"}`` for ``series[arm] = (times, suboptimality)``."""
    series = {arm: (list(t), list(d)) for arm, (t, d) in series.items() if len(d)}
    empty = {"eps": [], "log_inv_eps": [], "tau": {}, "slope": {}, "reached": {}}
    if not series:
        return empty
    top = 0.5 * max(d[0] for _, d in series.values())
    low = max(min(min(d) for _, d in series.values()), floor_ratio * top)
    if not top > low > 0:
        return {**empty, "note": "every arm started at or below L* + floor"}
    eps = [top * (low / top) ** (i / (n_eps - 1)) for i in range(n_eps)]
    tau = {arm: [next((t for t, v in zip(ts, d) if v <= e), None) for e in eps] for arm, (ts, d) in series.items()}
    slope = {arm: fit_slope([(math.log(1 / e), h) for e, h in zip(eps, hits) if h is not None]) for arm, hits in tau.items()}
    return {"eps": eps, "log_inv_eps": [math.log(1 / e) for e in eps], "tau": tau, "slope": slope,
            "reached": {arm: sum(h is not None for h in hits) for arm, hits in tau.items()}}
