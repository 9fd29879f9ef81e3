"""CPU per request that tracing at ratio 1 adds inside the services, measured in-process.

``bench.tracing_overhead`` measures the whole stack (req/s, latency) and is at the mercy
of a shared machine; this measures the two parts of the cost one by one, with nothing
else in the loop: the hooks the request path runs (the gateway's middleware and
generator hooks, a worker's observer from fetch to answer: tracing on minus off, the
same calls otherwise) and the export thread's share of what they queued: building a
gateway's requests and a worker's deliveries into spans (``gateway.tracing.ServerCall``,
``workers.tracing.DeferredSpan``) and encoding (µs per
request: 2 gateway spans, 5 worker spans). Spans are queued, never sent (the send is
~0.4 µs a span of process CPU, measured apart).

    python -m bench.tracing_hooks            # ~20 s
    PYTHONPATH=<other tree> python -m bench.tracing_hooks   # the same, another tree's code
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import inspect
import json
import statistics
import sys
import time
import types
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

from common.otlp_encode import SpanEncoder
from common.protocol import Chunk, GenerateRequest, RequestParams, Usage
from common.span_batch import Deferred
from common.tracing import init_tracing, tracer_for
from gateway import tracing as traced
from gateway.observe import ObserveMiddleware
from workers.engine.outputs import RequestMetrics
from workers.observe import WorkerObserver
from workers.outbox import Flight

# Nothing leaves the queue while timing: no export thread competes for the GIL.
QUEUE_ONLY = {"OTEL_BSP_SCHEDULE_DELAY": "100000000", "OTEL_BSP_MAX_QUEUE_SIZE": "100000000",
              "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "100000000"}  # fmt: skip
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Never(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def worker_us(tracer: Any, n: int) -> float:
    """µs per request of a worker's observer hooks: fetched, 3 outputs and chunks, answered."""
    observer = WorkerObserver(worker_id="w0", model="dummy:tiny", view=lambda: None,
                              tracer=tracer, registry=CollectorRegistry(), gpus=False)  # fmt: skip
    msg = types.SimpleNamespace(subject="qos.req.short", headers={"traceparent": TRACEPARENT})
    now = time.time()
    output = types.SimpleNamespace(metrics=RequestMetrics(now, now + 1e-3, now + 2e-3,
                                                          now + 3e-3, 0, 0))  # fmt: skip
    first = types.SimpleNamespace(token_ids=[1, 2, 3, 4], output=None,
                                  first_token_metrics=output.metrics, at=0.0)  # fmt: skip
    step = types.SimpleNamespace(token_ids=[1, 2, 3, 4], output=None, first_token_metrics=None,
                                 at=0.0)  # fmt: skip
    last = types.SimpleNamespace(token_ids=[1, 2, 3, 4], output=output, first_token_metrics=None,
                                 at=0.0)  # fmt: skip
    tokens = Chunk(id="x", token_ids=[1, 2, 3, 4])
    final = Chunk(id="x", token_ids=[5], finish_reason="length", usage=Usage(32, 16, 0))
    params = RequestParams(max_tokens=16, temperature=0.7, top_p=0.9)
    requests = [GenerateRequest(id=f"cmpl-{i:024x}", group="short", reply="r", model="dummy:tiny",
                                prompt_token_ids=[1] * 32, params=params,
                                created_ms=int(now * 1000)) for i in range(n)]  # fmt: skip
    started = time.perf_counter()
    for req in requests:
        st = Flight(req, msg, 1, now)
        observer.fetched(st, msg, "short")
        for delta in (first, step, step):
            observer.output(st, delta)
            observer.chunk(st, tokens)
        observer.output(st, last)
        observer.answered(st, final, error=False)
    return (time.perf_counter() - started) / n * 1e6


