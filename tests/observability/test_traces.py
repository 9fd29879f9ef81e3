"""One trace per request: gateway server span → publish span → worker spans, over real NATS."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from nats.aio.client import Client
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from common.config import Config
from common.subjects import Subjects
from common.tracing import init_tracing, resource_attributes, tracer_for
from tests.gateway.conftest import serve
from tests.observability.conftest import (
    MODEL,
    SLOW,
    StartWorker,
    Traced,
    stream_completion,
    wait_live,
)

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def by_kind(spans: list[ReadableSpan], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind == kind]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans if parent_id(s) == parent.context.span_id}


def worker_done(spans: list[ReadableSpan], attempts: int = 1) -> bool:
    done = [s for s in by_kind(spans, SpanKind.CONSUMER) if "qos.outcome" not in s.attributes]
    return len(by_kind(spans, SpanKind.CONSUMER)) >= attempts and bool(done)


async def test_streamed_request_is_one_trace_from_gateway_to_worker_with_genai_attributes(
    config: Config, start_worker: StartWorker, traced: Traced
) -> None:
    await start_worker("w-trace", tracer_provider=traced.provider)
    async with (
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await wait_live(http, "short")
        events = await stream_completion(
            http, "/v1/short/completions", prompt="hello", max_tokens=6, temperature=0.5,
            top_p=0.9,
        )  # fmt: skip
    assert events[-1] == "[DONE]"
    spans = await traced.wait_for(worker_done)

    assert {s.context.trace_id for s in spans} == {spans[0].context.trace_id}  # ONE trace
    (server,) = by_kind(spans, SpanKind.SERVER)
    (publish,) = by_kind(spans, SpanKind.PRODUCER)
    (worker,) = by_kind(spans, SpanKind.CONSUMER)
    assert server.parent is None  # the client sent no traceparent: the gateway starts it
    assert server.name == "POST /v1/{group}/completions"
    assert parent_id(publish) == server.context.span_id
    assert publish.name == f"publish {Subjects(config.nats.subject_prefix).request('short')}"
    assert parent_id(worker) == publish.context.span_id
    assert worker.parent is not None and worker.parent.is_remote  # crossed NATS
    phases = children(spans, worker)
    assert set(phases) == {"queue", "prefill", "decode", "stream"}
    assert phases["queue"].end_time <= phases["prefill"].start_time <= phases["decode"].start_time
    for phase in phases.values():
        assert worker.start_time <= phase.start_time <= phase.end_time <= worker.end_time
    assert server.start_time <= publish.start_time <= worker.start_time <= server.end_time

    request_id = server.attributes["gen_ai.response.id"]
    expected = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "qosserve",  # required by the GenAI conventions
        "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": 6,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.response.id": request_id,
        "gen_ai.usage.input_tokens": 6,  # BOS + "hello", a token a byte
        "gen_ai.usage.output_tokens": 6,
        "gen_ai.response.finish_reasons": ("length",),
        "qos.group": "short",
    }
    for span in (server, worker):
        assert {k: span.attributes.get(k) for k in expected} == expected, span.name
    assert worker.attributes["qos.worker"] == "w-trace"
    assert worker.attributes["qos.attempt"] == 1
    assert worker.name == f"text_completion {MODEL}"
    assert server.attributes["http.response.status_code"] == 200
    assert publish.attributes["messaging.message.id"] == request_id


async def test_the_clients_traceparent_is_the_parent_of_the_gateway_span(
    config: Config, start_worker: StartWorker, traced: Traced
) -> None:
    await start_worker("w-parent", tracer_provider=traced.provider)
    async with (
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await wait_live(http, "short")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        response = await http.post(
            "/v1/short/chat/completions", json=body, headers={"traceparent": TRACEPARENT}
        )
    assert response.status_code == 200
    spans = await traced.wait_for(worker_done)
    assert {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}
    (server,) = by_kind(spans, SpanKind.SERVER)
    assert format(parent_id(server) or 0, "016x") == CLIENT_SPAN
    (worker,) = by_kind(spans, SpanKind.CONSUMER)
    assert worker.attributes["gen_ai.operation.name"] == "chat"
    assert server.attributes["gen_ai.operation.name"] == "chat"


async def test_a_redelivered_request_shows_both_attempts_in_one_trace(
    config: Config, start_worker: StartWorker, traced: Traced
) -> None:
    first = await start_worker("w-first", cost=SLOW, tracer_provider=traced.provider)
    async with (
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=20) as http,
    ):
        await wait_live(http, "short")
        streaming = asyncio.create_task(
            stream_completion(http, "/v1/short/completions", prompt="abc", max_tokens=40)
        )
        while not first.inflight_ids:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # ~10 of 40 tokens out: hand it back mid-stream
        await first.stop(grace_s=0)
        await start_worker("w-second", cost=SLOW, tracer_provider=traced.provider)
        assert (await streaming)[-1] == "[DONE]"
    spans = await traced.wait_for(lambda s: worker_done(s, attempts=2), timeout_s=15)
    attempts = sorted(by_kind(spans, SpanKind.CONSUMER), key=lambda s: s.attributes["qos.attempt"])
    assert [s.attributes["qos.attempt"] for s in attempts] == [1, 2]
    assert [s.attributes["qos.worker"] for s in attempts] == ["w-first", "w-second"]
    assert attempts[0].attributes["qos.outcome"] == "handed_back"
    assert attempts[1].attributes["qos.resumed_tokens"] > 0
    assert attempts[1].attributes["gen_ai.usage.output_tokens"] == 40
    (publish,) = by_kind(spans, SpanKind.PRODUCER)
    assert {parent_id(s) for s in attempts} == {publish.context.span_id}
    assert len({s.context.trace_id for s in spans}) == 1


async def test_tracing_off_builds_no_spans_and_still_forwards_the_clients_traceparent(
    config: Config, start_worker: StartWorker, nc: Client
) -> None:
    # Nobody in this process set a provider: the API's proxy, which records nothing.
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracer_for(None, "x") is None
    assert init_tracing("off", env={}) is None
    assert init_tracing("off", env={"OTEL_TRACES_EXPORTER": "none"}) is None
    assert (
        init_tracing("off", env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
        is None
    )
    worker = await start_worker("w-off")
    assert worker.observer.spans is None
    seen: list[dict[str, str]] = []

    async def on_request(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(dict(msg.headers or {}))

    await nc.subscribe(Subjects(config.nats.subject_prefix).request("short"), cb=on_request)
    async with (
        serve(config) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await wait_live(http, "short")
        generator = gw.app.state.gateway.generator
        assert generator is not None and generator._tracer is None
        response = await http.post(
            "/v1/short/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"},
        )
    assert response.status_code == 200
    for _ in range(50):
        if seen:
            break
        await asyncio.sleep(0.02)
    assert seen[0]["traceparent"] == TRACEPARENT and seen[0]["tracestate"] == "vendor=1"


def test_otel_variables_pick_the_exporter() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from common.otlp_export import OtlpSpanExporter

    def exporters(env: dict[str, str]) -> list[object]:
        provider = init_tracing("svc", env=env, set_global=False)
        assert provider is not None
        processors = provider._active_span_processor._span_processors
        found = [p.span_exporter for p in processors]
        provider.shutdown()
        return found

    (grpc,) = exporters({"OTEL_TRACES_EXPORTER": "otlp"})
    assert isinstance(grpc, OtlpSpanExporter)
    assert grpc.settings.protocol == "grpc" and grpc.settings.endpoint == "localhost:4317"
    (http,) = exporters(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        }
    )
    assert isinstance(http, OtlpSpanExporter)
    assert http.settings.endpoint == "http://collector:4318/v1/traces"
    assert [type(e) for e in exporters({"OTEL_TRACES_EXPORTER": "console,otlp"})] == [
        ConsoleSpanExporter,
        OtlpSpanExporter,
    ]
    # The SDK's own exporters, by the SDK's names for them.
    (sdk_grpc,) = exporters({"OTEL_TRACES_EXPORTER": "otlp_proto_grpc"})
    assert isinstance(sdk_grpc, Grpc)
    (sdk_http,) = exporters(
        {"OTEL_TRACES_EXPORTER": "otlp_proto_http", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    )
    assert isinstance(sdk_http, Http) and sdk_http._endpoint == "http://c:4318/v1/traces"
    provider = init_tracing("svc", env={"OTEL_TRACES_EXPORTER": "console",
                                        "OTEL_SERVICE_NAME": "gw-eu"}, set_global=False)  # fmt: skip
    assert provider is not None and provider.resource.attributes["service.name"] == "gw-eu"
    provider.shutdown()


def test_traceparent_is_parsed_and_written_as_the_sdks_w3c_propagator_does() -> None:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from common.tracing import extract, inject

    w3c = TraceContextTextMapPropagator()
    cases = [
        {"traceparent": TRACEPARENT},
        {"traceparent": TRACEPARENT, "tracestate": "vendor=1,other=two"},
        {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"},  # not sampled
        {"traceparent": f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-future"},  # a later version
        {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra"},  # 00 has no extras
        {"traceparent": f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        {"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN}-01"},
        {"traceparent": f"00-{CLIENT_TRACE}-{'0' * 16}-01"},
        {"traceparent": f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01"},
        {"traceparent": "garbage"},
        {},
    ]
    for headers in cases:
        ours = trace.get_current_span(extract(headers)).get_span_context()
        sdk = trace.get_current_span(w3c.extract(headers)).get_span_context()
        assert ours.is_valid == sdk.is_valid, headers
        if sdk.is_valid:
            assert (ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote) == (
                sdk.trace_id, sdk.span_id, sdk.trace_flags, sdk.is_remote,
            ), headers  # fmt: skip
            assert ours.trace_state == sdk.trace_state, headers
            written: dict[str, str] = {}
            inject(written, trace.NonRecordingSpan(ours))
            expected: dict[str, str] = {}
            w3c.inject(expected, context=trace.set_span_in_context(trace.NonRecordingSpan(sdk)))
            assert written == expected, headers


def test_a_recorded_span_writes_its_own_traceparent_and_exports_as_a_readable_span(
    traced: Traced,
) -> None:
    from common.tracing import extract, inject

    tracer = tracer_for(traced.provider, "test")
    assert tracer is not None
    root = tracer.start_span("root", context=extract({"traceparent": TRACEPARENT}))
    child = tracer.start_span("child", context=trace.set_span_in_context(root), start_time=5)
    headers: dict[str, str] = {}
    inject(headers, child)
    ctx = child.get_span_context()
    assert headers == {"traceparent": f"00-{CLIENT_TRACE}-{ctx.span_id:016x}-01"}
    child.set_attributes({"a": 1, "dropped": None})
    child.end(end_time=7)
    root.end()
    (exported_child, exported_root) = traced.spans()
    assert exported_child.attributes == {"a": 1}
    assert (exported_child.start_time, exported_child.end_time) == (5, 7)
    assert parent_id(exported_child) == exported_root.context.span_id
    assert format(parent_id(exported_root) or 0, "016x") == CLIENT_SPAN
    assert exported_root.parent is not None and exported_root.parent.is_remote


async def test_a_path_no_route_takes_is_a_span_named_by_its_method_alone(
    config: Config, traced: Traced
) -> None:
    """Named by its raw path, each probed /v1/<random> was an operation of its own in the
    tracing backend's index; HTTP semantic conventions name it by the method."""
    async with (
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        for probe in ("/v1/aaa-1", "/v1/bbb-2"):
            assert (await http.get(probe)).status_code == 404
    spans = await traced.wait_for(lambda s: len(by_kind(s, SpanKind.SERVER)) >= 2)
    assert {s.name for s in by_kind(spans, SpanKind.SERVER)} == {"GET"}


def test_the_resource_keeps_the_operators_service_name_and_names_the_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_RESOURCE_ATTRIBUTES' service.name was overridden by the code's default, and
    replicas had no service.instance.id to tell them apart."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=billing-llm,team=ml")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    provider = init_tracing("qosserve-worker", instance_id="w-7", exporter=InMemorySpanExporter(),
                            batch=False, set_global=False)  # fmt: skip
    assert provider is not None
    attributes = provider.resource.attributes
    assert attributes["service.name"] == "billing-llm" and attributes["team"] == "ml"
    assert attributes["service.instance.id"] == "w-7"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "named")
    assert resource_attributes("qosserve-gateway", None, os.environ)["service.name"] == "named"
    plain = resource_attributes("qosserve-gateway", None, {})
    assert plain["service.name"] == "qosserve-gateway" and len(plain["service.instance.id"]) == 32


