"""The gateway's Prometheus metrics, in a registry of its own.

A registry per app (not the process-wide default) lets tests build many apps in one
process; ``/metrics`` serves exactly this registry. Names follow DESIGN §7 with a
``qos_gateway_`` prefix, so they never collide with the workers' engine-side series.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: from a few ms (a cached token on loopback) to a long-context minute.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class GroupSeries:
    """One group's label children of the per-request metrics."""

    in_flight: Any
    ttft: Any
    e2e: Any
    tokens: Any


class GatewayMetrics:
    """Counters, histograms and gauges the gateway updates per request."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._finished: dict[tuple[str, int], Any] = {}
        self._series: dict[str, GroupSeries] = {}
        self.requests = Counter(
            "qos_gateway_requests",
            "Finished HTTP generation requests by the group that served them and status code",
            ["group", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "qos_gateway_time_to_first_token_seconds",
            "Request arrival to the first token ready for the client",
            ["group", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "qos_gateway_e2e_request_latency_seconds",
            "Request arrival to the last token",
            ["group", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "qos_gateway_requests_in_flight",
            "Requests admitted to a group and not yet finished",
            ["group"],
            registry=r,
        )
        self.fallbacks = Counter(
            "qos_gateway_fallbacks",
            "Requests sent to a fallback group instead of the classified one",
            ["from_group", "to_group", "reason"],
            registry=r,
        )
        self.tokens = Counter(
            "qos_gateway_generation_tokens",
            "Completion tokens delivered to clients",
            ["group"],
            registry=r,
        )
        self.live_workers = Gauge(
            "qos_gateway_live_workers",
            "Workers per group whose telemetry is recent and says serving",
            ["group"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "qos_gateway_breaker_state",
            "Breaker state per group as the gateway sees it (0 closed, 1 half-open, 2 open)",
            ["group"],
            registry=r,
        )

    def finished(self, group: str, status: int) -> None:
        """Count one finished request (label children cached: ``labels()`` is not free)."""
        key = (group, status)
        child = self._finished.get(key)
        if child is None:
            child = self._finished[key] = self.requests.labels(group, str(status))
        child.inc()

    def series(self, group: str, model: str) -> GroupSeries:
        """The per-request series of ``group``, looked up once."""
        found = self._series.get(group)
        if found is None:
            found = self._series[group] = GroupSeries(
                in_flight=self.in_flight.labels(group),
                ttft=self.ttft.labels(group, model),
                e2e=self.e2e.labels(group, model),
                tokens=self.tokens.labels(group),
            )
        return found

    def refresh_groups(self, live: Mapping[str, int], breakers: Mapping[str, str]) -> None:
        """Copy the workers view into gauges (at scrape time: nothing to do per request)."""
        codes = {"closed": 0, "half_open": 1, "open": 2}
        for group, count in live.items():
            self.live_workers.labels(group).set(count)
        for group, state in breakers.items():
            self.breaker_state.labels(group).set(codes.get(state, 0))
