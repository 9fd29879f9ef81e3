"""When requests arrive: the arrival process every load generator here shares.

Stdlib only, so the engine benchmark can use it on a machine without the message plane's
packages (the GPU image).
"""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent (s from the start): gamma gaps of mean 1/rate (Poisson at 1)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
