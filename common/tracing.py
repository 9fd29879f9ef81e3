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

On, the request path stays cheap (issue #7: < 3 % req/s at sampling ratio 1): :class:`Tracer`
records a span as plain data (ids, times, an attribute dict) that is its own
``ReadableSpan``, handed at its end to the provider's processors (batch export, or the
tests' in-memory exporter). The SDK's own spans cost ~3x as much on the event loop
(locks, bounded and cleaned attributes, ``on_start`` hooks). ``traceparent`` is written
and read directly (W3C trace context). What is left is mostly the OTLP exporter's
encoding, on its batch thread (~10 µs a span, ~2 µs an attribute).

Set-up (:func:`init_tracing`) reads the standard variables:

- ``OTEL_TRACES_EXPORTER``: ``otlp``, ``console`` or ``none`` (comma-separated for several).
  Unset means ``none`` here, unlike the SDK's default, so a service never tries to reach a
  collector nobody configured.
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or ``…_TRACES_PROTOCOL``): ``grpc`` (default) or
  ``http/protobuf``; ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``…_TRACES_ENDPOINT``), plus the
  exporters' own ``OTEL_EXPORTER_OTLP_*`` headers/timeout/TLS variables.
- ``OTEL_SERVICE_NAME`` (default: the service's name), ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_TRACES_SAMPLER``/``…_ARG`` (default parent-based always-on), ``OTEL_SDK_DISABLED``.

The tracer provider is the one piece of global state tracing adds (STYLE §7); tests pass
a provider explicitly instead (``init_tracing(..., exporter=..., set_global=False)``).
"""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.util._decorator import _agnosticcontextmanager

log = logging.getLogger(__name__)

# OpenTelemetry GenAI semantic conventions (gen_ai.*) and this project's own (qos.*).
OPERATION = "gen_ai.operation.name"
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
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s: unknown exporter ignored", name)
    return exporters


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = env.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    ).strip()
    signal_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=signal_endpoint or base)
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        # Per the spec, only the base endpoint gets the signal's path appended.
        endpoint = signal_endpoint or (base.rstrip("/") + "/v1/traces" if base else None)
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")


def init_tracing(
    service_name: str,
    *,
    exporter: SpanExporter | None = None,
    env: Mapping[str, str] | None = None,
    batch: bool = True,
    set_global: bool = True,
) -> TracerProvider | None:
    """The tracer provider the environment (or ``exporter``) asks for; None when tracing
    is off. ``set_global`` makes it the process's provider (services); tests keep it local.

    ``batch`` exports from a background thread (BatchSpanProcessor, for services); False
    exports as each span ends (SimpleSpanProcessor, for tests reading an in-memory exporter).
    """
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None
    exporters = [exporter] if exporter is not None else _exporters(env)
    if not exporters:
        return None
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    for exp in exporters:
        provider.add_span_processor(BatchSpanProcessor(exp) if batch else SimpleSpanProcessor(exp))
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


# --- W3C trace context -----------------------------------------------------------------------

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED, _NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
_EMPTY_STATE = TraceState()


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
    if not headers:
        return None
    traceparent = headers.get("traceparent")
    if not traceparent:
        return None
    match = _TRACEPARENT.fullmatch(traceparent.strip())
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):  # as the W3C propagator rules
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    state = headers.get("tracestate")
    parent = SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=TraceFlags(int(flags_hex, 16) & TraceFlags.SAMPLED),
        trace_state=TraceState.from_header([state]) if state else _EMPTY_STATE,
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


# --- spans -----------------------------------------------------------------------------------


_UNSET = Status(StatusCode.UNSET)


class _Resource(Resource):
    """A Resource that hashes once: the OTLP encoder hashes it for every span it exports
    (a JSON dump of the attributes each time, ~15 % of the encoding)."""

    _hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = super().__hash__()
        return self._hash


class RecordedSpan(Span, ReadableSpan):
    """A span as plain data, handed to the processors as it is when it ends (it is its own
    ``ReadableSpan``, as the SDK's span is, with no lock, copy or attribute cleaning).

    Not thread-safe, unlike the SDK's: a request's spans live on one event loop.
    """

    _attributes: dict[str, Any]

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        kind: SpanKind,
        trace_id: int,
        span_id: int,
        parent: SpanContext | None,
        recording: bool,
        trace_state: TraceState,
        attributes: dict[str, Any],
        start_time: int,
    ) -> None:
        # ReadableSpan's fields, by its names (its properties read them).
        self._name = name
        self._kind = kind
        self._parent = parent
        self._attributes = attributes
        self._start_time = start_time
        self._end_time: int | None = None
        self._status = _UNSET
        self._events: Sequence[Event] = ()
        self._links: Sequence[Link] = ()
        self._resource = tracer.resource
        self._instrumentation_scope = tracer.scope
        self._instrumentation_info = None
        self._context: SpanContext | None = None  # built when asked (logs, export)
        self.tracer = tracer
        self.trace_id = trace_id
        self.span_id = span_id
        self.recording = recording
        self.trace_state = trace_state

    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.recording else '00'}"

    def get_span_context(self) -> SpanContext:
        if self._context is None:
            self._context = SpanContext(
                self.trace_id,
                self.span_id,
                is_remote=False,
                trace_flags=_SAMPLED if self.recording else _NOT_SAMPLED,
                trace_state=self.trace_state,
            )
        return self._context

    @property
    def context(self) -> SpanContext:
        return self.get_span_context()

    def is_recording(self) -> bool:
        return self.recording and self._end_time is None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.recording:
            self._attributes.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.recording:
            self._attributes[key] = value

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self.recording:
            self._events = (*self._events, Event(name, attributes, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        pass  # no span of ours links; the API allows dropping them

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self._status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        stack = "".join(traceback.format_exception(exception))
        fields = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": stack,
            "exception.escaped": str(escaped),
            **(attributes or {}),
        }
        self.add_event("exception", fields, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time or time.time_ns()
        if self.recording:
            if None in self._attributes.values():  # the SDK drops None values; so do we
                self._attributes = {k: v for k, v in self._attributes.items() if v is not None}
            self.tracer.processor.on_end(self)


class Tracer(trace.Tracer):
    """Starts :class:`RecordedSpan` s with the provider's sampler, ids, resource and
    processors. A span with a local parent follows its parent's sampling decision (as the
    default parent-based sampler would) without asking the sampler again; processors see
    ``on_end`` only: export processors (batch, simple) do nothing ``on_start``."""

    def __init__(self, provider: TracerProvider, name: str) -> None:
        self.sampler = provider.sampler
        self.id_generator = provider.id_generator
        self.processor = provider._active_span_processor  # what the SDK's own tracer gets
        self.scope = InstrumentationScope(name)
        resource = provider.resource
        self.resource = _Resource(resource.attributes, resource.schema_url)

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> RecordedSpan:
        """A span under ``context``'s span (the current one when None), started now or at
        ``start_time`` (ns since the epoch)."""
        parent_span = trace.get_current_span(context)
        attrs = dict(attributes) if attributes else {}
        parent: SpanContext | None
        if isinstance(parent_span, RecordedSpan):  # local parent: its decision, no sampler
            parent = parent_span.get_span_context()
            trace_id, recording = parent_span.trace_id, parent_span.recording
            state = parent_span.trace_state
        else:
            parent_ctx = parent_span.get_span_context()
            parent = parent_ctx if parent_ctx.is_valid else None
            trace_id = parent.trace_id if parent else self.id_generator.generate_trace_id()
            result = self.sampler.should_sample(
                context if parent else None, trace_id, name, kind, attrs, links
            )
            recording = result.decision is Decision.RECORD_AND_SAMPLE
            state = result.trace_state or _EMPTY_STATE
            if recording and result.attributes:
                attrs.update(result.attributes)
        return RecordedSpan(
            self, name, kind, trace_id, self.id_generator.generate_span_id(), parent,
            recording, state, attrs, start_time or time.time_ns(),
        )  # fmt: skip

    @_agnosticcontextmanager
    def start_as_current_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(span, end_on_exit, record_exception, set_status_on_exception):
            yield span


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