def test_tracestate_is_forwarded_as_whole_well_formed_members_within_the_limits() -> None:
    """It was cut at 512 characters mid-member (a collector then drops every vendor's entry)
    or, on the sampled-out path, forwarded as the client sent it, of any size; and a
    traceparent of version ff or all-zero ids was forwarded with tracing off."""
    from common.trace_context import clean_tracestate
    from gateway.tracing import forward_traceparent

    members = [f"v{i:02d}=" + "x" * 24 for i in range(20)]  # 28 chars each: 20 > 512 in all
    cleaned = clean_tracestate(",".join(members))
    assert cleaned is not None and len(cleaned) <= 512
    assert cleaned.split(",") == members[: len(cleaned.split(","))]  # whole members, in order
    assert clean_tracestate(",".join(f"k{i}=v" for i in range(40))).count(",") == 31
    assert clean_tracestate("good=1, BAD KEY=2,also=fine ,=x,k=") == "good=1,also=fine"
    assert clean_tracestate("nothing valid here") is None

    for bad in (f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01", f"00-{'0' * 32}-{CLIENT_SPAN}-01"):
        out: dict[str, str] = {}
        forward_traceparent({"traceparent": bad, "tracestate": "a=1"}, out)
        assert out == {}
    out = {}
    forward_traceparent({"traceparent": TRACEPARENT, "tracestate": ",".join(members)}, out)
    assert out["traceparent"] == TRACEPARENT and out["tracestate"] == cleaned
    # A proxy's tracestate header next to the client's: one list, as the traced path reads
    # it (the first header alone was forwarded).
    from starlette.datastructures import Headers

    two = Headers(raw=[(b"traceparent", TRACEPARENT.encode()), (b"tracestate", b"client=1"),
                       (b"tracestate", b"proxy=2")])  # fmt: skip
    out = {}
    forward_traceparent(two, out)
    assert out == {"traceparent": TRACEPARENT, "tracestate": "client=1,proxy=2"}


async def test_an_attempt_stopped_while_it_was_admitted_still_ends_its_span(
    config: Config, start_worker: StartWorker, traced: Traced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery cancelled (or failing) before it was in flight here (waiting on its
    resume answer, its prompt being tokenized) never ended its span: a trace of a request
    handed back then showed only the next worker's attempt."""
    import threading

    import common.nats as qnats
    from common.protocol import GenerateRequest, RequestParams
    from workers import service as worker_service

    gate, tokenizing = threading.Event(), threading.Event()

    def slow_encode(engine: object, prompt: str) -> list[int]:
        tokenizing.set()
        gate.wait(5)  # a long prompt being tokenized when the stop comes
        return [1, 2]

    monkeypatch.setattr(worker_service, "encode_prompt", slow_encode)
    worker = await start_worker("w-stopped", tracer_provider=traced.provider)
    subjects = Subjects(config.nats.subject_prefix)
    nc = await qnats.connect(config.nats, "admission-cancelled")
    try:
        text = "x" * (worker_service.OFFLOAD_TOKENIZE_CHARS + 1)
        request = GenerateRequest(id="adm-1", group="short", reply=subjects.out("adm-1"),
                                  prompt=text, params=RequestParams(max_tokens=2))  # fmt: skip
        await nc.jetstream().publish(subjects.request("short"), request.to_bytes())
        # In the tokenizer, so its span started (a fixed wait could stop it before then:
        # no span at all, and the test waited for one in vain).
        assert await asyncio.to_thread(tokenizing.wait, 5)
        assert worker._starting  # fetched, not in flight yet
        await worker.stop(grace_s=0)
    finally:
        gate.set()
        await nc.close()
    spans = await traced.wait_for(lambda s: bool(by_kind(s, SpanKind.CONSUMER)))
    (attempt,) = by_kind(spans, SpanKind.CONSUMER)
    assert attempt.attributes["qos.outcome"] == "handed_back"


async def test_a_refused_request_s_server_span_says_what_it_asked_for_and_why_it_failed(
    config: Config, traced: Traced
) -> None:
    """Refused at admission (no worker: 503) or validation (400), a request's server span
    had only its HTTP fields: no operation, model, group or error.type, on exactly the
    requests a QoS trace is looked at for."""
    async with (
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=20) as http,
    ):
        unserved = await http.post("/v1/long/completions",
                                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})  # fmt: skip
        invalid = await http.post("/v1/long/completions", json={"model": MODEL, "top_p": 7})
    assert (unserved.status_code, invalid.status_code) == (503, 400)
    spans = await traced.wait_for(lambda s: len(by_kind(s, SpanKind.SERVER)) == 2)
    refused, bad = sorted(by_kind(spans, SpanKind.SERVER), key=lambda s: s.start_time or 0)
    for span, error in ((refused, "service_unavailable"), (bad, "invalid_value")):
        assert span.attributes["gen_ai.operation.name"] == "text_completion"
        assert span.attributes["gen_ai.request.model"] == MODEL
        assert span.attributes["error.type"] == error
    assert refused.attributes["qos.group"] == "long" and "qos.group" not in bad.attributes


