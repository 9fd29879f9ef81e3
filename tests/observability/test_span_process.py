"""OTLP export from a process of its own: what arrives equals the in-process exporter's."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from common import span_process
from common import tracing as t
from common.otlp_encode import SpanEncoder
from common.span_batch import SpanBatch
from common.span_process import ProcessSpanExporter
from common.tracing import init_tracing, tracer_for
from tests.observability.test_otlp_encode import Receiver, parsed, receiver  # noqa: F401
from tests.observability.test_span_shapes import Kept, one_request

NO_DELAY = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}


def _by_id(spans: list[Any]) -> dict[bytes, Any]:
    return {s.span_id: s for s in spans}


def test_spans_exported_by_the_process_equal_the_in_process_encoding(
    receiver: tuple[Receiver, dict[str, str]],  # noqa: F811
) -> None:
    got, endpoints = receiver
    # What the services record: two tracers, shared attributes, phases kept as tuples.
    kept_g, kept_w = Kept(), Kept()
    providers = []
    for kept in (kept_g, kept_w):
        provider = TracerProvider()
        provider.add_span_processor(SpanBatch(kept, NO_DELAY))
        providers.append(provider)
    gateway, worker = (t.tracer_for(p, name) for p, name in zip(providers, "gw", strict=True))
    for n in range(20):
        one_request(gateway, worker, n)  # type: ignore[arg-type]
    for provider in providers:
        provider.force_flush()
    batch = [s for kept in (kept_g, kept_w) for b in kept.batches for s in b]
    # Odd attributes: an int past 64 bits and an object are left out, as the encoder does.
    batch[0]._vars.update({"too big": 2**70, "object": object(), "bytes": b"\x00\xff"})

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoints["http/protobuf"]}
    exporter = ProcessSpanExporter(env, "http/protobuf")
    try:
        assert exporter.export(batch[:15]).name == "SUCCESS"
        assert exporter.export(batch[15:]).name == "SUCCESS"
        assert exporter.force_flush()
    finally:
        exporter.shutdown()
    arrived = _by_id(got.spans())
    in_process = parsed(SpanEncoder().encode(batch))
    expected = _by_id([s for rs in in_process.resource_spans for ss in rs.scope_spans
                       for s in ss.spans])  # fmt: skip

    # Phases get their span ids where they are encoded: compare them by what they are.
    def key(s: Any) -> tuple[Any, ...]:
        return (s.trace_id, s.parent_span_id, s.name, s.start_time_unix_nano, s.end_time_unix_nano)

    phases = {"queue", "prefill", "decode", "stream"}
    assert sorted(key(s) for s in arrived.values() if s.name in phases) == sorted(
        key(s) for s in expected.values() if s.name in phases
    )
    whole = {i: s for i, s in arrived.items() if s.name not in phases}
    assert whole == {i: s for i, s in expected.items() if s.name not in phases}
    assert len(arrived) == len(expected) == 20 * 7


def test_services_switch_to_it_by_environment_and_shutdown_delivers_everything(
    receiver: tuple[Receiver, dict[str, str]],  # noqa: F811
) -> None:
    got, endpoints = receiver
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoints["grpc"], "QOSSERVE_OTLP_EXPORT_PROCESS": "1",
           **NO_DELAY}  # fmt: skip
    provider = init_tracing("worker", env=env, set_global=False)
    assert provider is not None
    (batch,) = provider._active_span_processor._span_processors
    assert isinstance(batch, SpanBatch) and isinstance(batch.span_exporter, ProcessSpanExporter)
    tracer = tracer_for(provider, "w")
    for _ in range(5):
        span = tracer.start_span("work")  # type: ignore[union-attr]
        span.add_phase("queue", time.time() - 0.01, time.time())  # type: ignore[attr-defined]
        span.end()
    provider.shutdown()  # nothing was flushed before: the queue and the pipe drain here
    assert len(got.spans()) == 10
    assert (batch.exported, batch.failed) == (10, 0)  # as the child reported them


def test_the_child_exits_when_the_service_is_gone(
    receiver: tuple[Receiver, dict[str, str]],  # noqa: F811
) -> None:
    _, endpoints = receiver
    exporter = ProcessSpanExporter({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoints["grpc"]}, "grpc")
    child = exporter._proc
    assert child.stdin is not None
    child.stdin.close()  # what the service's death does to the pipe
    assert child.wait(15) == 0
    assert exporter.export([]).name == "FAILURE"  # and the service side says so


def test_shared_definitions_forgotten_between_batches_are_sent_again(
    receiver: tuple[Receiver, dict[str, str]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_REFS the service and the child forget resources, scopes and constants
    together, at a batch boundary, and every span still arrives whole."""
    monkeypatch.setattr(span_process, "MAX_REFS", 3)
    got, endpoints = receiver
    kept = Kept()
    provider = TracerProvider()
    provider.add_span_processor(SpanBatch(kept, NO_DELAY))
    tracer = t.tracer_for(provider, "w")
    exporter = ProcessSpanExporter({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoints["http/protobuf"]},
                                   "http/protobuf")  # fmt: skip
    try:
        for n in range(6):  # a set of shared attributes per batch: the table fills and resets
            span = tracer.start_span("work")  # type: ignore[union-attr]
            t.set_constants(span, t.constants(tracer, (("qos.group", f"g{n}"),)))  # type: ignore[arg-type]
            span.end()
            provider.force_flush()
            assert exporter.export(kept.batches[-1]).name == "SUCCESS"
        assert exporter.force_flush()
    finally:
        exporter.shutdown()
    groups = sorted(a.value.string_value for s in got.spans() for a in s.attributes
                    if a.key == "qos.group")  # fmt: skip
    assert groups == [f"g{n}" for n in range(6)]


