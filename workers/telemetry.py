"""Worker telemetry: latency windows and counters → :class:`Telemetry`; the KV heartbeat.

Every ``worker.telemetry_interval_s`` the service publishes one :class:`Telemetry` on
``<prefix>.tel.<group>.<worker>`` and puts a heartbeat under ``workers.<worker_id>`` in the
``qos_state`` KV bucket: JSON ``{"worker", "group", "state", "model", "ts_ms"}``. The
report keeps its rhythm whatever the bucket does: a write still pending skips the next.

TTFT and E2E percentiles cover a sliding window: the last :data:`WINDOW_SAMPLES` requests
that finished within the last ``worker.latency_window_s`` seconds (default 3 s). Kept short on
purpose: the scheduler's breaker averages its own window of samples, and a long worker window
would keep reporting a healed group as slow and re-open the breaker while it probes. Both are measured from the
request's ``created_ms`` (when the caller set it), so time spent queued in JetStream
counts: a backlog is exactly what the scheduler's breakers must see. A redelivered request
contributes no latency sample (it still counts as done): its clock ran through the wait
for the redelivery (``ack_wait`` after a replica died), which says nothing of how fast the
group serves now, and one replica's crash opened the breaker of a group whose other
replicas were healthy (the users' view, crash included, is the gateway's histograms).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

from nats.aio.client import Client
from nats.js.kv import KeyValue

from common.protocol import Telemetry
from common.subjects import HEARTBEAT_KEY_PREFIX, Subjects
from workers.engine.outputs import EngineStats

log = logging.getLogger(__name__)

WINDOW_SAMPLES = 512
WINDOW_S = 3.0
State = Literal["starting", "serving", "draining", "stopped"]
_HOST = socket.gethostname()


class LatencyWindow:
    """The last ``max_samples`` latencies of the last ``horizon_s`` seconds."""

    def __init__(
        self,
        max_samples: int = WINDOW_SAMPLES,
        horizon_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._horizon = horizon_s
        self._clock = clock

    def add(self, seconds: float) -> None:
        self._samples.append((self._clock(), max(0.0, seconds)))

    def values(self) -> list[float]:
        cutoff = self._clock() - self._horizon
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        return [v for _, v in self._samples]

    def percentiles_ms(self) -> tuple[float, float, int]:
        """(p50, p99, samples) in milliseconds, nearest-rank; zeros when empty."""
        values = sorted(self.values())
        if not values:
            return 0.0, 0.0, 0
        return _rank(values, 0.50) * 1e3, _rank(values, 0.99) * 1e3, len(values)


def _rank(sorted_values: list[float], q: float) -> float:
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


class WorkerTelemetry:
    """Counters and windows the service feeds; :meth:`build` makes the next message."""

    def __init__(
        self,
        worker_id: str,
        model: str,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = WINDOW_S,
    ):
        self.worker_id = worker_id
        self.model = model
        self.ttft = LatencyWindow(horizon_s=window_s, clock=clock)
        self.e2e = LatencyWindow(horizon_s=window_s, clock=clock)
        self.requests_done = 0
        self.errors = 0
        self.tokens_out = 0
        self._clock = clock
        self._last_at = clock()
        self._last_tokens = 0
        self._last_busy = 0.0

    def reset_latency(self) -> None:
        """Forget the latency windows: the replica moved, and its old group's latencies (a
        long document's 20 s) would count against its new group's SLO and breaker."""
        self.ttft = LatencyWindow(horizon_s=self.ttft._horizon, clock=self._clock)
        self.e2e = LatencyWindow(horizon_s=self.e2e._horizon, clock=self._clock)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.add(ttft_s)

    def tokens(self, n: int) -> None:
        self.tokens_out += n

    def finished(self, e2e_s: float | None, *, error: bool) -> None:
        """A request ended; errors count apart and stay out of the latency window, as does
        a request with no sample (``None``: a redelivery)."""
        if error:
            self.errors += 1
            return
        self.requests_done += 1
        if e2e_s is not None:
            self.e2e.add(e2e_s)

    def build(
        self,
        group: str,
        state: State,
        stats: EngineStats,
        batch_cap: int,
        busy_s: float,
        *,
        max_seq_len: int | None = None,
        engine_max_seq_len: int | None = None,
    ) -> Telemetry:
        """The telemetry message now; rates cover the time since the previous call."""
        now = self._clock()
        dt = max(now - self._last_at, 1e-9)
        tokens_per_s = (self.tokens_out - self._last_tokens) / dt
        busy_ratio = min(1.0, max(0.0, (busy_s - self._last_busy) / dt))
        self._last_at, self._last_tokens, self._last_busy = now, self.tokens_out, busy_s
        ttft_p50, ttft_p99, _ = self.ttft.percentiles_ms()
        e2e_p50, e2e_p99, samples = self.e2e.percentiles_ms()
        return Telemetry(
            worker=self.worker_id,
            group=group,
            ts_ms=int(time.time() * 1000),
            model=self.model,
            state=state,
            running=stats.num_running,
            waiting=stats.num_waiting,
            batch_cap=batch_cap,
            kv_usage=float(stats.kv_usage),
            tokens_per_s=tokens_per_s,
            requests_done=self.requests_done,
            errors=self.errors,
            ttft_p50_ms=ttft_p50,
            ttft_p99_ms=ttft_p99,
            e2e_p50_ms=e2e_p50,
            e2e_p99_ms=e2e_p99,
            samples=samples,
            prefix_queried_tokens=stats.prefix_cache_queries,
            prefix_hit_tokens=stats.prefix_cache_hits,
            busy_ratio=busy_ratio,
            max_seq_len=max_seq_len,
            engine_max_seq_len=engine_max_seq_len,
        )


def heartbeat_value(message: Telemetry, metrics_port: int = 0) -> bytes:
    """The ``workers.<id>`` KV value: JSON, so ``nats kv get`` shows it as is.

    ``host`` and ``metrics_port`` say where to scrape the worker's ``/metrics`` (0: nowhere).
    """
    return json.dumps(
        {
            "worker": message.worker,
            "group": message.group,
            "state": message.state,
            "model": message.model,
            "ts_ms": message.ts_ms,
            "host": _HOST,
            "metrics_port": metrics_port,
        },
        separators=(",", ":"),
    ).encode()


class Reporter:
    """Sends a worker's reports and writes its heartbeat, which it owns while the write is
    in flight: awaited in the round, a slow bucket (5 s JetStream timeouts) stretched rounds
    past the scheduler's ``worker_silent_s``, and the replica read as gone while it served."""

    def __init__(self) -> None:
        self._writing: asyncio.Task[None] | None = None

    async def publish(
        self,
        nc: Client,
        kv: KeyValue | None,
        subjects: Subjects,
        message: Telemetry,
        metrics_port: int = 0,
    ) -> None:
        """Send ``message`` and refresh the heartbeat; a NATS hiccup is logged, never raised.

        The report goes out at once; the heartbeat write runs on its own, skipped (not
        queued) while the previous one is still pending. A ``stopped`` one is awaited, after
        any write still pending (which would land over it): the caller purges the key."""
        try:
            subject = subjects.telemetry(message.group, message.worker)
            await nc.publish(subject, message.to_bytes())
        except Exception as exc:
            log.warning("telemetry publish failed: %s", exc)
            if message.state != "stopped":  # the last heartbeat still goes: see below
                return
        if kv is None:
            return
        pending = self._writing
        if message.state == "stopped":
            if pending is not None:
                await asyncio.wait([pending])  # bounded by the bucket's own timeout
            await _write_heartbeat(kv, message, metrics_port)
        elif pending is None or pending.done():
            self._writing = asyncio.create_task(
                _write_heartbeat(kv, message, metrics_port), name=f"heartbeat-{message.worker}"
            )
        else:
            log.debug("heartbeat of %s: the previous write is still pending", message.worker)


async def _write_heartbeat(kv: KeyValue, message: Telemetry, metrics_port: int) -> None:
    try:
        await kv.put(HEARTBEAT_KEY_PREFIX + message.worker, heartbeat_value(message, metrics_port))
    except Exception as exc:
        log.warning("heartbeat write failed: %s", exc)