async def gateway_us(tracer: Any, n: int) -> float:
    """µs per request of the gateway's middleware and generator hooks around a stub app."""
    body = types.SimpleNamespace(temperature=0.7, top_p=0.9)
    # The tracer became admitted()'s first argument with the shared attributes.
    takes_tracer = "tracer" in inspect.signature(traced.admitted).parameters

    async def app(scope: Any, receive: Any, send: Any) -> None:
        decided = None
        if tracer is not None:
            decided = traced.admitted(
                *((tracer,) if takes_tracer else ()), scope, kind="completion",
                model="dummy:tiny", group="short", request_id="cmpl-abc", body=body,
                max_tokens=16, prompt_tokens=32,
            )  # fmt: skip
            with traced.publishing(tracer, decided, "qos.req.short", "cmpl-abc", {}, {}):
                pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"data", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        if decided is not None:
            traced.landed(decided, status=200, prompt_tokens=32, completion_tokens=16,
                          finish_reason="length")  # fmt: skip

    middleware = ObserveMiddleware(app, tracer=tracer, access_log=False)

    async def receive() -> Any:
        return {}

    async def send(message: Any) -> None:
        pass

    scopes = [{"type": "http", "path": "/v1/short/completions", "method": "POST",
               "headers": [(b"content-type", b"application/json")]} for _ in range(n)]  # fmt: skip
    started = time.perf_counter()
    for scope in scopes:
        await middleware(scope, receive, send)
    return (time.perf_counter() - started) / n * 1e6


def encode_us(tracer: Any, requests: int, batch: int = 100) -> tuple[float, float, float]:
    """(µs per request to build, µs per request to encode, spans per request) for what
    ``tracer``'s queue holds: building is the export thread's share of a span recorded as
    plain values (:class:`common.span_batch.Deferred`: a gateway request, a worker's delivery)."""
    queue = tracer.processor._span_processors[0]._queue
    queued = list(queue)
    queue.clear()
    gc.disable()  # as the hooks are timed: thousands of spans built in one go, not a batch
    started = time.perf_counter()
    items = [s.build() if isinstance(s, Deferred) else s for s in queued]
    build = (time.perf_counter() - started) * 1e6 / requests
    gc.enable()
    spans = sum(1 + len(getattr(s, "_phases", None) or ()) for s in items)
    batch = max(1, min(batch, len(items) // 5))  # a warm-up batch and a few timed ones
    batches = [items[i : i + batch] for i in range(0, len(items), batch)][:40]
    encoder = SpanEncoder()
    encoder.encode(batches[0])  # warm: keys, names, resources, shared attributes
    times = []
    for b in batches[1:]:
        started = time.perf_counter()
        encoder.encode(b)
        times.append((time.perf_counter() - started) / len(b))
    per_item = spans / len(items)
    encode = statistics.median(times) * 1e6 * len(items) / requests
    return build, encode, per_item * len(items) / requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.tracing_hooks", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="requests per timed run")
    p.add_argument("--repeats", type=int, default=7, help="runs each, on and off alternating")
    args = p.parse_args(argv)
    gateway = tracer_for(init_tracing("gateway", exporter=_Never(), env=QUEUE_ONLY,
                                      set_global=False), "g")  # fmt: skip
    worker = tracer_for(init_tracing("worker", exporter=_Never(), env=QUEUE_ONLY,
                                     set_global=False), "w")  # fmt: skip
    runs: dict[str, list[float]] = {"gateway off": [], "gateway on": [], "worker off": [],
                                    "worker on": []}  # fmt: skip
    gc.disable()  # a collection landing in one run and not the other is noise, not cost
    for _ in range(args.repeats):
        runs["gateway off"].append(asyncio.run(gateway_us(None, args.requests)))
        runs["gateway on"].append(asyncio.run(gateway_us(gateway, args.requests)))
        # In a context of its own, as each request's task has in a worker: what the hooks
        # attach (log fields, the current span) must not outlive the run in this thread.
        for name, tracer in (("worker off", None), ("worker on", worker)):
            runs[name].append(contextvars.copy_context().run(worker_us, tracer, args.requests))
    gc.enable()
    med = {k: statistics.median(v) for k, v in runs.items()}
    total = args.requests * args.repeats
    report: dict[str, Any] = {"benchmark": "tracing_hooks", "config": vars(args)}
    for side, tracer in (("gateway", gateway), ("worker", worker)):
        build, encode, spans = encode_us(tracer, total)
        report[side] = {
            # The hooks with tracing off: metrics (and log fields) alone, what every request pays.
            "hooks_off_us_per_request": round(med[f"{side} off"], 2),
            "hooks_us_per_request": round(med[f"{side} on"] - med[f"{side} off"], 2),
            "hooks_us_per_request_min": round(min(runs[f"{side} on"]) - min(runs[f"{side} off"]), 2),
            "build_us_per_request": round(build, 2),
            "encode_us_per_request": round(encode, 2),
            "spans_per_request": round(spans, 2),
        }  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
