"""Sampling is decided once, at the gateway; the flag rides in ``traceparent`` to the worker.

A request sampled out records nothing anywhere yet still tells the worker so (flag 00); a
client's sampled parent is honoured whatever the ratio; the fast decision equals the SDK
samplers' own; spans leave through the batch queue in full batches.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx
import pytest
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanKind

from common.config import Config
from common.span_batch import SpanBatch
from common.span_recorder import RecordedSpan, Tracer, decision_of
from common.subjects import Subjects
from common.trace_context import RemoteParent, Unsampled, parse
from common.tracing import tracer_for
from tests.gateway.conftest import serve
from tests.observability.conftest import MODEL, StartWorker, wait_live
from workers.service import WorkerService

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
UNSAMPLED_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-00")


@dataclass
class Kept:
    """A provider with ``sampler`` whose finished spans stay in memory."""

    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def providers() -> Iterator[dict[str, Kept]]:
    """``gateway`` samples no root request (ratio 0, parent-based); ``worker`` would sample
    every request it is left to decide on (the SDK's default, parent-based always-on)."""
    made = {}
    for name, sampler in (
        ("gateway", ParentBased(TraceIdRatioBased(0.0))),
        ("worker", ParentBased(ALWAYS_ON)),
    ):
        exporter = InMemorySpanExporter()
        provider = TracerProvider(sampler=sampler)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        made[name] = Kept(provider, exporter)
    yield made
    for kept in made.values():
        kept.provider.shutdown()


@pytest.fixture
def span_objects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the span objects built from here on, sampled or not (a spy: each is
    still built as it would be)."""
    built: list[str] = []
    build = RecordedSpan.__init__

    def spy(self: RecordedSpan, tracer: Tracer, name: str, *args: object) -> None:
        built.append(name)
        build(self, tracer, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RecordedSpan, "__init__", spy)
    return built


async def request_headers(
    config: Config,
    worker: WorkerService,
    gateway: TracerProvider,
    nc: Client,
    client_headers: dict[str, str],
) -> dict[str, str]:
    """One completion through the gateway; the NATS headers the worker got with it, once
    the worker is done with it."""
    seen: list[dict[str, str]] = []

    async def on_request(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(dict(msg.headers or {}))

    await nc.subscribe(Subjects(config.nats.subject_prefix).request("short"), cb=on_request)
    async with (
        serve(config, tracer_provider=gateway) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await wait_live(http, "short")
        response = await http.post(
            "/v1/short/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
            headers=client_headers,
        )
        assert response.status_code == 200, response.text
    # The worker counts the request's outcome and ends its span in one step, after its ack
    # (a fixed wait guessed how long that took): once counted, it is done with it.
    deadline = time.monotonic() + 5
    while not (seen and answered(worker) == 1):
        assert time.monotonic() < deadline, (seen, answered(worker))
        await asyncio.sleep(0.02)
    assert len(seen) == 1
    return seen[0]


def answered(worker: WorkerService) -> float:
    """The requests ``worker`` has answered (its outcome counters, every reason)."""
    return sum(
        sample.value
        for family in worker.observer.registry.collect()
        for sample in family.samples
        if sample.name in ("qos_request_success_total", "qos_request_errors_total")
    )


async def test_a_request_sampled_out_builds_no_span_and_the_worker_follows_its_flag(
    config: Config,
    start_worker: StartWorker,
    providers: dict[str, Kept],
    nc: Client,
    span_objects: list[str],
) -> None:
    worker = await start_worker("w-unsampled", tracer_provider=providers["worker"].provider)
    headers = await request_headers(config, worker, providers["gateway"].provider, nc, {})

    # The gateway started the trace and sampled it out: it says so to the worker ...
    match = UNSAMPLED_TRACEPARENT.fullmatch(headers["traceparent"])
    assert match is not None, headers
    assert int(match[1], 16) and int(match[2], 16)
    # ... which, though it would sample a request it decided on, builds nothing either.
    assert span_objects == []
    assert providers["gateway"].spans() == []
    assert providers["worker"].spans() == []


async def test_a_clients_unsampled_parent_is_passed_on_unsampled(
    config: Config,
    start_worker: StartWorker,
    providers: dict[str, Kept],
    nc: Client,
    span_objects: list[str],
) -> None:
    gateway = providers["worker"]  # always on for a root: only the client's flag says no
    worker = await start_worker("w-client-off", tracer_provider=providers["worker"].provider)
    client = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", "tracestate": "vendor=1"}
    headers = await request_headers(config, worker, gateway.provider, nc, client)
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    assert headers["tracestate"] == "vendor=1"
    assert span_objects == [] and gateway.spans() == []


async def test_a_clients_sampled_parent_is_honoured_at_a_zero_ratio(
    config: Config,
    start_worker: StartWorker,
    providers: dict[str, Kept],
    nc: Client,
    span_objects: list[str],
) -> None:
    worker = await start_worker("w-client-on", tracer_provider=providers["worker"].provider)
    client = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=1"}
    headers = await request_headers(config, worker, providers["gateway"].provider, nc, client)

    (server,) = [s for s in providers["gateway"].spans() if s.kind == SpanKind.SERVER]
    (publish,) = [s for s in providers["gateway"].spans() if s.kind == SpanKind.PRODUCER]
    assert server.parent is not None and server.parent.is_remote
    assert format(server.parent.span_id, "016x") == CLIENT_SPAN
    assert server.attributes is not None and server.attributes["gen_ai.request.max_tokens"] == 3
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{publish.context.span_id:016x}-01"
    assert headers["tracestate"] == "vendor=1"
    consumer = [s for s in providers["worker"].spans() if s.kind == SpanKind.CONSUMER]
    assert len(consumer) == 1 and consumer[0].parent is not None
    assert consumer[0].parent.span_id == publish.context.span_id
    assert {format(s.context.trace_id, "032x") for s in providers["worker"].spans()} == {
        CLIENT_TRACE
    }
    exported = providers["gateway"].spans() + providers["worker"].spans()
    assert len(span_objects) == len(exported) == 7  # the spy sees every span built


class NameSampler(Sampler):
    """Not one of the SDK's: samples spans whose name says ``chat`` (asked every time)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,  # type: ignore[no-untyped-def]
                      links=None, trace_state=None):  # fmt: skip
        return (ALWAYS_ON if "chat" in name else ALWAYS_OFF).should_sample(
            parent_context, trace_id, name, kind, attributes, links
        )

    def get_description(self) -> str:
        return "NameSampler"


