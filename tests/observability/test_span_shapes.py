"""The compact shapes a traced request is recorded in: shared attributes (``Constants``) and
phases (children kept as tuples on their parent). What they export must be what the spans
they stand for export: the same protobuf as the SDK's encoder writes for those spans, the
same spans through any other processor, and the same span counts in the batch queue."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from common import tracing as t
from common.otlp_encode import SpanEncoder
from common.protocol import Chunk, GenerateRequest, RequestParams, Usage
from common.span_batch import SpanBatch
from common.span_recorder import Constants, RecordedSpan, Tracer
from common.trace_context import parse
from gateway import tracing as gateway_tracing
from gateway.observe import ObserveMiddleware
from workers.engine.outputs import RequestMetrics
from workers.tracing import RequestSpans

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NO_DELAY = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}


class Kept(SpanExporter):
    """What the batch hands over, as it hands it (spans carrying their phases, as to our
    OTLP exporter)."""

    reads_phases = True

    def __init__(self) -> None:
        self.batches: list[list[ReadableSpan]] = []
        self.exported = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.batches.append(list(spans))
        self.exported.set()
        return SpanExportResult.SUCCESS


def batch_tracer(name: str, env: dict[str, str] | None = None) -> tuple[Tracer, SpanBatch, Kept]:
    kept = Kept()
    batch = SpanBatch(kept, env or NO_DELAY)
    provider = TracerProvider()
    provider.add_span_processor(batch)
    tracer = t.tracer_for(provider, name)
    assert isinstance(tracer, Tracer) and tracer.on_end == batch.add
    return tracer, batch, kept


def one_request(gateway: Tracer, worker: Tracer, n: int) -> None:
    """Request ``n`` through the gateway's and a worker's span hooks, as the services call them."""
    server = t.start_remote(gateway, "POST /v1/short/completions", parse(TRACEPARENT),
                            SpanKind.SERVER)  # fmt: skip
    assert isinstance(server, RecordedSpan)
    scope: dict[str, Any] = {"method": "POST", "path": "/v1/short/completions"}
    t.set_constants(server, t.constants(gateway, (("http.request.method", "POST"),
                                                  ("url.path", scope["path"]))))  # fmt: skip
    scope[gateway_tracing.SCOPE_KEY] = server
    rid = f"cmpl-{n:024x}"
    body = SimpleNamespace(temperature=0.7 if n % 2 else None, top_p=0.9)
    gateway_tracing.admitted(gateway, scope, kind="completion", model="dummy:tiny",
                             group="short", request_id=rid, body=body, max_tokens=16,
                             prompt_tokens=32)  # fmt: skip
    headers: dict[str, str] = {}
    with gateway_tracing.publishing(gateway, server, "qos.req.short", rid, headers, {}):
        pass
    spans = RequestSpans(worker, "worker-0", "dummy:tiny")
    params = RequestParams(max_tokens=16, temperature=0.7, top_p=0.9)
    now = time.time()
    req = GenerateRequest(id=rid, group="short", reply="r", params=params,
                          created_ms=int(now * 1000) - 3)  # fmt: skip
    span = spans.start(req, headers, group="short", attempt=1 + n % 2, subject="qos.req.short",
                       fetched_at=now)  # fmt: skip
    assert span is not None
    metrics = RequestMetrics(now, now + 0.001, now + 0.002, now + 0.004, 0, 0)
    final = Chunk(id=rid, finish_reason="length", usage=Usage(32, 16, 8))
    spans.finish(span, final, output=SimpleNamespace(metrics=metrics), fetched_at=now,
                 stream=(now + 0.002, now + 0.005), resumed_tokens=0)  # fmt: skip
    gateway_tracing.landed(server, status=200, prompt_tokens=32, completion_tokens=16,
                           finish_reason="length")  # fmt: skip
    server.set_attribute("http.response.status_code", 200)
    server.end()


def as_spans(batch: list[ReadableSpan]) -> list[ReadableSpan]:
    """The spans a batch stands for: each span's phases (ended first), then the span."""
    out: list[ReadableSpan] = []
    for span in batch:
        if isinstance(span, RecordedSpan):
            out.extend(span.phase_spans())
        out.append(span)
    return out


