"""The batch span processor the services export through: a queue the request path appends
to, and a thread that hands the exporter a batch when one is full or every few seconds.

The SDK's BatchSpanProcessor does the same, but its ``on_end`` reads each span's
``SpanContext`` (built for the purpose) to skip unsampled ones, checks the process id (a
system call) and counts into its metrics, ~3 µs a span on the event loop; seven spans a
traced request. Here :class:`common.span_recorder.Tracer` calls :meth:`SpanBatch.add`
with spans it knows are sampled: one append and a count. A span queued with its phases
(:meth:`common.span_recorder.RecordedSpan.add_phase`) counts as that many spans; our OTLP
exporter writes the phases itself, any other exporter gets them as spans. It reads
the SDK's ``OTEL_BSP_*`` variables (delay, queue size, batch size in spans, export
timeout) with the SDK's defaults; spans beyond a full queue are dropped and counted, as
the SDK drops them.

It also counts what became of the spans (exported, failed, dropped) and the CPU its
export thread spent exporting (``time.thread_time``: building deferred spans, encoding and
sending, not waiting):
:mod:`common.trace_metrics` serves them on each service's ``/metrics``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", name, raw, default)
        return default
    return value if value > 0 else default


# How long a stopping service waits for its span export before giving the rest up.
SHUTDOWN_FLUSH_S = 5.0


class Deferred:
    """A span recorded as plain values on the request path and queued as such; the export
    thread makes it a span (:meth:`build`) in its batch loop. ``_phases``, the phases it will
    carry, is what the queue counts it by."""

    __slots__ = ()
    _phases: list[tuple[str, float, float]] | None

    def build(self) -> ReadableSpan:
        raise NotImplementedError


def _built(batch: list[ReadableSpan | Deferred]) -> list[ReadableSpan]:
    """``batch`` with its deferred items built, in order."""
    return [item.build() if isinstance(item, Deferred) else item for item in batch]


def _spans(batch: list[ReadableSpan]) -> list[ReadableSpan]:
    """``batch`` with each span's phases as spans of their own, ahead of it."""
    out: list[ReadableSpan] = []
    for span in batch:
        if getattr(span, "_phases", None):
            out.extend(span.phase_spans())  # type: ignore[attr-defined]
        out.append(span)
    return out


class SpanBatch(SpanProcessor):
    """Spans queued by the request path, exported in batches from a thread of its own."""

    def __init__(self, exporter: SpanExporter, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.span_exporter = exporter
        self.delay_s = _env_int(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.max_queue = _env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.max_batch = min(self.max_queue, _env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
        self.timeout_s = _env_int(env, "OTEL_BSP_EXPORT_TIMEOUT", 30000) / 1000
        # Spans (phases counted) by fate, and the export thread's CPU; written under
        # _export_lock (or, for dropped, by the request path's thread only).
        self.dropped = 0
        self._exported = 0
        self._failed = 0
        self.export_cpu_s = 0.0
        self._queue: collections.deque[ReadableSpan | Deferred] = collections.deque()
        # Spans queued = added - taken; each count written by one thread only (no lock).
        self._added = self._taken = 0
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self._closed = False
        # Our OTLP exporter writes a span's phases itself; any other gets them as spans.
        self._reads_phases = getattr(exporter, "reads_phases", False)
        # One that exports elsewhere (the export process) reports what it delivered later:
        # its SUCCESS only says a batch was handed over.
        self._reports = exporter if getattr(exporter, "reports_delivery", False) else None
        self._thread = threading.Thread(target=self._run, name="qos-span-batch", daemon=True)
        self._thread.start()

    def add(self, span: ReadableSpan | Deferred) -> None:
        """Queue a sampled span and its phases (the request path: no check of its flags), or
        a :class:`Deferred` one, which the export thread builds."""
        phases = getattr(span, "_phases", None)
        weight = 1 + len(phases) if phases else 1
        queued = self._added - self._taken
        if queued + weight > self.max_queue:
            self._drop(weight)
            return
        self._queue.append(span)
        self._added += weight
        if queued < self.max_batch <= queued + weight:  # a batch is full: wake the thread
            self._wake.set()

    @property
    def queued(self) -> int:
        """Spans waiting for the export thread (phases counted)."""
        return self._added - self._taken

    def _drop(self, weight: int) -> None:
        before = self.dropped
        self.dropped += weight  # the exporter is behind: the SDK drops too, and says so
        if before.bit_length() != self.dropped.bit_length():  # at 1, 2, 4 …: not every span
            log.warning("span queue full (%d): %d spans dropped", self.max_queue, self.dropped)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is not None and context.trace_flags.sampled and not self._closed:
            self.add(span)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._export(everything=False)

    def _export(self, everything: bool) -> None:
        """Full batches, or everything queued; with ``everything`` False, at least one
        batch (the delay has passed) but not a partial one behind a full one."""
        with self._export_lock:
            queue = self._queue
            first = True
            while queue and (first or everything or self._added - self._taken >= self.max_batch):
                first = False
                batch, size = self._take()
                started = time.thread_time()
                try:
                    spans = _built(batch)
                    result = self.span_exporter.export(
                        spans if self._reads_phases else _spans(spans)
                    )
                except Exception:  # an exporter's bug must not end the thread
                    log.exception("span export failed")
                    result = SpanExportResult.FAILURE
                self.export_cpu_s += time.thread_time() - started
                if result is not SpanExportResult.SUCCESS:
                    self._failed += size
                elif self._reports is None:
                    self._exported += size

    @property
    def exported(self) -> int:
        """Spans (phases counted) the exporter delivered."""
        if self._reports is not None:
            return int(self._reports.delivered)  # type: ignore[attr-defined]
        return self._exported

    @property
    def failed(self) -> int:
        """Spans (phases counted) the exporter gave up on."""
        if self._reports is not None:
            return self._failed + int(self._reports.failed_spans)  # type: ignore[attr-defined]
        return self._failed

    def _take(self) -> tuple[list[ReadableSpan | Deferred], int]:
        """Up to ``max_batch`` spans off the queue, phases counted (one item at least), and
        how many spans that is."""
        queue, size = self._queue, 0
        batch: list[ReadableSpan | Deferred] = []
        while queue:
            phases = getattr(queue[0], "_phases", None)
            weight = 1 + len(phases) if phases else 1
            if batch and size + weight > self.max_batch:
                break
            batch.append(queue.popleft())
            size += weight
        self._taken += size
        return batch, size

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        self._export(everything=True)
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        flushed = self.span_exporter.force_flush(left_ms)  # one that exports elsewhere waits
        return flushed and time.monotonic() <= deadline

    def shutdown(self) -> None:
        """Export what is queued, within :data:`SHUTDOWN_FLUSH_S`: past it (a collector down
        or black-holed) the exporter stops retrying and the rest fails at once. Waiting on
        every batch's retries kept a stopping service ~30-50 s, past its pod's grace."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(min(self.timeout_s, SHUTDOWN_FLUSH_S))
        if self._thread.is_alive():
            stop_retrying = getattr(self.span_exporter, "stop_retrying", None)
            if stop_retrying is not None:
                stop_retrying()
        self._export(everything=True)
        self.span_exporter.shutdown()
