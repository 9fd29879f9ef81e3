"""OpenTelemetry tracing: set-up from the ``OTEL_*`` variables, W3C propagation over NATS.

One trace per request (DESIGN §7)::

    POST /v1/chat/completions            gateway, SERVER (parent: the client's traceparent)
    └── publish <prefix>.req.<group>     gateway, PRODUCER: traceparent/tracestate → NATS headers
        └── chat <model>                 worker, CONSUMER, one per delivery (qos.attempt)
            ├── queue                    fetched → first scheduled by the engine
            ├── kv load                  when the engine reports a KV-tier load time
            ├── prefill                  first scheduled → first token
            ├── decode                   first token → finished
            └── stream                   first chunk published → last chunk published

Tracing is off unless configured, and off costs nothing: services ask :func:`tracer_for`
once and get None without a real provider, so no span, attribute or header is built.

On, the request path is kept cheap (issue #7's target, < 3 % req/s at sampling ratio 1,
is not met yet: see the README's "Status"): sampling is decided once, where a request
enters the gateway (:meth:`common.span_recorder.Tracer.sampled_trace`; :func:`start_remote`
where spans are built at once), and the decision
rides in ``traceparent``'s sampled flag to the worker, which follows it (parent-based, the
default). A request sampled out builds nothing on either side: no span, attribute dict or
``Context``; only its ``traceparent`` (flag 00) is written on (:mod:`common.trace_context`).
A sampled one is recorded as plain values (:mod:`gateway.tracing`, :mod:`workers.tracing`)
and queued for a batch thread (:mod:`common.span_batch`) that builds the spans
(:mod:`common.span_recorder`), encodes them with :mod:`common.otlp_encode` (protobuf bytes
written directly, ~5x cheaper than the SDK's exporter) and sends them with
:mod:`common.otlp_export`.

Set-up (:func:`init_tracing`) reads the standard variables:

- ``OTEL_TRACES_EXPORTER``: ``otlp``, ``console`` or ``none`` (comma-separated for several).
  Unset means ``none`` here, unlike the SDK's default, so a service never tries to reach a
  collector nobody configured.
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or ``…_TRACES_PROTOCOL``): ``grpc`` (default) or
  ``http/protobuf``; ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``…_TRACES_ENDPOINT``), plus the
  ``OTEL_EXPORTER_OTLP_[TRACES_]*`` headers/timeout/compression/TLS variables, read as the
  SDK's exporters read them (:class:`common.otlp_export.OtlpSettings`).
  ``otlp_proto_grpc`` / ``otlp_proto_http`` (the SDK's names) select the SDK's exporters
  instead, to compare against.
- ``OTEL_SERVICE_NAME`` (default: the service's name), ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_TRACES_SAMPLER``/``…_ARG`` (default parent-based always-on), ``OTEL_SDK_DISABLED``.

The tracer provider is the one piece of global state tracing adds (STYLE §7); tests pass
a provider explicitly instead (``init_tracing(..., exporter=..., set_global=False)``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common.otlp_export import OtlpSettings, OtlpSpanExporter
from common.span_batch import SpanBatch
from common.span_process import ENV_SWITCH, ProcessSpanExporter
from common.span_recorder import Constants, RecordedSpan, Tracer
from common.trace_context import RemoteParent, Unsampled, from_headers

log = logging.getLogger(__name__)

# OpenTelemetry GenAI semantic conventions (gen_ai.*) and this project's own (qos.*).
OPERATION = "gen_ai.operation.name"
# Who serves the model (GenAI semconv, required): no well-known value fits a self-hosted
# server, so its own name, as the conventions allow.
PROVIDER = "gen_ai.provider.name"
PROVIDER_NAME = "qosserve"
REQUEST_MODEL = "gen_ai.request.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
RESPONSE_ID = "gen_ai.response.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
GROUP = "qos.group"
WORKER = "qos.worker"
ATTEMPT = "qos.attempt"

_TRUE = ("true", "1", "yes", "on")


def _exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",")]
    exporters: list[SpanExporter] = []
    for name in filter(None, names):
        if name == "none":
            continue
        if name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            exporters.append(_otlp_exporter(env))
        elif name in ("otlp_proto_grpc", "otlp_proto_http"):  # the SDK's own, by its names
            exporters.append(_sdk_otlp_exporter(env, name.removeprefix("otlp_proto_")))
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s: unknown exporter ignored", name)
    return exporters


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = env.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    ).strip()
    if protocol == "http":
        protocol = "http/protobuf"
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    # Read here in either case: a bad value is the service's clear error at start, where
    # the export process died of it and every span failed for the life of the service.
    settings = OtlpSettings.from_env(env, protocol)
    if env.get(ENV_SWITCH, "").strip().lower() in _TRUE:
        return ProcessSpanExporter(env, protocol)
    return OtlpSpanExporter(settings)


def _sdk_otlp_exporter(env: Mapping[str, str], protocol: str) -> SpanExporter:
    """The SDK's own exporters (``OTEL_TRACES_EXPORTER=otlp_proto_grpc``/``otlp_proto_http``):
    ~5x the encoding cost, kept to compare against and as a way out. They read all but the
    endpoint from ``os.environ``."""
    signal_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=signal_endpoint or base)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    # Per the spec, only the base endpoint gets the signal's path appended.
    endpoint = signal_endpoint or (base.rstrip("/") + "/v1/traces" if base else None)
    return HttpExporter(endpoint=endpoint)


def resource_attributes(
    service_name: str, instance_id: str | None, env: Mapping[str, str]
) -> dict[str, str]:
    """What the code adds to the resource the ``OTEL_*`` variables describe: a default
    ``service.name`` (``OTEL_SERVICE_NAME`` wins, and a ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` is kept, not overridden) and ``service.instance.id`` (the
    replica: a worker's id, else a fresh one), so replicas can be told apart."""
    named_in_env = any(
        part.split("=", 1)[0].strip() == SERVICE_NAME
        for part in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    )
    attributes = {"service.instance.id": instance_id or uuid.uuid4().hex}
    if env.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = env["OTEL_SERVICE_NAME"]
    elif not named_in_env:
        attributes[SERVICE_NAME] = service_name
    return attributes


def init_tracing(
    service_name: str,
    *,
    instance_id: str | None = None,
    exporter: SpanExporter | None = None,
    env: Mapping[str, str] | None = None,
    batch: bool = True,
    set_global: bool = True,
) -> TracerProvider | None:
    """The tracer provider the environment (or ``exporter``) asks for; None when tracing
    is off. ``set_global`` makes it the process's provider (services); tests keep it local.

    ``batch`` exports from a background thread (:class:`common.span_batch.SpanBatch`, for
    services); False exports as each span ends (SimpleSpanProcessor, for tests reading an
    in-memory exporter).
    """
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None
    exporters = [exporter] if exporter is not None else _exporters(env)
    if not exporters:
        return None
    resource = Resource.create(resource_attributes(service_name, instance_id, env))
    provider = TracerProvider(resource=resource)
    for exp in exporters:
        provider.add_span_processor(SpanBatch(exp, env) if batch else SimpleSpanProcessor(exp))
    if set_global:
        trace.set_tracer_provider(provider)
    log.info(
        "tracing on: %s exporting to %s",
        resource.attributes.get(SERVICE_NAME),
        ", ".join(type(e).__name__ for e in exporters),
    )
    return provider


def tracer_for(provider: trace.TracerProvider | None, name: str) -> trace.Tracer | None:
    """A tracer from ``provider`` (else the process's), or None while tracing is off.

    Decided once, at start-up: the request path then tests ``tracer is None`` and does
    nothing else, which is what keeps tracing free when it is off. An SDK provider gets
    this module's :class:`Tracer`; any other (an outside SDK) its own tracer.
    """
    provider = provider if provider is not None else trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    if isinstance(provider, TracerProvider):
        return Tracer(provider, name)
    return provider.get_tracer(name)


# --- the request path -----------------------------------------------------------------------


def start_remote(
    tracer: trace.Tracer,
    name: str,
    parent: RemoteParent | None,
    kind: SpanKind,
    start_time: int | None = None,
) -> Span | Unsampled:
    """The span of a request entering a service under ``parent`` if it is sampled, else
    what to tell the next hop (:class:`~common.trace_context.Unsampled`)."""
    if isinstance(tracer, Tracer):
        return tracer.start_remote(name, parent, kind, start_time)
    context = parent.context() if parent is not None else None  # another SDK's tracer
    span = tracer.start_span(name, context=context, kind=kind, start_time=start_time)
    if span.is_recording():
        return span
    ctx = span.get_span_context()
    state = ctx.trace_state.to_header() if ctx.trace_state else None
    return Unsampled(ctx.trace_id, ctx.span_id, state)


def start_child(
    tracer: trace.Tracer,
    parent: Span,
    name: str,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: dict[str, Any] | None = None,
    start_time: int | None = None,
) -> Span:
    """A child of ``parent`` (a span :func:`start_remote` gave)."""
    if isinstance(tracer, Tracer) and isinstance(parent, RecordedSpan):
        return tracer.start_child(parent, name, kind, attributes, start_time)
    context = trace.set_span_in_context(parent)
    return tracer.start_span(name, context, kind, attributes, start_time=start_time)


def constants(tracer: trace.Tracer, items: tuple[tuple[str, Any], ...]) -> Constants:
    """Attributes many spans share, as :class:`~common.span_recorder.Constants` (built
    once per distinct set by our tracer, each time by another)."""
    if isinstance(tracer, Tracer):
        return tracer.constants(items)
    return Constants(dict(items))


def set_constants(span: Span, constants: Constants) -> None:
    """Give ``span`` the shared attributes ``constants`` (by reference where it can)."""
    if isinstance(span, RecordedSpan):
        span.set_constants(constants)
    else:
        span.set_attributes(constants.items)


def add_phase(tracer: trace.Tracer, span: Span, name: str, start_s: float, end_s: float) -> None:
    """A finished INTERNAL child of ``span`` from ``start_s`` to ``end_s`` (``time.time()``
    seconds), with no attributes: a tuple kept on our span, a span of its own elsewhere."""
    if isinstance(span, RecordedSpan):
        span.add_phase(name, start_s, end_s)
    else:
        child = tracer.start_span(name, trace.set_span_in_context(span), start_time=ns(start_s))
        child.end(end_time=ns(end_s))


# --- W3C trace context -----------------------------------------------------------------------


def inject(headers: MutableMapping[str, str], span: Span) -> None:
    """Write ``span``'s W3C ``traceparent`` (and ``tracestate``) into ``headers``."""
    if isinstance(span, RecordedSpan):  # the request path: no SpanContext built
        headers["traceparent"] = span.traceparent()
        if span.trace_state:
            headers["tracestate"] = span.trace_state.to_header()
        return
    ctx = span.get_span_context()
    if ctx.is_valid:
        headers["traceparent"] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        if ctx.trace_state:
            headers["tracestate"] = ctx.trace_state.to_header()


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent carried by ``headers`` (W3C), or None when there is none or it is
    malformed (the span then starts a trace of its own)."""
    parent = from_headers(headers)
    return parent.context() if parent is not None else None


def ns(seconds: float) -> int:
    """``time.time()`` seconds → the nanoseconds spans take."""
    return int(seconds * 1e9)


def finish_reasons(reason: str | None) -> tuple[str, ...]:
    """``gen_ai.response.finish_reasons``: an array, one reason per choice."""
    return (reason,) if reason else ()


def set_error(span: Span, code: str, message: str) -> None:
    """Mark ``span`` failed with the error's code (``error.type``) and message."""
    span.set_attribute("error.type", code)
    span.set_status(Status(StatusCode.ERROR, message))


def describe(span: Span) -> dict[str, Any]:
    """The ids of ``span`` as log fields (``trace_id``, ``span_id``), empty when invalid."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}