def parsed(data: bytes) -> pb.ExportTraceServiceRequest:
    return pb.ExportTraceServiceRequest.FromString(data)


def test_shared_attributes_and_phases_encode_as_the_sdk_encodes_the_spans_they_stand_for() -> None:
    gateway, gateway_batch, gateway_kept = batch_tracer("g")
    worker, worker_batch, worker_kept = batch_tracer("w")
    for n in range(3):
        one_request(gateway, worker, n)
    gateway_batch.force_flush()
    worker_batch.force_flush()
    batch = [s for kept in (gateway_kept, worker_kept) for b in kept.batches for s in b]
    assert len(batch) == 3 * 3  # per request: server, publish, and the worker's span

    encoder = SpanEncoder()
    for _ in range(2):  # cold, then with the shared attributes' bytes kept
        ours = parsed(encoder.encode(batch))
        assert ours == parsed(encode_spans(as_spans(batch)).SerializeToString())
    exported = [s for rs in ours.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(exported) == 3 * 7
    by_name: dict[str, list[Any]] = {}
    for s in exported:
        by_name.setdefault(s.name, []).append(s)
    assert sorted(by_name) == sorted(["POST /v1/short/completions", "publish qos.req.short",
                                      "text_completion dummy:tiny", "queue", "prefill", "decode",
                                      "stream"])  # fmt: skip
    for s in exported:  # every key once: a shared attribute is never written twice
        keys = [kv.key for kv in s.attributes]
        assert len(keys) == len(set(keys)), keys
    consumer = {kv.key: kv.value for kv in by_name["text_completion dummy:tiny"][1].attributes}
    assert consumer["gen_ai.request.model"].string_value == "dummy:tiny"
    assert consumer["qos.worker"].string_value == "worker-0"
    assert consumer["qos.attempt"].int_value == 2
    assert consumer["gen_ai.usage.output_tokens"].int_value == 16
    server = {kv.key: kv.value for kv in by_name["POST /v1/short/completions"][0].attributes}
    assert server["qos.group"].string_value == "short"
    assert server["url.path"].string_value == "/v1/short/completions"
    assert "gen_ai.request.temperature" not in server  # request 0 sent none
    assert [v.string_value for v in server["gen_ai.response.finish_reasons"].array_value.values]
    for phase in by_name["decode"]:
        parent = next(s for s in by_name["text_completion dummy:tiny"]
                      if s.span_id == phase.parent_span_id)  # fmt: skip
        assert parent.trace_id == phase.trace_id
        assert phase.start_time_unix_nano < phase.end_time_unix_nano
    for provider_batch in (gateway_batch, worker_batch):
        provider_batch.shutdown()


def test_an_attribute_set_over_a_shared_one_replaces_it_and_is_written_once() -> None:
    tracer, batch, kept = batch_tracer("t")
    span = tracer.start_span("s", attributes={"own": 1, "model": "old"})
    assert isinstance(span, RecordedSpan)
    span.set_constants(Constants({"model": "m", "group": "short", "none": None}))
    assert dict(span.attributes) == {"own": 1, "model": "m", "group": "short"}
    span.set_attribute("group", "long")  # over a shared one: this span's own from now on
    assert dict(span.attributes) == {"own": 1, "model": "m", "group": "long"}
    span.set_constants(Constants({"model": "m2", "group": "g2", "worker": "w"}))
    # Constants whose keys include the current ones replace them; a set overlapping them
    # in part is added to what they leave.
    span.set_constants(Constants({"model": "m3", "group": "g3", "worker": "w3"}))
    span.set_attributes({"worker": "w9", "x": 2})
    span.set_constants(Constants({"route": "/v1", "x": 3}))
    expected = {"own": 1, "model": "m3", "group": "g3", "worker": "w9", "x": 3, "route": "/v1"}
    assert dict(span.attributes) == expected
    span.end()
    for overwrite in ("one", "several"):  # ended while a shared attribute is overwritten
        other = tracer.start_span(overwrite)
        assert isinstance(other, RecordedSpan)
        other.set_constants(Constants({"model": "m", "group": "short"}))
        if overwrite == "one":
            other.set_attribute("group", "long")
        else:
            other.set_attributes({"model": "m9", "own": 1})
        other.end()
    batch.force_flush()
    message = parsed(SpanEncoder().encode(kept.batches[0]))
    first, one, several = message.resource_spans[0].scope_spans[0].spans
    assert [kv.key for kv in first.attributes] == list(span.attributes)
    assert {kv.key: kv.value.string_value for kv in one.attributes} == {
        "model": "m",
        "group": "long",
    }
    assert sorted(kv.key for kv in several.attributes) == ["group", "model", "own"]
    assert message == parsed(encode_spans(kept.batches[0]).SerializeToString())
    batch.shutdown()


def test_another_processor_gets_each_phase_as_a_span_of_its_own_before_its_parent() -> None:
    memory = InMemorySpanExporter()
    provider = t.init_tracing("w", exporter=memory, batch=False, set_global=False)
    tracer = t.tracer_for(provider, "w")
    assert isinstance(tracer, Tracer)
    span = tracer.start_span("parent")
    assert isinstance(span, RecordedSpan)
    t.add_phase(tracer, span, "queue", 10.0, 10.5)
    t.add_phase(tracer, span, "decode", 10.5, 11.0)
    span.end()
    queue, decode, parent = memory.get_finished_spans()
    assert (queue.name, decode.name, parent.name) == ("queue", "decode", "parent")
    assert queue.parent is not None and queue.parent.span_id == parent.context.span_id
    assert (queue.start_time, queue.end_time) == (10_000_000_000, 10_500_000_000)
    assert queue.context.trace_id == parent.context.trace_id
    assert queue.context.span_id != decode.context.span_id
    # The parent no longer carries them: an encoder after this processor writes each once.
    encoded = parsed(SpanEncoder().encode([queue, decode, parent]))
    assert len(encoded.resource_spans[0].scope_spans[0].spans) == 3


def test_a_span_and_its_phases_count_as_that_many_spans_in_the_queue_and_the_batches() -> None:
    env = {**NO_DELAY, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "12", "OTEL_BSP_MAX_QUEUE_SIZE": "100"}
    tracer, batch, kept = batch_tracer("t", env)

    def with_phases(n: int) -> None:
        span = tracer.start_span("parent")
        assert isinstance(span, RecordedSpan)
        for i in range(n):
            span.add_phase(f"p{i}", 1.0, 2.0)
        span.end()

    with_phases(4)
    with_phases(4)  # 10 spans queued: short of a batch (12), so nothing leaves yet
    assert not kept.exported.wait(0.2)
    with_phases(4)  # 15: a batch is full, and goes without waiting for the delay
    assert kept.exported.wait(5)
    batch.force_flush()
    sizes = [sum(len(as_spans([s])) for s in b) for b in kept.batches]
    assert sizes == [10, 5]  # a batch never holds more than 12 spans; a span is not split
    batch.shutdown()

    small = {**NO_DELAY, "OTEL_BSP_MAX_QUEUE_SIZE": "12"}
    tracer, batch, kept = batch_tracer("t", small)
    with_phases(4)
    with_phases(4)
    with_phases(4)  # would make 15 of 12: dropped whole, and counted as 5 spans
    assert batch.dropped == 5
    batch.force_flush()
    assert sum(len(as_spans(b)) for b in kept.batches) == 10
    batch.shutdown()


def test_an_exporter_that_reads_no_phases_gets_them_from_the_batch_as_spans() -> None:
    memory = InMemorySpanExporter()  # the SDK's exporters (otlp_proto_*, console) are such
    batch = SpanBatch(memory, NO_DELAY)
    provider = TracerProvider()
    provider.add_span_processor(batch)
    tracer = t.tracer_for(provider, "w")
    assert isinstance(tracer, Tracer) and tracer.on_end == batch.add
    span = tracer.start_span("parent")
    assert isinstance(span, RecordedSpan)
    span.add_phase("queue", 10.0, 10.5)
    span.add_phase("decode", 10.5, 11.0)
    span.end()
    batch.force_flush()
    names = [s.name for s in memory.get_finished_spans()]
    assert names == ["queue", "decode", "parent"]
    batch.shutdown()


def _delivery_spans(tracer: Tracer, flush: Any) -> list[ReadableSpan]:
    """One delivery through a worker's hooks (fetched, answered; an error chunk on the
    second attempt) and one handed back, as the spans the processors end up with."""
    spans = RequestSpans(tracer, "worker-0", "dummy:tiny")
    now = 1_700_000_000.0
    params = RequestParams(max_tokens=16, temperature=0.7, top_p=None)
    req = GenerateRequest(id="chatcmpl-1", group="short", reply="r", params=params,
                          created_ms=int(now * 1000) - 3)  # fmt: skip
    headers = {"traceparent": TRACEPARENT}
    answered = spans.start(req, headers, group="short", attempt=2, subject="qos.req.short",
                           fetched_at=now)  # fmt: skip
    metrics = RequestMetrics(now, now + 0.001, now + 0.002, now + 0.004, 0, 3)
    final = Chunk(id="chatcmpl-1", finish_reason="length", usage=Usage(32, 16, 8))
    assert answered is not None
    spans.finish(answered, final, output=SimpleNamespace(metrics=metrics), fetched_at=now,
                 stream=(now + 0.002, now + 0.001), resumed_tokens=4)  # fmt: skip
    handed_back = spans.start(req, headers, group="short", attempt=1, subject="qos.req.short",
                              fetched_at=now)  # fmt: skip
    assert handed_back is not None
    spans.abandon(handed_back, "handed_back")
    return flush()


def test_a_delivery_built_by_the_export_thread_is_the_span_built_at_once() -> None:
    """With our batch, a worker's delivery is plain values until the export thread builds
    it; with any other processor it is built when it ends. Same spans either way."""
    tracer, batch, kept = batch_tracer("w")
    deferred = _delivery_spans(tracer, lambda: (batch.force_flush(), kept.batches[-1])[1])
    # Counted while deferred: the answered delivery and its phases (queue, prefill, decode,
    # stream), then the handed-back one.
    assert batch.exported == 1 + 4 + 1
    memory = InMemorySpanExporter()
    provider = t.init_tracing("w", exporter=memory, batch=False, set_global=False)
    at_once = t.tracer_for(provider, "w")
    assert isinstance(at_once, Tracer)
    built = _delivery_spans(at_once, memory.get_finished_spans)

    def shape(span: ReadableSpan) -> tuple[Any, ...]:
        parent = span.parent.span_id if span.parent is not None else None
        phase = span.name in ("queue", "prefill", "decode", "stream")  # times from the engine
        return (span.name, span.kind, span.start_time, span.end_time if phase else None,
                dict(span.attributes),
                [e.name for e in span.events], span.status.status_code,
                parent == int(TRACEPARENT[36:52], 16))  # fmt: skip

    deferred_all = as_spans(list(deferred))
    assert len(deferred_all) == len(built) == 6
    assert sorted(map(shape, deferred_all), key=repr) == sorted(map(shape, built), key=repr)
    consumer = next(s for s in deferred_all if s.name == "chat dummy:tiny" and not s.events)
    assert consumer.attributes["qos.resumed_tokens"] == 4
    assert consumer.attributes["qos.preemptions"] == 3
    assert "gen_ai.request.top_p" not in consumer.attributes  # None values left out
    stream = next(s for s in deferred_all if s.name == "stream")
    assert stream.end_time == stream.start_time  # an end before its start is clamped
    batch.shutdown()


def _gateway_spans(tracer: Tracer, flush: Any) -> tuple[list[ReadableSpan], list[str]]:
    """Three requests through the gateway's middleware and generator hooks (answered; the
    publish failed; the app raised), as the spans the processors end up with, and the
    ``traceparent`` each publish put on the NATS message."""
    body = SimpleNamespace(temperature=0.7, top_p=None)
    sent: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        decided = gateway_tracing.admitted(
            tracer, scope, kind="chat", model="dummy:tiny", group="short",
            request_id="chatcmpl-1", body=body, max_tokens=16, prompt_tokens=32,
        )  # fmt: skip
        headers: dict[str, str] = {}
        try:
            with gateway_tracing.publishing(tracer, decided, "qos.req.short", "chatcmpl-1",
                                            headers, {}):  # fmt: skip
                if scope["path"].endswith("/refused"):
                    raise TimeoutError("no ack")
        except TimeoutError:
            status = 503
        else:
            status = 200
        sent.append(headers["traceparent"])
        if scope["path"].endswith("/crash"):
            raise RuntimeError("boom")
        scope["route"] = SimpleNamespace(path="/v1/{group}/chat/completions")
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        gateway_tracing.landed(decided, status=status, prompt_tokens=32, completion_tokens=16,
                               finish_reason="length" if status == 200 else None)  # fmt: skip

    middleware = ObserveMiddleware(app, tracer=tracer, access_log=False)

    async def receive() -> Any:
        return {}

    async def send(message: Any) -> None:
        pass

    async def run() -> None:
        for path in ("/v1/short/chat/completions", "/v1/refused", "/v1/crash"):
            scope = {"type": "http", "method": "POST", "path": path,
                     "headers": [(b"traceparent", TRACEPARENT.encode())]}  # fmt: skip
            with contextlib.suppress(RuntimeError):
                await middleware(scope, receive, send)

    asyncio.run(run())
    return flush(), sent


def test_a_gateway_request_built_by_the_export_thread_is_the_span_built_at_once() -> None:
    """With our tracer, a request's server and publish spans are plain values until the
    export thread builds them; with spans built as the request runs (a sampler that is not
    a plain function), the same spans, the same links and the same ``traceparent``."""
    tracer, batch, kept = batch_tracer("g")
    deferred, sent = _gateway_spans(tracer, lambda: (batch.force_flush(), kept.batches[-1])[1])
    assert batch.exported == 3 * 2
    memory = InMemorySpanExporter()
    provider = t.init_tracing("g", exporter=memory, batch=False, set_global=False)
    at_once = t.tracer_for(provider, "g")
    assert isinstance(at_once, Tracer)
    at_once.decide = None  # asks the sampler: the span is started and built as it runs
    built, built_sent = _gateway_spans(at_once, memory.get_finished_spans)

    def shape(span: ReadableSpan, spans: list[ReadableSpan]) -> tuple[Any, ...]:
        parent = span.parent.span_id if span.parent is not None else None
        parent_name = next((s.name for s in spans if s.context.span_id == parent), parent)
        return (span.name, span.kind, dict(span.attributes), [e.name for e in span.events],
                [dict(e.attributes or {}).get("exception.type") for e in span.events],
                span.status.status_code, span.status.description, parent_name,
                span.context.trace_id)  # fmt: skip

    assert len(deferred) == len(built) == 6
    assert sorted((shape(s, deferred) for s in deferred), key=repr) == sorted(
        (shape(s, built) for s in built), key=repr
    )
    # The client's trace continues; each publish's traceparent names its publish span.
    publishes = [s for s in deferred if s.kind is SpanKind.PRODUCER]
    assert [f"00-{TRACEPARENT[3:35]}-{s.context.span_id:016x}-01" for s in publishes] == sent
    assert [tp[:36] for tp in built_sent] == [tp[:36] for tp in sent]
    server = next(s for s in deferred if s.name == "POST /v1/{group}/chat/completions")
    assert server.parent is not None and server.parent.span_id == int(TRACEPARENT[36:52], 16)
    assert server.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert "gen_ai.request.top_p" not in server.attributes
    assert all(s.start_time <= s.end_time for s in deferred)
    batch.shutdown()


def test_the_console_exporter_prints_the_ids_of_spans_built_on_the_export_thread() -> None:
    """The SDK's ReadableSpan.to_json reads _context directly, which a recorded span built
    from plain values (a gateway request, a phase) never set: the console exporter printed
    "context": null, and its lines could not be put together into a trace."""
    import json

    tracer, batch, _ = batch_tracer("g")
    parent = parse(TRACEPARENT)
    call = gateway_tracing.ServerCall(tracer, parent.trace_id, parent, "POST", "/v1/completions")
    call.end(200, "/v1/completions")
    printed = json.loads(call.build().to_json())  # what ConsoleSpanExporter prints
    assert printed["context"]["trace_id"] == f"0x{parent.trace_id:032x}"
    assert printed["context"]["span_id"] == f"0x{call.span_id:016x}"
    batch.shutdown()
