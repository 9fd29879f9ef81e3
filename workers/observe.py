"""What a worker replica tells the outside about its requests: metrics, spans, log context.

The service calls a handful of hooks at the points a request passes — fetched, engine
output, chunk out, answered, handed back or dropped — and this module turns them into
Prometheus series (:mod:`workers.metrics`) and, when tracing is on, spans
(:mod:`workers.tracing`). Nothing here does I/O on the request path; ``/metrics`` is
served from a thread of its own on ``worker.metrics_port`` (0 = a free port, logged and
published in the heartbeat, so replicas on one host never collide).

Per request, on the event loop:

- TTFT and queue time come from the engine's own times (``arrival`` = the gateway's
  ``created_ms``, so JetStream queueing counts), observed at the first token, only on a
  first attempt: a resumed request's first token reached the caller on an earlier one;
- ITL is the time between two engine outputs of a request, divided over their tokens;
- E2E is ``created_ms`` to the final chunk out, as in the telemetry the breakers judge; a
  request its caller cancelled (finish reason ``abort``) counts by outcome only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import Span, Tracer
from prometheus_client import CollectorRegistry

from common.liveness import LoopBeat
from common.logging import about, bind_request, bind_trace
from common.metrics import MetricsServer
from common.protocol import Chunk
from common.trace_context import from_headers
from common.trace_metrics import register_trace_metrics
from workers.engine.outputs import RequestDelta, RequestOutput
from workers.metrics import EngineView, RequestSeries, WorkerMetrics
from workers.outbox import Flight
from workers.tracing import Delivery, RequestSpans

log = logging.getLogger(__name__)


def about_flight(st: Flight) -> dict[str, Any]:
    """``extra=`` of a line about ``st`` written outside its fetch task (engine output, a
    tick, a control): its request id and, when it is sampled, its span's ids."""
    watch: Watch | None = st.watch
    span = watch.span if watch is not None else None
    if isinstance(span, Delivery):
        return about(st.request.id, (span.trace_id, span.span_id))
    if span is not None:
        ctx = span.get_span_context()
        if ctx.is_valid:
            return about(st.request.id, (ctx.trace_id, ctx.span_id))
    return about(st.request.id)


@dataclass(slots=True)
class Watch:
    """Observability state of one delivery, kept on its :class:`Flight` (``st.watch``)."""

    group: str
    series: RequestSeries
    fetched_at: float  # time.time()
    span: Span | Delivery | None = None
    last_output_at: float | None = None  # time.time() the engine had its last output
    output: RequestOutput | None = None  # the finishing delta's output (engine times)
    first_chunk_at: float | None = None  # time.time() the first chunk went out
    last_chunk_at: float | None = None