def test_the_fast_decision_is_the_sdk_samplers_own() -> None:
    from opentelemetry.sdk.trace.sampling import Decision

    samplers = [
        ALWAYS_ON,
        ALWAYS_OFF,
        TraceIdRatioBased(0.3),
        ParentBased(ALWAYS_ON),
        ParentBased(TraceIdRatioBased(0.01)),
        ParentBased(
            ALWAYS_OFF,
            remote_parent_sampled=TraceIdRatioBased(0.5),
            remote_parent_not_sampled=ALWAYS_ON,
        ),
    ]
    trace_ids = [
        1,
        2**63,
        2**64 - 1,
        2**100,
        2**128 - 1,
        *(i * 0x9E3779B97F4A7C15 for i in range(1, 400)),
    ]
    for sampler in samplers:
        decide = decision_of(sampler)
        assert decide is not None, sampler
        for flag in (None, True, False):
            for trace_id in trace_ids:
                trace_id %= 2**128
                parent = (
                    None if flag is None else RemoteParent(trace_id, 7, flag).context()
                )  # fmt: skip
                sdk = sampler.should_sample(parent, trace_id, "x").decision
                expected = sdk is Decision.RECORD_AND_SAMPLE
                assert decide(trace_id, flag) == expected, (sampler, flag, trace_id)
    assert decision_of(NameSampler()) is None
    assert decision_of(ParentBased(NameSampler())) is None


def test_a_sampler_of_another_kind_is_asked_and_its_choice_kept() -> None:
    provider = TracerProvider(sampler=ParentBased(NameSampler()))
    tracer = tracer_for(provider, "t")
    assert isinstance(tracer, Tracer) and tracer.decide is None
    chat = tracer.start_remote("chat m", None, SpanKind.CONSUMER)
    assert isinstance(chat, RecordedSpan) and chat.recording
    other = tracer.start_remote("text_completion m", None, SpanKind.CONSUMER)
    assert isinstance(other, Unsampled)
    # A sampled remote parent is honoured; a sampled-out one is passed on as it came.
    parent = parse(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "k=v")
    child = tracer.start_remote("text_completion m", parent, SpanKind.SERVER)
    assert isinstance(child, RecordedSpan) and child.trace_state.to_header() == "k=v"
    assert format(child.trace_id, "032x") == CLIENT_TRACE
    dropped = tracer.start_remote(
        "chat m", parse(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"), SpanKind.SERVER
    )
    assert dropped == Unsampled(int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16))
    provider.shutdown()


class Batches(SpanExporter):
    """Keeps the size of every batch it is handed."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.exported = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sizes.append(len(spans))
        self.exported.set()
        return SpanExportResult.SUCCESS


def test_spans_leave_in_full_batches_at_once_and_the_rest_at_a_flush() -> None:
    exporter = Batches()
    env = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "3",
           "OTEL_BSP_MAX_QUEUE_SIZE": "5"}  # fmt: skip
    batch = SpanBatch(exporter, env)
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(batch)
    tracer = tracer_for(provider, "t")
    assert isinstance(tracer, Tracer) and tracer.on_end == batch.add  # straight onto the queue
    for i in range(3):
        tracer.start_span(f"s{i}").end()
    assert exporter.exported.wait(5)  # a full batch goes without waiting for the delay
    assert exporter.sizes == [3]
    for i in range(7):  # the exporter thread may or may not take some before the queue fills
        tracer.start_span(f"t{i}").end()
    batch.force_flush()
    assert sum(exporter.sizes) + batch.dropped == 10
    assert all(size <= 3 for size in exporter.sizes)
    assert batch.dropped <= 2  # the queue holds 5: at most 7 - 5 could not be queued
    provider.shutdown()
