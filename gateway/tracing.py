"""The gateway's spans: GenAI attributes on the server span, and the publish span.

The sampling decision is :class:`gateway.observe.ObserveMiddleware`'s, taken once as the
request arrives (:func:`decide`): a :class:`ServerCall` (sampled, our tracer), a started
server span (sampled, any other tracer) or an :class:`~common.trace_context.Unsampled`,
left in the ASGI scope under :data:`SCOPE_KEY`. The generator calls these only when
tracing is on (its tracer is not None), at three points of a request's life: admitted
(:func:`admitted`), published (:func:`publishing`, which puts the W3C ``traceparent`` /
``tracestate`` into the NATS headers: the publish span's when sampled, flag 00 when not, so
the worker follows) and landed (:func:`landed`). A request sampled out builds nothing
here. With tracing off, :func:`forward_traceparent` still passes a client's trace context
on, so a worker's logs and an outside tracer can still join the client's trace.

With our tracer (the services' set-up), a sampled request builds no span on the event loop:
it is a :class:`ServerCall`, the server span's plain values (ids drawn when it arrives, so
the publish can name them and log lines carry them), and its publish a
:class:`PublishCall`; each is queued as it ends and the export thread builds the span
(:class:`common.span_batch.Deferred`), where code runs hot: the worker's spans are recorded
the same way (:mod:`workers.tracing`), for the same reason. Any other tracer (an outside
SDK) gets spans, built as the request runs.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry.sdk.trace import Event
from opentelemetry.trace import (
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TraceState,
)

from common import tracing as t
from common.span_batch import Deferred
from common.span_recorder import RecordedSpan, exception_event
from common.span_recorder import Tracer as OurTracer
from common.trace_context import EMPTY_STATE, RemoteParent, Unsampled, parse, traceparent

OPERATIONS = {"chat": "chat", "completion": "text_completion"}
SCOPE_KEY = "qos.trace"  # the ASGI scope's: the server span, or Unsampled
_NO_SPAN: AbstractContextManager[None] = nullcontext()

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_ERROR = Status(StatusCode.ERROR)


class ServerCall(Deferred):
    """A sampled request's SERVER span as plain values (our tracer's path): ids and start
    time when it arrives, attributes as the request runs, status and route when it ends
    (:meth:`end`, which queues it); the export thread builds the span (:meth:`build`)."""

    __slots__ = ("answered", "attributes", "end_ns", "events", "method", "parent", "path",
                 "route", "shared", "span_id", "start_ns", "status", "trace_id", "tracer")  # fmt: skip
    _phases = None  # none: it counts as one span in the batch

    def __init__(
        self, tracer: OurTracer, trace_id: int, parent: RemoteParent | None, method: str, path: str
    ) -> None:
        self.tracer, self.trace_id, self.parent = tracer, trace_id, parent
        self.span_id = tracer.id_generator.generate_span_id()
        self.start_ns = time.time_ns()
        self.method, self.path = method, path
        self.attributes: dict[str, Any] = {}
        # What every request of this method and path (then kind, model and group) shares.
        self.shared: tuple[tuple[str, Any], ...] = (
            ("http.request.method", method), ("url.path", path),
        )  # fmt: skip
        self.events: tuple[Event, ...] = ()
        self.route: str | None = None
        self.status = 500
        # How the request ended, where a stream's 200 had gone out first (a worker error or
        # a deadline mid-stream is an error event in the body): 0 = as ``status`` says.
        self.answered = 0
        self.end_ns = 0

    def failed(self, exc: BaseException) -> None:
        """The app raised ``exc`` (an ``exception`` event, as ``record_exception`` writes)."""
        self.events = (*self.events, exception_event(exc))

    def end(self, status: int, route: str | None) -> None:
        """The answer is out: the HTTP status, the route template (if a route took it)."""
        self.end_ns = time.time_ns()
        self.status, self.route = status, route
        self.tracer.finish(self)

    def trace_state(self) -> TraceState:
        """The client's ``tracestate``, parsed (empty without one): this trace's, for the
        server span, the publish span and the ``tracestate`` header alike."""
        return self.parent.trace_state() if self.parent is not None else EMPTY_STATE

    def build(self) -> RecordedSpan:
        tracer = self.tracer
        # The route template, or the method alone when none took it (HTTP semconv): a name
        # per probed path would flood a tracing backend's operation index.
        name = f"{self.method} {self.route}" if self.route else self.method
        span = RecordedSpan(tracer, name, SpanKind.SERVER, self.trace_id, self.span_id,
                            self.parent, True, self.trace_state(), self.attributes,
                            self.start_ns)  # fmt: skip
        span.set_constants(tracer.constants(self.shared))
        if self.route:  # the route template, not the path: /v1/{group}/completions
            span.set_attribute("http.route", self.route)
        span.set_attribute("http.response.status_code", self.status)
        if max(self.status, self.answered) >= 500:
            span.set_status(_ERROR)
        span._events = self.events
        span.close(self.end_ns)
        return span


class PublishCall(Deferred, AbstractContextManager[None]):
    """The PRODUCER span of a :class:`ServerCall` as plain values: its ``traceparent`` goes
    into the headers when it starts; it is queued when the publish returns or fails."""

    __slots__ = ("call", "end_ns", "error", "request_id", "span_id", "start_ns", "subject")
    _phases = None

    def __init__(
        self, call: ServerCall, subject: str, request_id: str, headers: MutableMapping[str, str]
    ) -> None:
        self.call, self.subject, self.request_id = call, subject, request_id
        self.span_id = call.tracer.id_generator.generate_span_id()
        headers["traceparent"] = traceparent(call.trace_id, self.span_id, True)
        state = call.trace_state()  # as the span says it: parsed, then written
        if state:
            headers["tracestate"] = state.to_header()
        self.error: BaseException | None = None
        self.end_ns = 0
        self.start_ns = time.time_ns()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.end_ns = time.time_ns()
        self.error = exc
        self.call.tracer.finish(self)

    def build(self) -> RecordedSpan:
        call = self.call
        tracer = call.tracer
        state = call.trace_state()
        server = SpanContext(call.trace_id, call.span_id, False, _SAMPLED, state)
        span = RecordedSpan(tracer, f"publish {self.subject}", SpanKind.PRODUCER, call.trace_id,
                            self.span_id, server, True, state,
                            {"messaging.message.id": self.request_id}, self.start_ns)  # fmt: skip
        span.set_constants(tracer.constants(_publish_shared(self.subject)))
        if self.error is not None:
            _failed(span, self.error)
        span.close(self.end_ns)
        return span


Decided = ServerCall | Span | Unsampled | None


def decide(tracer: Tracer, scope: Any, parent: RemoteParent | None) -> Decided:
    """The sampling decision for a request arriving under ``parent`` (the middleware's): a
    :class:`ServerCall` where our tracer samples by a plain function, else a started server
    span; an :class:`Unsampled` when sampled out."""
    method, path = scope["method"], scope["path"]
    if isinstance(tracer, OurTracer) and tracer.decide is not None:
        trace_id = tracer.sampled_trace(parent)
        if isinstance(trace_id, Unsampled):
            return trace_id
        return ServerCall(tracer, trace_id, parent, method, path)
    decided = t.start_remote(tracer, f"{method} {path}", parent, SpanKind.SERVER)
    if not isinstance(decided, Unsampled):
        # Shared by every request of this method and path (a bounded cache: paths under
        # /v1/ that no route takes are few, and cleared past a few hundred).
        shared = (("http.request.method", method), ("url.path", path))
        t.set_constants(decided, t.constants(tracer, shared))
    return decided


def admitted(
    tracer: Tracer,
    scope: Any,
    *,
    kind: str,
    model: str,
    group: str,
    request_id: str,
    body: Any,
    max_tokens: int,
    prompt_tokens: int,
) -> Decided:
    """The middleware's decision for this request (``scope``'s); a server span gets the
    request's GenAI attributes."""
    span: Decided = scope.get(SCOPE_KEY)
    if span is None or isinstance(span, Unsampled):
        return span
    shared = _request_shared(scope, kind, model, group)
    attributes: dict[str, Any] = {
        t.MAX_TOKENS: max_tokens,
        t.RESPONSE_ID: request_id,
        t.INPUT_TOKENS: prompt_tokens,
    }
    if body.temperature is not None:
        attributes[t.TEMPERATURE] = body.temperature
    if body.top_p is not None:
        attributes[t.TOP_P] = body.top_p
    if isinstance(span, ServerCall):
        span.attributes.update(attributes)
        span.shared = shared
        return span
    span.set_attributes(attributes)
    t.set_constants(span, t.constants(tracer, shared))
    return span


