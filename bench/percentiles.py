"""Percentiles as every benchmark here reports them (stdlib only: the engine benchmark
runs on machines without the message plane's packages)."""

from __future__ import annotations

import math


def pct(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of sorted values (numpy's default)."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
