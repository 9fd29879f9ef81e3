"""The hand-written OTLP encoder against the SDK's, and the exporter against real receivers."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from common.otlp_encode import SpanEncoder
from common.otlp_export import OtlpSettings, OtlpSpanExporter
from common.services import free_port
from common.tracing import extract, init_tracing, inject, tracer_for

REMOTE = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
    trace_state=TraceState([("vendor", "1"), ("other", "x-y")]),
)
LOCAL = SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(0))

# Every attribute type OTLP carries, edge values included.
ATTRIBUTES: dict[str, Any] = {
    "str": "dummy:tiny",
    "str.empty": "",
    "str.unicode": "héllo ✓ 世界",
    "str.long": "x" * 300,
    "bool.true": True,
    "bool.false": False,
    "int.zero": 0,
    "int.small": 7,
    "int.big": 2**62 + 3,
    "int.negative": -42,
    "int.min": -(2**63),
    "float": 0.7,
    "float.zero": 0.0,
    "float.negative": -1.5e-300,
    "strs": ("length", "stop"),
    "bools": [True, False],
    "ints": (1, -1, 2**40),
    "floats": (0.1, 2.0),
    "empty": (),
}


class Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def sdk_spans(keep: Keep) -> None:
    """Spans of the SDK's own tracer: two scopes (one versioned, with a schema and
    attributes), limits that drop attributes/events/links, links, events, statuses."""
    provider = TracerProvider(
        resource=Resource({"service.name": "sdk-svc", "host.id": 3}, "https://schema/1.0"),
        span_limits=SpanLimits(max_span_attributes=len(ATTRIBUTES), max_events=2, max_links=1),
    )
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider.add_span_processor(SimpleSpanProcessor(keep))
    plain = provider.get_tracer("plain")
    scoped = provider.get_tracer("scoped", "1.2.3", "https://schema/2.0", {"scope.attr": "on"})
    remote_ctx = trace.set_span_in_context(trace.NonRecordingSpan(REMOTE))
    with plain.start_as_current_span("root", kind=SpanKind.SERVER) as root:
        root.set_attributes({"a": 1, "b": "two", "c": 3.0, "d": True, "e": "dropped"})
        with scoped.start_as_current_span(
            "child", links=[Link(REMOTE, {"link.attr": 1}), Link(LOCAL)]
        ) as child:
            child.set_attributes({**ATTRIBUTES, "one too many": 1})
            child.add_event("first", {"event.attr": "x", "n": 2}, timestamp=1_000)
            child.add_event("second")
            child.add_event("third: dropped")
            child.set_status(Status(StatusCode.ERROR, "it broke"))
    with scoped.start_as_current_span("remote child", context=remote_ctx, kind=SpanKind.CONSUMER):
        pass
    span = plain.start_span("ok", kind=SpanKind.CLIENT, start_time=5, attributes=ATTRIBUTES)
    span.set_status(Status(StatusCode.OK))
    span.end(end_time=10)


def our_spans(keep: Keep) -> None:
    """Spans of this project's tracer, as the services record them: two services (two
    resources), a remote parent with a trace state, every attribute type, an exception."""
    gateway = tracer_for(init_tracing("gateway", exporter=keep, batch=False, set_global=False), "g")
    worker = tracer_for(init_tracing("worker", exporter=keep, batch=False, set_global=False), "w")
    assert gateway is not None and worker is not None
    headers = {"traceparent": f"00-{REMOTE.trace_id:032x}-{REMOTE.span_id:016x}-01",
               "tracestate": "vendor=1,other=x-y"}  # fmt: skip
    server = gateway.start_span("POST /v1/chat", context=extract(headers), kind=SpanKind.SERVER)
    # Beyond the API's types, as the SDK's encoder takes them (bytes, mappings, nesting) or
    # leaves them out (an int past int64, a lone surrogate, an object).
    server.set_attributes({**ATTRIBUTES, "bytes": b"\x00\xff", "map": {"k": 1, "in": {"x": [1.5]}},
                           "nested": [["a"], [True]], "too big": 2**70, "surrogate": "a\ud800",
                           "object": object(), "gone": None})  # fmt: skip
    publish = gateway.start_span(
        "publish", context=trace.set_span_in_context(server), kind=SpanKind.PRODUCER
    )
    out: dict[str, str] = {}
    inject(out, publish)
    publish.end()
    consumer = worker.start_span("chat m", context=extract(out), kind=SpanKind.CONSUMER)
    consumer.record_exception(ValueError("boom"))
    consumer.set_status(Status(StatusCode.ERROR, "engine: boom"))
    for phase in ("queue", "prefill", "decode", "stream"):
        worker.start_span(phase, context=trace.set_span_in_context(consumer)).end()
    consumer.end()
    server.end()


def parsed(data: bytes) -> pb.ExportTraceServiceRequest:
    return pb.ExportTraceServiceRequest.FromString(data)


@pytest.fixture(scope="module")
def spans() -> list[ReadableSpan]:
    keep = Keep()
    sdk_spans(keep)
    our_spans(keep)
    return keep.spans


def test_spans_of_both_tracers_encode_to_the_message_the_sdk_encodes(
    spans: list[ReadableSpan],
) -> None:
    ours = parsed(SpanEncoder().encode(spans))
    theirs = parsed(encode_spans(spans).SerializeToString())
    assert ours == theirs
    # The set really is varied: two services and the SDK's resource; scopes, links,
    # events, dropped counts, statuses, remote parents and trace states all present.
    assert len(ours.resource_spans) == 3
    all_spans = [s for rs in ours.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(all_spans) == len(spans) == 11
    assert any(s.links for s in all_spans) and any(s.events for s in all_spans)
    dropped = [(s.dropped_attributes_count, s.dropped_events_count, s.dropped_links_count)
               for s in all_spans]  # fmt: skip
    assert (1, 1, 1) in dropped
    assert {s.status.code for s in all_spans} == {0, 1, 2}
    assert any(s.flags == 0x300 for s in all_spans) and any(s.trace_state for s in all_spans)


def test_each_span_alone_and_a_warm_encoder_give_the_same_messages(
    spans: list[ReadableSpan],
) -> None:
    encoder = SpanEncoder()
    encoder.encode(spans)  # its caches now hold every key, value, resource and scope
    for span in spans:
        assert parsed(encoder.encode([span])) == parsed(encode_spans([span]).SerializeToString())
    assert encoder.encode([]) == b"" == encode_spans([]).SerializeToString()


def test_equal_values_of_different_kinds_under_one_key_keep_their_own_encodings() -> None:
    """1 == 1.0 == True and (1,) == (1.0,): a warm encoder must not hand one the other's
    cached field."""
    exporter = Keep()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("kinds")
    for value in (1, 1.0, True, ("1",), (1,), (1.0,), (True,), "1", 0, 0.0, False):
        with tracer.start_as_current_span("s", attributes={"x": value}):
            pass
    encoder = SpanEncoder()
    for _ in range(2):  # cold, then every value cached
        for span in exporter.spans:
            assert parsed(encoder.encode([span])) == parsed(
                encode_spans([span]).SerializeToString()
            ), span.attributes


# --- the exporter, end to end ----------------------------------------------------------------


@dataclass
class Receiver:
    """OTLP receivers in this process: gRPC and HTTP/protobuf on free ports. The first
    ``fail_first`` requests are answered with ``fail_status`` (HTTP) / UNAVAILABLE (gRPC)."""

    fail_first: int = 0
    fail_status: int = 503
    requests: list[pb.ExportTraceServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def failing(self) -> bool:
        with self.lock:
            self.calls += 1
            return self.calls <= self.fail_first

    def spans(self) -> list[Any]:
        return [s for r in self.requests for rs in r.resource_spans
                for ss in rs.scope_spans for s in ss.spans]  # fmt: skip


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, dict[str, str]]]:
    """A receiver and its endpoints by protocol."""
    got = Receiver()

    class Grpc(pb_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            if got.failing():
                context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
            got.headers.append(dict(context.invocation_metadata()))
            got.requests.append(request)
            return pb.ExportTraceServiceResponse()

    class Http(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status = got.fail_status if got.failing() else 200
            if status == 200:
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                got.headers.append({k.lower(): v for k, v in self.headers.items()})
                got.requests.append(pb.ExportTraceServiceRequest.FromString(body))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    grpc_port, http_port = free_port(), free_port()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TraceServiceServicer_to_server(Grpc(), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", http_port), Http)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield (
        got,
        {"grpc": f"http://127.0.0.1:{grpc_port}", "http/protobuf": f"http://127.0.0.1:{http_port}"},
    )
    http.shutdown()
    server.stop(grace=0)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_batch_processor_delivers_spans_through_the_exporter_with_the_configured_headers(
    receiver: tuple[Receiver, dict[str, str]], protocol: str
) -> None:
    got, endpoints = receiver
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoints[protocol],
        "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=blue,authorization=Bearer%20t0k",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
    }
    provider = init_tracing("svc", env=env, set_global=False)  # batch: as the services run
    assert provider is not None
    tracer = tracer_for(provider, "t")
    assert tracer is not None
    ids = set()
    for i in range(20):
        span = tracer.start_span(f"span {i}", attributes={"i": i})
        ids.add(span.span_id.to_bytes(8, "big"))
        span.end()
    assert provider.force_flush(10_000)
    (exporter,) = [p.span_exporter for p in provider._active_span_processor._span_processors]
    provider.shutdown()
    assert {s.span_id for s in got.spans()} == ids
    assert got.headers[0]["x-tenant"] == "blue"
    assert got.headers[0]["authorization"] == "Bearer t0k"
    if protocol == "http/protobuf":  # gRPC compresses inside its own framing
        assert got.headers[0]["content-encoding"] == "gzip"
    assert isinstance(exporter, OtlpSpanExporter)
    assert (exporter.exported_spans, exporter.failed_batches) == (20, 0)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_transient_failure_is_retried_and_the_batch_arrives_once(
    receiver: tuple[Receiver, dict[str, str]], protocol: str, spans: list[ReadableSpan]
) -> None:
    got, endpoints = receiver
    got.fail_first = 2
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoints[protocol]}
    exporter = OtlpSpanExporter(OtlpSettings.from_env(env, protocol), backoff_s=0.01)
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert exporter.retries == 2 and len(got.requests) == 1
    assert got.requests[0] == parsed(encode_spans(spans).SerializeToString())
    exporter.shutdown()


def test_a_rejected_batch_is_dropped_counted_and_not_retried(
    receiver: tuple[Receiver, dict[str, str]], spans: list[ReadableSpan]
) -> None:
    got, endpoints = receiver
    got.fail_first, got.fail_status = 1, 400
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoints["http/protobuf"]}
    exporter = OtlpSpanExporter(OtlpSettings.from_env(env, "http/protobuf"), backoff_s=0.01)
    assert exporter.export(spans) is SpanExportResult.FAILURE
    assert (got.calls, exporter.retries, exporter.failed_batches) == (1, 0, 1)
    assert exporter.failed_spans == len(spans)
    assert exporter.export(spans) is SpanExportResult.SUCCESS  # the next batch goes on
    exporter.shutdown()
    assert exporter.export(spans) is SpanExportResult.FAILURE  # after shutdown, no sending


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_unreachable_collector_fails_the_export_within_its_timeout_without_raising(
    protocol: str, spans: list[ReadableSpan]
) -> None:
    import time

    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
    }
    exporter = OtlpSpanExporter(OtlpSettings.from_env(env, protocol), backoff_s=0.05)
    t0 = time.monotonic()
    assert exporter.export(spans) is SpanExportResult.FAILURE
    assert time.monotonic() - t0 < 3.0  # its 1 s timeout, gRPC's channel set-up, a busy machine
    assert exporter.retries >= 1 and exporter.failed_batches == 1
    exporter.shutdown()


def test_settings_read_the_variables_as_the_sdk_exporters_do() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317",
        "OTEL_EXPORTER_OTLP_HEADERS": "a=1",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=2",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "3",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem",
    }
    grpc_settings = OtlpSettings.from_env(env, "grpc")
    assert grpc_settings.endpoint == "collector:4317" and not grpc_settings.insecure
    assert grpc_settings.headers == (("b", "2"),) and grpc_settings.timeout_s == 3.0
    assert grpc_settings.certificate == "/ca.pem"
    plain = OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "grpc")
    assert plain.insecure and plain.endpoint == "c:4317"
    forced = {"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    assert OtlpSettings.from_env(forced, "grpc").insecure
    http = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}
    assert OtlpSettings.from_env(http, "http/protobuf").endpoint == "http://c:4318/v1/traces"
    signal = {**http, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/custom"}
    assert OtlpSettings.from_env(signal, "http/protobuf").endpoint == "http://t:9/custom"
    assert OtlpSettings.from_env({}, "http/protobuf").endpoint == "http://localhost:4318/v1/traces"
    # The spec's (and every other SDK's) milliseconds: 10000 is 10 s, not 2.8 hours.
    for raw, seconds in (("10000", 10.0), ("1000", 1.0), ("500", 0.5), ("30", 30.0)):
        shared = OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": raw}, "http/protobuf")
        assert shared.timeout_s == seconds, raw  # 1000 was 17 minutes
    with pytest.raises(ValueError):
        OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_COMPRESSION": "deflate"}, "grpc")


def test_shutdown_gives_up_a_black_holed_collector_within_its_flush_budget(
    spans: list[ReadableSpan], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector that accepts connections and never answers: each queued batch waited
    its whole export timeout, retries included, and a stopping service sat ~30-50 s, past
    its pod's grace. Past the flush budget the exporter stops and the rest fails at once."""
    import socket
    import time

    from common import span_batch
    from common.span_batch import SpanBatch

    monkeypatch.setattr(span_batch, "SHUTDOWN_FLUSH_S", 0.3)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # never accepted, never answered
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hole.getsockname()[1]}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1500",
        "OTEL_BSP_SCHEDULE_DELAY": "10",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(len(spans)),
    }
    exporter = OtlpSpanExporter(OtlpSettings.from_env(env, "http/protobuf"), backoff_s=0.05)
    batch = SpanBatch(exporter, env)
    try:
        for _ in range(5):  # five batches queued
            for span in spans:
                batch.on_end(span)
        time.sleep(0.1)  # the export thread is inside the first batch's send
        t0 = time.monotonic()
        batch.shutdown()
        took = time.monotonic() - t0
    finally:
        hole.close()
    assert took < 5.0  # the send in flight ends within its 1.5 s, the rest at once (was >= 7.5)
    assert batch.failed == 5 * len(spans) and batch.exported == 0