def rejected(
    tracer: Tracer, scope: Any, *, kind: str, model: str, group: str | None, error: str
) -> None:
    """A request refused or failed with ``error`` (a QosError's code): ``error.type`` on the
    server span, and, for one refused before admission (a 429, a 400), what
    :func:`admitted` would have said of it: refusals are what a QoS trace is looked at for,
    and they showed only their HTTP fields."""
    span: Decided = scope.get(SCOPE_KEY)
    if span is None or isinstance(span, Unsampled):
        return
    shared = _request_shared(scope, kind, model, group)
    if isinstance(span, ServerCall):
        if span.end_ns:  # queued already: the export thread may be building it
            return
        span.attributes["error.type"] = error
        if len(span.shared) < len(shared):  # not admitted: the middleware's two only
            span.shared = shared
        return
    span.set_attribute("error.type", error)
    t.set_constants(span, t.constants(tracer, shared))


def publishing(
    tracer: Tracer,
    decided: Decided,
    subject: str,
    request_id: str,
    headers: MutableMapping[str, str],
    client_headers: Any,
) -> AbstractContextManager[None]:
    """What to wrap the JetStream publish in: a PRODUCER span under the server span, its
    ``traceparent`` in ``headers``; nothing but the flag-00 ``traceparent`` for a request
    sampled out; the client's own trace context where no decision was taken."""
    if isinstance(decided, Unsampled):
        decided.inject(headers)
        return _NO_SPAN
    if decided is None:
        forward_traceparent(client_headers, headers)
        return _NO_SPAN
    if isinstance(decided, ServerCall):
        return PublishCall(decided, subject, request_id, headers)
    return _PublishSpan(tracer, decided, subject, request_id, headers)


