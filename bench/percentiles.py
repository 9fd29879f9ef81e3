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


def p50_p90_max(sorted_values: list[float], digits: int = 1) -> dict[str, float]:
    """The three figures a latency distribution is reported by here, rounded (NaN: none)."""
    top = sorted_values[-1] if sorted_values else float("nan")
    return {"p50": round(pct(sorted_values, 50), digits),
            "p90": round(pct(sorted_values, 90), digits), "max": round(top, digits)}  # fmt: skip