async def test_a_request_that_came_without_a_trace_keeps_one_trace_across_its_deliveries(
    config: Config, start_worker: StartWorker, traced: Traced
) -> None:
    """A NATS caller without traceparent (or a gateway with tracing off): each delivery
    started a random trace, so a redelivered request's attempts were two traces, sampled
    apart. Its trace now comes from its id."""
    import common.nats as qnats
    from common.protocol import GenerateRequest, RequestParams

    first = await start_worker("w-one", cost=SLOW, tracer_provider=traced.provider)
    subjects = Subjects(config.nats.subject_prefix)
    nc = await qnats.connect(config.nats, "no-trace")
    try:
        request = GenerateRequest(id="untraced-1", group="short", reply=subjects.out("untraced-1"),
                                  prompt_token_ids=[1, 2], params=RequestParams(max_tokens=40))  # fmt: skip
        await nc.jetstream().publish(subjects.request("short"), request.to_bytes())
        while not first.inflight_ids:
            await asyncio.sleep(0.01)
        await first.stop(grace_s=0)  # handed back: the next delivery goes to the second
        await start_worker("w-two", tracer_provider=traced.provider)
        spans = await traced.wait_for(lambda s: len(by_kind(s, SpanKind.CONSUMER)) == 2, 15)
    finally:
        await nc.close()
    attempts = by_kind(spans, SpanKind.CONSUMER)
    # The second replica's attempt is 2, or 3 when the stopping one's last pull took the
    # handed-back delivery and dropped it unserved (no span: it never started there).
    first_try, served = sorted(s.attributes["qos.attempt"] for s in attempts)
    assert first_try == 1 and served in (2, 3)
    assert len({s.context.trace_id for s in attempts}) == 1