def _request_shared(
    scope: Any, kind: str, model: str, group: str | None
) -> tuple[tuple[str, Any], ...]:
    """The middleware's method and path with what every request of this kind, model and
    group shares: one set of constants (they replace the middleware's, a subset)."""
    return (
        ("http.request.method", scope["method"]), ("url.path", scope["path"]),
        (t.OPERATION, OPERATIONS.get(kind, kind)), (t.PROVIDER, t.PROVIDER_NAME),
        (t.REQUEST_MODEL, model), (t.GROUP, group),
    )  # fmt: skip


def _publish_shared(subject: str) -> tuple[tuple[str, Any], ...]:
    return (("messaging.system", "nats"), ("messaging.operation.type", "send"),
            ("messaging.destination.name", subject))  # fmt: skip


def _failed(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class _PublishSpan(AbstractContextManager[None]):
    """The PRODUCER span, started now (its ``traceparent`` into ``headers``) and ended on
    exit; an exception inside marks it failed (and propagates). Never current: nothing
    under it starts spans, so no context is attached."""

    def __init__(
        self,
        tracer: Tracer,
        server: Span,
        subject: str,
        request_id: str,
        headers: MutableMapping[str, str],
    ) -> None:
        self.span = t.start_child(
            tracer, server, f"publish {subject}", SpanKind.PRODUCER,
            {"messaging.message.id": request_id},
        )  # fmt: skip
        t.set_constants(self.span, t.constants(tracer, _publish_shared(subject)))
        t.inject(headers, self.span)

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            _failed(self.span, exc)
        self.span.end()


def landed(
    span: Decided,
    *,
    status: int,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str | None,
) -> None:
    """Usage and finish reason on the server span (the middleware sets the HTTP status)."""
    if span is None or isinstance(span, Unsampled):
        return
    attributes: dict[str, Any] = {
        t.INPUT_TOKENS: prompt_tokens,
        t.OUTPUT_TOKENS: completion_tokens,
        t.FINISH_REASONS: t.finish_reasons(finish_reason or ("error" if status >= 400 else None)),
    }
    if status >= 400:  # a stream that failed after its 200 went out says so here only
        attributes["error.type"] = str(status)
    if isinstance(span, ServerCall):
        if not span.end_ns:  # not queued yet: the export thread may be building it
            span.attributes.update(attributes)
            span.answered = status
    elif span.is_recording():
        span.set_attributes(attributes)
        if status >= 500:
            span.set_status(_ERROR)


def forward_traceparent(request_headers: Any, headers: MutableMapping[str, str]) -> None:
    """Copy a well-formed client ``traceparent`` (and its ``tracestate``) onto the NATS
    message, as is: tracing is off here, but the client's trace goes on. Read as the
    traced path reads them (gateway.observe): the last ``traceparent``, and several
    ``tracestate`` headers as one list (W3C; the first alone lost a proxy's members)."""
    getlist = getattr(request_headers, "getlist", None)
    if getlist is not None:
        parents, states = getlist("traceparent"), getlist("tracestate")
        traceparent = parents[-1] if parents else None
        tracestate = ",".join(states) if states else None
    else:
        traceparent, tracestate = (
            request_headers.get("traceparent"),
            request_headers.get("tracestate"),
        )
    parent = parse(traceparent, tracestate)
    if parent is not None and traceparent is not None:  # by the W3C rules (no version ff...)
        headers["traceparent"] = traceparent.strip()
        if parent.tracestate:  # whole members only, within the spec's limits
            headers["tracestate"] = parent.tracestate
