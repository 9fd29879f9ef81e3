"""The scheduler's Prometheus metrics (DESIGN §7), on a registry of its own.

A registry per service (rather than the global one) lets tests run several schedulers in
one process; ``serve(port)`` exposes it on ``/metrics``, with ``/livez``
(:mod:`common.liveness`) beside it (port 0 = not served). The names
the dashboard reads (breaker state, desired replicas) are defined in :mod:`common.metrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from common import metrics as m
from common.errors import ConfigError
from common.liveness import LoopBeat
from scheduler.breaker import STATE_GAUGE, State


class SchedulerMetrics:
    """Gauges and counters the service sets; names are ``qos_*``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._server: m.MetricsServer | None = None
        r = self.registry
        self.breaker_state = m.gauge(m.BREAKER_STATE, r)
        self.breaker_transitions = m.counter(m.BREAKER_TRANSITIONS, r)
        self.desired_replicas = m.gauge(m.DESIRED_REPLICAS, r)
        self.group_replicas = Gauge(
            "qos_group_replicas", "Live serving replicas per group", ["group"], registry=r
        )
        self.group_p99 = Gauge(
            "qos_group_p99_seconds", "Group p99 over the window (kind: e2e | ttft)",
            ["group", "kind"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "qos_group_queue_depth", "JetStream pending + ack-pending requests", ["group"],
            registry=r,
        )  # fmt: skip
        self.error_rate = Gauge(
            "qos_group_error_rate", "Errors / finished requests over the window", ["group"],
            registry=r,
        )  # fmt: skip
        # Counted once a report shows the replica in its new group: an order is no move.
        self.moves = Counter(
            "qos_rebalance_moves", "Replicas moved between groups", ["from", "to"], registry=r
        )
        self.moves_failed = Counter(
            "qos_rebalance_moves_failed",
            "Moves ordered and not seen done by their deadline (another replica is tried)",
            ["from", "to"], registry=r,
        )  # fmt: skip
        self.leader = Gauge(
            "qos_scheduler_leader", "1 while this replica holds the lease and acts", registry=r
        )
        m.register_build_info(r, "scheduler")

    def set_breaker(self, group: str, state: State) -> None:
        self.breaker_state.labels(group).set(STATE_GAUGE[state])

    def transition(self, group: str, source: State, target: State) -> None:
        self.breaker_transitions.labels(group, source, target).inc()

    def serve(self, port: int, beat: LoopBeat | None = None, host: str = "127.0.0.1") -> None:
        """Expose ``/metrics`` and ``/livez`` (from ``beat``) on ``host:port``; port 0
        serves nothing."""
        if port:
            try:
                self._server = m.MetricsServer(self.registry, port, host, beat=beat)
            except OSError as exc:
                raise ConfigError(
                    f"scheduler.metrics_port {port}: cannot serve /metrics there ({exc.strerror})"
                ) from None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
