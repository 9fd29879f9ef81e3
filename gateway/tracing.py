"""The gateway's spans: GenAI attributes on the server span, and the publish span.

The sampling decision is :class:`gateway.observe.ObserveMiddleware`'s, taken once as the
request arrives: the server span (sampled) or an :class:`~common.trace_context.Unsampled`,
left in the ASGI scope under :data:`SCOPE_KEY`. The generator calls these only when
tracing is on (its tracer is not None), at three points of a request's life: admitted
(:func:`admitted`), published (:func:`publishing`, which puts the W3C ``traceparent`` /
``tracestate`` into the NATS headers: the publish span's when sampled, flag 00 when not, so
the worker follows) and landed (:func:`landed`). A request sampled out builds nothing
here. With tracing off, :func:`forward_traceparent` still passes a client's trace context
on, so a worker's logs and an outside tracer can still join the client's trace.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from common import tracing as t
from common.trace_context import Unsampled

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
OPERATIONS = {"chat": "chat", "completion": "text_completion"}
SCOPE_KEY = "qos.trace"  # the ASGI scope's: the server span, or Unsampled
_NO_SPAN: AbstractContextManager[None] = nullcontext()

Decided = Span | Unsampled | None


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
    attributes: dict[str, Any] = {
        t.MAX_TOKENS: max_tokens,
        t.RESPONSE_ID: request_id,
        t.INPUT_TOKENS: prompt_tokens,
    }
    if body.temperature is not None:
        attributes[t.TEMPERATURE] = body.temperature
    if body.top_p is not None:
        attributes[t.TOP_P] = body.top_p
    span.set_attributes(attributes)
    # The middleware's method and path with what every request of this kind, model and
    # group shares: one set of constants (they replace the middleware's, a subset).
    shared = (
        ("http.request.method", scope["method"]), ("url.path", scope["path"]),
        (t.OPERATION, OPERATIONS.get(kind, kind)), (t.REQUEST_MODEL, model), (t.GROUP, group),
    )  # fmt: skip
    t.set_constants(span, t.constants(tracer, shared))
    return span


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
    return _PublishSpan(tracer, decided, subject, request_id, headers)


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
        shared = (("messaging.system", "nats"), ("messaging.operation.type", "send"),
                  ("messaging.destination.name", subject))  # fmt: skip
        t.set_constants(self.span, t.constants(tracer, shared))
        t.inject(headers, self.span)

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
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
    if span is None or isinstance(span, Unsampled) or not span.is_recording():
        return
    span.set_attributes(
        {
            t.INPUT_TOKENS: prompt_tokens,
            t.OUTPUT_TOKENS: completion_tokens,
            t.FINISH_REASONS: t.finish_reasons(
                finish_reason or ("error" if status >= 400 else None)
            ),
        }
    )


def forward_traceparent(request_headers: Any, headers: MutableMapping[str, str]) -> None:
    """Copy a well-formed client ``traceparent`` (and its ``tracestate``) onto the NATS
    message, as is: tracing is off here, but the client's trace goes on."""
    traceparent = request_headers.get("traceparent")
    if traceparent and _TRACEPARENT.match(traceparent.strip()):
        headers["traceparent"] = traceparent.strip()
        if tracestate := request_headers.get("tracestate"):
            headers["tracestate"] = tracestate.strip()[:512]
