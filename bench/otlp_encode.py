"""µs per request to encode its spans as OTLP protobuf: the SDK's ``encode_spans`` versus
:class:`common.otlp_encode.SpanEncoder`.

A request's seven spans (gateway server + publish, worker consumer + queue / prefill /
decode / stream) with the attributes the services set (~35), recorded by this project's
tracer. Each timed batch holds requests not seen before (their ids and response ids are
new), the encoder warmed by an earlier batch, as at a service's steady state.

    python -m bench.otlp_encode --out bench/results/cpu/otlp_encode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from common.otlp_encode import SpanEncoder
from common.tracing import extract, init_tracing, inject, tracer_for

SPANS_PER_REQUEST = 7


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def request_spans(n: int, first: int = 0) -> list[ReadableSpan]:
    """The spans of ``n`` requests as the gateway and a worker record them."""
    keep = _Keep()
    gateway = tracer_for(init_tracing("gateway", exporter=keep, batch=False, set_global=False), "g")
    worker = tracer_for(init_tracing("worker", exporter=keep, batch=False, set_global=False), "w")
    assert gateway is not None and worker is not None
    subject, model = "qos.req.short", "dummy:tiny"
    for i in range(first, first + n):
        rid = f"cmpl-{i:024x}"
        server = gateway.start_span(
            "POST /v1/short/completions",
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": "/v1/short/completions"},
        )
        request: dict[str, Any] = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": model,
                   "gen_ai.request.max_tokens": 16, "gen_ai.request.temperature": 0.7,
                   "gen_ai.request.top_p": 0.9, "gen_ai.response.id": rid, "qos.group": "short"}  # fmt: skip
        server.set_attributes({**request, "gen_ai.usage.input_tokens": 32})
        messaging: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.destination.name": subject,
        }
        publish = gateway.start_span(
            f"publish {subject}",
            context=trace.set_span_in_context(server),
            kind=SpanKind.PRODUCER,
            attributes={
                **messaging,
                "messaging.operation.type": "send",
                "messaging.message.id": rid,
            },
        )
        headers: dict[str, str] = {}
        inject(headers, publish)
        publish.end()
        consumer = worker.start_span(
            f"text_completion {model}",
            context=extract(headers),
            kind=SpanKind.CONSUMER,
            attributes={
                **request,
                **messaging,
                "messaging.operation.type": "process",
                "qos.worker": "w-7f3a",
                "qos.attempt": 1,
                "qos.jetstream_wait_s": 0.0012 + i * 1e-7,
            },
        )
        usage: dict[str, Any] = {"gen_ai.response.finish_reasons": ("length",), "gen_ai.usage.input_tokens": 32,
                 "gen_ai.usage.output_tokens": 16}  # fmt: skip
        consumer.set_attributes({**usage, "qos.cached_tokens": 0})
        for phase in ("queue", "prefill", "decode", "stream"):
            worker.start_span(phase, context=trace.set_span_in_context(consumer)).end()
        consumer.end()
        server.set_attributes({**usage, "http.route": "/v1/{group}/completions",
                               "http.response.status_code": 200})  # fmt: skip
        server.end()
    return keep.spans


def us_per_request(encode: Callable[[list[ReadableSpan]], Any], batches: list[list[Any]]) -> float:
    """Median over ``batches`` (each encoded once) of µs per request."""
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        encode(batch)
        times.append((time.perf_counter() - t0) * 1e6 * SPANS_PER_REQUEST / len(batch))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.otlp_encode", description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=30, help="timed batches per encoder")
    p.add_argument("--requests", type=int, default=73, help="requests a batch (512 spans)")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    batches = [request_spans(args.requests, b * args.requests) for b in range(args.batches + 1)]
    encoder = SpanEncoder()
    encoder.encode(batches[0])  # warm: keys, resources, scopes, repeating values
    sdk = us_per_request(lambda b: encode_spans(b).SerializeToString(), batches[1:])
    ours = us_per_request(encoder.encode, batches[1:])
    attributes = sum(len(s.attributes or {}) for s in batches[1]) / args.requests
    report = {
        "benchmark": "otlp_encode",
        "spans_per_request": SPANS_PER_REQUEST,
        "attributes_per_request": round(attributes, 1),
        "sdk_encode_spans_us_per_request": round(sdk, 1),
        "span_encoder_us_per_request": round(ours, 1),
        "speedup": round(sdk / ours, 1),
        "command": " ".join(["python -m bench.otlp_encode", *sys.argv[1:]]),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
