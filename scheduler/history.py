"""Hour-of-week demand history per group, kept in the state bucket as ``history.<group>``.

The field study adjusts instance ratios hourly from historical demand. Demand here is a
group's concurrency (running + waiting + queued requests; by Little's law, arrival rate ×
latency), the unit the rebalancer sizes replicas in. Each of the 168 hours of the week
(UTC, Monday 00:00 = slot 0) holds an exponentially weighted mean over past weeks: the
current hour accumulates a plain mean, folded into its slot with weight ``alpha`` when the
hour ends. The forecast for a moment is the larger of its slot and the next one, so
capacity is in place before a recurring peak rather than after it.

The value is JSON, readable with ``nats kv get``::

    {"v": 1, "slots": [null | float] * 168, "hour": int, "sum": float, "n": int,
     "updated_ms": int}

``hour``/``sum``/``n`` are the hour in progress, so a restarted scheduler keeps it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

HOURS_PER_WEEK = 168
KEY_PREFIX = "history."


def hour_of_week(epoch_s: float) -> int:
    """0 = Monday 00:00–00:59 UTC … 167 = Sunday 23:00–23:59 UTC."""
    tm = time.gmtime(epoch_s)
    return tm.tm_wday * 24 + tm.tm_hour


@dataclass
class DemandHistory:
    """One group's 168 hourly slots and the hour in progress."""

    slots: list[float | None] = field(default_factory=lambda: [None] * HOURS_PER_WEEK)
    hour: int = -1
    total: float = 0.0
    count: int = 0
    updated_ms: int = 0

    def observe(self, demand: float, epoch_s: float, alpha: float) -> None:
        """Add one observation of the group's concurrency at ``epoch_s``."""
        slot = hour_of_week(epoch_s)
        if slot != self.hour:
            self._fold(alpha)
            self.hour, self.total, self.count = slot, 0.0, 0
        self.total += max(0.0, demand)
        self.count += 1
        self.updated_ms = int(epoch_s * 1000)

    def forecast(self, epoch_s: float) -> float:
        """Expected concurrency now or in the coming hour (0 with no history)."""
        slot = hour_of_week(epoch_s)
        known = [v for v in (self.slots[slot], self.slots[(slot + 1) % HOURS_PER_WEEK]) if v]
        return max(known, default=0.0)

    def _fold(self, alpha: float) -> None:
        if self.hour < 0 or self.count == 0:
            return
        mean = self.total / self.count
        old = self.slots[self.hour]
        self.slots[self.hour] = mean if old is None else (1 - alpha) * old + alpha * mean

    # --- the KV value --------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "v": 1,
                "slots": [None if v is None else round(v, 4) for v in self.slots],
                "hour": self.hour,
                "sum": round(self.total, 4),
                "n": self.count,
                "updated_ms": self.updated_ms,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> DemandHistory:
        """Decode a stored value; anything malformed starts an empty history."""
        try:
            obj = json.loads(data)
            slots = [None if v is None else float(v) for v in obj["slots"]]
            if len(slots) != HOURS_PER_WEEK:
                raise ValueError("wrong number of slots")
            # A value no run of ours writes (an hour off the week, NaN, a negative demand)
            # made every later rebalance raise: the rebalancer stopped for good.
            if any(v is not None and not (math.isfinite(v) and v >= 0) for v in slots):
                raise ValueError("a slot is not a finite demand")
            hour = int(obj.get("hour", -1))
            if not -1 <= hour < HOURS_PER_WEEK:
                raise ValueError("hour out of the week")
            total = float(obj.get("sum", 0.0))
            count = int(obj.get("n", 0))
            if not (math.isfinite(total) and total >= 0 and count >= 0):
                raise ValueError("bad running sum")
            return cls(
                slots=slots, hour=hour, total=total, count=count,
                updated_ms=int(obj.get("updated_ms", 0)),
            )  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls()
