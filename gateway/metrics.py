"""The gateway's Prometheus metrics, in a registry of its own.

A registry per app (not the process-wide default) lets tests build many apps in one
process; ``/metrics`` serves exactly this registry. Names, labels and buckets live in
:mod:`common.metrics`; the gateway's carry a ``qos_gateway_`` prefix because they measure
what the client sees at the HTTP edge, which the workers' engine-side series do not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from common import metrics as m


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
        self.requests = m.counter(m.GW_REQUESTS, r)
        self.ttft = m.histogram(m.GW_TTFT, r)
        self.e2e = m.histogram(m.GW_E2E, r)
        self.in_flight = m.gauge(m.GW_IN_FLIGHT, r)
        self.fallbacks = m.counter(m.GW_FALLBACKS, r)
        self.tokens = m.counter(m.GW_TOKENS, r)
        self.key_requests = m.counter(m.GW_KEY_REQUESTS, r)
        self.key_tokens = m.counter(m.GW_KEY_TOKENS, r)
        self.key_refused = m.counter(m.GW_KEY_REFUSED, r)
        self.live_workers = m.gauge(m.GW_LIVE_WORKERS, r)
        self.breaker_state = m.gauge(m.GW_BREAKER, r)
        m.register_build_info(r, "gateway")

    def finished(self, group: str, status: int) -> None:
        """Count one finished request (label children cached: ``labels()`` is not free)."""
        key = (group, status)
        child = self._finished.get(key)
        if child is None:
            child = self._finished[key] = self.requests.labels(group, str(status))
        child.inc()

    def key_usage(self, key: str, status: int, prompt_tokens: int, completion_tokens: int) -> None:
        """One admitted request of API key ``key`` answered ``status``, with its tokens."""
        self.key_requests.labels(key, str(status)).inc()
        if prompt_tokens:
            self.key_tokens.labels(key, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.key_tokens.labels(key, "completion").inc(completion_tokens)

    def key_refused_for(self, key: str, reason: str) -> None:
        """A request of ``key`` refused for the key's own limit (``rate``, ``in_flight``)."""
        self.key_refused.labels(key, reason).inc()

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