def test_the_export_child_is_out_of_reach_of_the_terminals_ctrl_c() -> None:
    """In the service's process group, a Ctrl-C killed the child at once, and the spans of
    the service's own drain had nowhere to go."""
    import os

    exporter = ProcessSpanExporter({}, "http/protobuf")
    try:
        child = exporter._proc.pid
        assert os.getpgid(child) != os.getpgid(0) and os.getsid(child) == child
    finally:
        exporter.shutdown()


def _refused_endpoint() -> str:
    """An http URL on a loopback port nobody listens on (connections refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_spans_the_child_could_not_deliver_count_failed_and_shutdown_keeps_its_budget() -> None:
    """The child retries a refused collector for up to its 60 s timeout; the service's
    shutdown tells it to stop retrying once its budget is spent, and counts the spans the
    child gave up on as failed, not as exported when they entered the pipe."""
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_ENDPOINT": _refused_endpoint(),
           "OTEL_EXPORTER_OTLP_TIMEOUT": "60", "QOSSERVE_OTLP_EXPORT_PROCESS": "1",
           **NO_DELAY}  # fmt: skip
    provider = init_tracing("worker", env=env, set_global=False)
    assert provider is not None
    (batch,) = provider._active_span_processor._span_processors
    assert isinstance(batch, SpanBatch) and isinstance(batch.span_exporter, ProcessSpanExporter)
    batch.span_exporter._shutdown_s = 1.0
    tracer = tracer_for(provider, "w")
    for _ in range(5):
        span = tracer.start_span("work")  # type: ignore[union-attr]
        span.add_phase("queue", time.time() - 0.01, time.time())  # type: ignore[attr-defined]
        span.end()
    started = time.monotonic()
    provider.shutdown()
    # Far inside the child's own 60 s of retries (a liveness bound, not a speed figure).
    assert time.monotonic() - started < 30
    assert batch.span_exporter._proc.poll() is not None
    assert (batch.exported, batch.failed) == (0, 10)


def test_a_child_killed_with_spans_in_hand_counts_them_failed(
    receiver: tuple[Receiver, dict[str, str]],  # noqa: F811
) -> None:
    got, endpoints = receiver
    kept = Kept()
    provider = TracerProvider()
    provider.add_span_processor(SpanBatch(kept, NO_DELAY))
    tracer = t.tracer_for(provider, "w")
    for _ in range(3):
        tracer.start_span("work").end()  # type: ignore[union-attr]
    provider.force_flush()
    exporter = ProcessSpanExporter(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoints["http/protobuf"]}, "http/protobuf"
    )
    assert exporter.export(kept.batches[-1]).name == "SUCCESS"
    assert exporter.force_flush()
    assert (exporter.delivered, exporter.failed_spans) == (3, 0)
    exporter._proc.send_signal(signal.SIGSTOP)  # it holds the next batch unexported ...
    try:
        assert exporter.export(kept.batches[-1]).name == "SUCCESS"
    finally:
        exporter._proc.kill()  # ... when it dies
    exporter._reader.join(10)
    exporter.shutdown()
    assert (exporter.delivered, exporter.failed_spans) == (3, 3)
    assert len(got.spans()) == 3


@pytest.mark.parametrize(
    "bad",
    [
        {"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"},
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "10s"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "c:4318"},
    ],
)
def test_a_bad_otlp_setting_is_refused_at_start_with_the_export_process_too(
    bad: dict[str, str],
) -> None:
    """The service handed the settings to its export process unread: the child died of the
    bad value, the service started as if fine, and every span failed for its life. In
    process, the same value was the clear start-up error the services turn into exit 2."""
    env = {"OTEL_TRACES_EXPORTER": "otlp", "QOSSERVE_OTLP_EXPORT_PROCESS": "1", **bad}
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP"):
        init_tracing("worker", env=env, set_global=False)