class WorkerObserver:
    """Metrics and spans of one replica; :meth:`start` serves ``/metrics``."""

    def __init__(
        self,
        *,
        worker_id: str,
        model: str,
        view: Callable[[], EngineView | None],
        tracer: Tracer | None = None,
        registry: CollectorRegistry | None = None,
        gpus: bool = True,
    ) -> None:
        self.worker_id = worker_id
        self.metrics = WorkerMetrics(model, view, registry, gpus=gpus)
        self.spans = RequestSpans(tracer, worker_id, model) if tracer is not None else None
        register_trace_metrics(self.metrics.registry, tracer)
        self._server: MetricsServer | None = None

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    @property
    def metrics_port(self) -> int:
        """The port ``/metrics`` is served on (0 while not serving)."""
        return self._server.port if self._server is not None else 0

    def start(self, port: int, beat: LoopBeat | None = None, host: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` and ``/livez`` (from ``beat``) on ``host:port`` (port 0 = a
        free one); a taken port is logged, not fatal: a replica that cannot be scraped
        still serves."""
        try:
            self._server = MetricsServer(self.registry, port, host, beat=beat)
        except OSError as exc:
            log.error("worker %s: /metrics not served on port %d: %s", self.worker_id, port, exc)
            return
        log.info("worker %s: /metrics on port %d", self.worker_id, self._server.port)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # --- request hooks (event loop) ------------------------------------------------------

    def fetched(self, st: Flight, msg: Any, group: str) -> None:
        """A delivery was fetched: its watch, its span (a child of the publisher's)."""
        req = st.request
        watch = Watch(group, self.metrics.series(group), time.time())
        st.watch = watch
        bind_request(req.id)
        span = None
        if self.spans is not None:
            span = watch.span = self.spans.start(
                req, msg.headers, group=group, attempt=st.attempt,
                subject=msg.subject, fetched_at=watch.fetched_at,
            )  # fmt: skip
            # This task's log lines carry the trace id (the task ends with the admission).
            if isinstance(span, Delivery):
                bind_trace(span.trace_id, span.span_id)
            elif span is not None:
                context.attach(trace.set_span_in_context(span))
        if span is None:
            # Sampled out, or tracing off here: the lines still carry the trace the caller
            # named (the gateway's carry it too), or logs joined by trace id missed the
            # worker's part of most requests.
            parent = from_headers(msg.headers)
            if parent is not None:
                bind_trace(parent.trace_id, parent.span_id)

    def guided(self, st: Flight, kind: str, seconds: float) -> None:
        """A guided request's matcher was made, in ``seconds`` (off the engine thread)."""
        watch: Watch | None = st.watch
        if watch is not None:
            labels = (watch.group, self.metrics.model)
            self.metrics.guided.labels(*labels, kind).inc()
            self.metrics.guided_compile.labels(*labels).observe(seconds)

    def resumed(self, st: Flight) -> None:
        """A redelivered request's caller answered: it continues here. (Deliveries handed
        back or dropped unanswered are not resumes.)"""
        watch: Watch | None = st.watch
        if watch is not None:
            watch.series.resumed.inc()

    def output(self, st: Flight, delta: RequestDelta) -> None:
        """An engine output for ``st``: inter-token latency, the final engine times."""
        watch: Watch | None = st.watch
        if watch is None:
            return
        n = len(delta.token_ids)
        if n:
            # When the engine had them: a loop behind by a few steps handles their outputs
            # microseconds apart, which read as one long gap and several of none.
            now = delta.at or time.time()
            last = watch.last_output_at
            if last is None:
                self._first_output(st, watch, delta)
            elif now >= last:  # a wall clock stepped back: no gap to tell
                # Per token: n tokens that came out together share the gap.
                watch.series.itl.observe((now - last) / n, n)
            watch.last_output_at = now
        if delta.output is not None:
            watch.output = delta.output

    def _first_output(self, st: Flight, watch: Watch, delta: RequestDelta) -> None:
        """TTFT and queue time when the first token comes out, not when the request ends
        (a long answer would report them a minute late, one that fails later never), and
        only on a first attempt: a resumed request's first token reached its caller on an
        earlier one."""
        times = delta.first_token_metrics
        if st.base or times is None:
            return
        if times.first_token_time is not None:
            watch.series.ttft.observe(max(0.0, times.first_token_time - times.arrival_time))
        if times.first_scheduled_time is not None:
            watch.series.queue.observe(max(0.0, times.first_scheduled_time - times.arrival_time))

    def chunk(self, st: Flight, chunk: Chunk) -> None:
        """A chunk is about to be published: tokens generated, the stream's interval."""
        watch: Watch | None = st.watch
        if watch is None:
            return
        if chunk.token_ids:
            watch.series.generation_tokens.inc(len(chunk.token_ids))
            now = time.time()
            if watch.first_chunk_at is None:
                watch.first_chunk_at = now
            watch.last_chunk_at = now

    def answered(self, st: Flight, chunk: Chunk, *, error: bool) -> None:
        """The final chunk is out: latencies, the outcome, and the delivery's span ends."""
        watch: Watch | None = st.watch
        if watch is None:
            return
        now = time.time()
        if error:
            code = chunk.error.code if chunk.error is not None else "error"
            self.metrics.outcome(watch.group, code, error=True).inc()
        else:
            self.metrics.outcome(watch.group, chunk.finish_reason or "stop", error=False).inc()
            series = watch.series
            if chunk.usage is not None:
                series.prompt_tokens.inc(chunk.usage.prompt_tokens)
            if chunk.finish_reason != "abort":  # a cancelled lifetime is no latency
                series.e2e.observe(max(0.0, now - st.start))
        if watch.span is not None and self.spans is not None:
            stream = None
            if watch.first_chunk_at is not None and watch.last_chunk_at is not None:
                stream = (watch.first_chunk_at, max(watch.last_chunk_at, now))
            self.spans.finish(
                watch.span, chunk, output=watch.output, fetched_at=watch.fetched_at,
                stream=stream, resumed_tokens=st.base,
            )  # fmt: skip
        st.watch = None

    def failed(self, group: str, code: str) -> None:
        """A delivery answered with error ``code`` before it became a flight here (given up
        on its last delivery, handed back on it): counted as the errors of flights are."""
        self.metrics.outcome(group, code, error=True).inc()

    def orphaned(self, st: Flight) -> None:
        """Aborted here because the request's gateway went silent (``workers.orphans``)."""
        self.metrics.series(st.request.group).orphaned.inc()

    def abandoned(self, st: Flight, outcome: str) -> None:
        """The delivery ends here unanswered (``handed_back``, ``no_caller``, ``aborted``)."""
        watch: Watch | None = st.watch
        if watch is not None and watch.span is not None and self.spans is not None:
            self.spans.abandon(watch.span, outcome)
        st.watch = None
