"""Paired bootstrap of a score drop: how sure a small set lets us be about "drop < 1 point".

Both runs scored the same prompts, so the drop is resampled per prompt (the same indices for
the baseline and the other run), which keeps the prompts' difficulty out of the interval:
only the prompts whose score changed move it. The interval is the bootstrap percentile one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Drop:
    """``baseline - other`` in points (0-100 scale), with its two-sided confidence interval."""

    points: float
    low: float
    high: float
    confidence: float

    def as_dict(self) -> dict[str, float]:
        """Rounded for a JSON report."""
        return {
            "points": round(self.points, 2),
            f"ci{round(100 * self.confidence)}_low": round(self.low, 2),
            f"ci{round(100 * self.confidence)}_high": round(self.high, 2),
        }


def paired_drop(
    baseline: Sequence[float],
    other: Sequence[float],
    *,
    resamples: int = 4000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Drop:
    """The mean drop from ``baseline`` to ``other`` (per-prompt scores in [0, 1]) in points,
    and its paired bootstrap percentile interval (seeded: the same inputs give the same
    interval)."""
    base = np.asarray(baseline, dtype=np.float64)
    oth = np.asarray(other, dtype=np.float64)
    if base.shape != oth.shape or base.ndim != 1 or base.size == 0:
        raise ValueError(f"need two equal, non-empty score lists, got {base.shape}, {oth.shape}")
    diff = 100.0 * (base - oth)
    idx = np.random.default_rng(seed).integers(0, diff.size, size=(resamples, diff.size))
    means = diff[idx].mean(axis=1)
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return Drop(float(diff.mean()), float(low), float(high), confidence)
