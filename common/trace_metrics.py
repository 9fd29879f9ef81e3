"""What tracing itself costs and loses, on each service's ``/metrics``.

With tracing on, an operator needs two answers the spans cannot give: are spans being lost
(the export queue full because the collector is slow or down; the exporter giving up on a
batch), and what does exporting cost this process. :class:`SpanBatch` counts both; this
collector reads the counts when Prometheus scrapes, so the request path pays nothing:

- ``qos_trace_spans_total{outcome="exported|failed|dropped"}``
- ``qos_trace_export_cpu_seconds_total``: the export thread's CPU (encoding and sending)
- ``qos_trace_queue_spans``: spans waiting to be exported

Spans a worker keeps as phases of its request span count one each, as they are exported.
"""

from __future__ import annotations

from collections.abc import Iterator

from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common import metrics as m
from common.span_batch import SpanBatch
from common.span_recorder import Tracer as RecordingTracer


class TraceExportCollector(Collector):
    """The counts of the span batches behind one tracer, summed."""

    def __init__(self, batches: list[SpanBatch]) -> None:
        self.batches = batches

    def collect(self) -> Iterator[Metric]:
        spans = CounterMetricFamily(m.TRACE_SPANS.name, m.TRACE_SPANS.doc, labels=["outcome"])
        for outcome in ("exported", "failed", "dropped"):
            spans.add_metric([outcome], sum(getattr(b, outcome) for b in self.batches))
        yield spans
        cpu = sum(b.export_cpu_s for b in self.batches)
        yield CounterMetricFamily(m.TRACE_EXPORT_CPU.name, m.TRACE_EXPORT_CPU.doc, value=cpu)
        queued = sum(b.queued for b in self.batches)
        yield GaugeMetricFamily(m.TRACE_QUEUE.name, m.TRACE_QUEUE.doc, value=queued)


def register_trace_metrics(registry: CollectorRegistry, tracer: Tracer | None) -> bool:
    """Serve ``tracer``'s export counts in ``registry``; False (nothing registered) when
    tracing is off or the tracer is not ours (an outside SDK counts for itself)."""
    if not isinstance(tracer, RecordingTracer):
        return False
    batches = [p for p in tracer.processor._span_processors if isinstance(p, SpanBatch)]
    if not batches:
        return False
    registry.register(TraceExportCollector(batches))
    return True