async def test_a_stream_that_fails_after_its_first_token_is_an_error_span(
    config: Config, traced: Traced
) -> None:
    """A worker error mid-stream goes out as an error event after the 200: the metric
    counted the 503, but the server span kept status UNSET and no error.type, so a search
    for failed traces missed every streamed request that failed."""
    import functools

    from opentelemetry.trace import StatusCode

    from tests.gateway.fake_worker import fail_with, running_worker

    failing = functools.partial(fail_with, code="service_unavailable", after_tokens=2)
    async with (
        running_worker(config.nats, "short", behaviour=failing),
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=20) as http,
    ):
        await wait_live(http, "short")
        events = await stream_completion(http, "/v1/short/completions", prompt="hi", max_tokens=8)
    assert any('"error"' in e for e in events)  # the failure came inside the 200 stream
    spans = await traced.wait_for(lambda s: len(by_kind(s, SpanKind.SERVER)) == 1)
    (server,) = by_kind(spans, SpanKind.SERVER)
    assert server.attributes["http.response.status_code"] == 200
    assert server.status.status_code == StatusCode.ERROR
    assert server.attributes["error.type"] == "503"


async def test_n_choices_are_one_trace_with_a_publish_and_a_worker_span_each(
    config: Config, start_worker: StartWorker, traced: Traced
) -> None:
    await start_worker("w-trace", tracer_provider=traced.provider)
    async with (
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await wait_live(http, "short")
        events = await stream_completion(
            http, "/v1/short/completions", prompt="hello", max_tokens=4, n=3
        )
    assert events[-1] == "[DONE]"
    spans = await traced.wait_for(lambda s: len(by_kind(s, SpanKind.CONSUMER)) == 3)
    assert {s.context.trace_id for s in spans} == {spans[0].context.trace_id}
    (server,) = by_kind(spans, SpanKind.SERVER)
    publishes = by_kind(spans, SpanKind.PRODUCER)
    workers = by_kind(spans, SpanKind.CONSUMER)
    assert len(publishes) == 3 and all(parent_id(p) == server.context.span_id for p in publishes)
    assert {parent_id(w) for w in workers} == {p.context.span_id for p in publishes}
    assert server.attributes["gen_ai.usage.output_tokens"] == 12  # every choice's
    assert server.attributes["http.response.status_code"] == 200
