"""Counters of the KV tiers, per tier: what was asked, found, moved, dropped, rejected.

Tokens, not blocks, for queries and hits, so they add up with the engine's own prefix-cache
counters (``qos_prefix_cache_queries_total|hits_total{tier}``). Host-tier counters and
Redis load counters are written by the engine thread only; Redis store counters by the
writer pool and, for drops and errors, the engine thread too, under ``KVTiers._lock``,
which ``stats()`` also takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TierCounters:
    """Totals since start for one tier (``host`` = G2, ``redis`` = G3)."""

    query_tokens: int = 0  # tokens looked up here (those the tiers above did not have)
    hit_tokens: int = 0  # tokens loaded from here into the device cache
    loads: int = 0  # load calls that reached this tier
    load_bytes: int = 0
    load_s: float = 0.0  # wall time of those loads, summed
    stores: int = 0  # store batches written
    store_blocks: int = 0
    store_bytes: int = 0
    # Wall time the tier was storing. Redis: while at least one sub-batch was on a writer
    # thread (those side by side count once, so store GB/s compares with load GB/s, and
    # stores that failed count too); host memory: its offload calls, summed.
    store_s: float = 0.0
    drops: int = 0  # blocks not stored: queue full, breaker open, or no room
    corrupt: int = 0  # values that failed to decode (counted as misses)
    errors: int = 0  # calls that failed or timed out

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def load_ms_per_call(self) -> float:
        return 1000.0 * self.load_s / self.loads if self.loads else 0.0

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_s / 1e9 if self.load_s else 0.0

    @property
    def store_gbps(self) -> float:
        return self.store_bytes / self.store_s / 1e9 if self.store_s else 0.0


@dataclass(frozen=True)
class TierStats:
    """A snapshot of :class:`~kvstore.tiers.KVTiers` for telemetry and benchmarks."""

    host: TierCounters = field(default_factory=TierCounters)
    redis: TierCounters = field(default_factory=TierCounters)
    host_blocks: int = 0
    host_capacity_blocks: int = 0
    host_evictions: int = 0
    breaker_state: str = "closed"
    breaker_opens: int = 0
    store_queue_bytes: int = 0  # written through but not yet acknowledged by Redis

    @property
    def hit_tokens(self) -> int:
        return self.host.hit_tokens + self.redis.hit_tokens

    def as_dict(self) -> dict[str, object]:
        """Plain values (JSON for the benchmark, labels for Prometheus)."""
        out = dataclasses.asdict(self)
        for name in ("host", "redis"):
            c: TierCounters = getattr(self, name)
            out[name].update(
                hit_rate=c.hit_rate,
                load_ms_per_call=c.load_ms_per_call,
                load_gbps=c.load_gbps,
                store_gbps=c.store_gbps,
            )
        return out


def snapshot(counters: TierCounters) -> TierCounters:
    """A copy that later updates do not change."""
    return dataclasses.replace(counters)
