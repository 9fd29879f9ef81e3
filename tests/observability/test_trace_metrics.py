"""Tracing's own counts on /metrics: spans exported, failed, dropped; the export's CPU."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common import tracing as t
from common.span_batch import SpanBatch
from common.span_recorder import RecordedSpan
from common.trace_metrics import register_trace_metrics

NO_DELAY = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_QUEUE_SIZE": "12"}


class FailsSecond(SpanExporter):
    """Succeeds, then fails, then succeeds..., burning a little CPU each time."""

    reads_phases = True

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        sum(i * i for i in range(20_000))
        return SpanExportResult.SUCCESS if self.calls % 2 else SpanExportResult.FAILURE


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str | None], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels.get("outcome")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _request(tracer: t.Tracer, phases: int) -> None:
    span = tracer.start_span("parent")
    assert isinstance(span, RecordedSpan)
    for i in range(phases):
        span.add_phase(f"p{i}", 1.0, 2.0)
    span.end()


def test_spans_by_fate_the_queue_and_the_export_cpu_are_served() -> None:
    batch = SpanBatch(FailsSecond(), NO_DELAY)
    provider = TracerProvider()
    provider.add_span_processor(batch)
    tracer = t.tracer_for(provider, "svc")
    registry = CollectorRegistry()
    assert register_trace_metrics(registry, tracer)
    try:
        _request(tracer, 4)  # 5 spans
        _request(tracer, 4)  # 10 queued
        _request(tracer, 4)  # 15 > 12: dropped whole
        assert _samples(registry)[("qos_trace_queue_spans", None)] == 10
        batch.force_flush()  # one batch of 10, exported
        _request(tracer, 2)  # 3 spans
        batch.force_flush()  # refused by the exporter
        got = _samples(registry)
        assert got[("qos_trace_spans_total", "exported")] == 10
        assert got[("qos_trace_spans_total", "failed")] == 3
        assert got[("qos_trace_spans_total", "dropped")] == 5
        assert got[("qos_trace_queue_spans", None)] == 0
        assert got[("qos_trace_export_cpu_seconds_total", None)] > 0
    finally:
        batch.shutdown()


def test_nothing_is_registered_with_tracing_off_or_another_sdks_tracer() -> None:
    registry = CollectorRegistry()
    assert not register_trace_metrics(registry, None)
    other = TracerProvider().get_tracer("sdk")  # the SDK's own tracer: it counts for itself
    assert not register_trace_metrics(registry, other)
    assert "qos_trace" not in generate_latest(registry).decode()
