"""The gateway's spans: GenAI attributes on the server span, and the publish span.

The server span itself is :class:`gateway.observe.ObserveMiddleware`'s. The generator
calls these only when tracing is on (its tracer is not None), at three points of a
request's life: admitted (:func:`admitted`), published (:func:`publishing`, which also puts
the W3C ``traceparent``/``tracestate`` into the NATS headers) and landed (:func:`landed`).
With tracing off, :func:`forward_traceparent` still passes a client's trace context on,
so a worker's logs and an outside tracer can still join the client's trace.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from common import tracing as t

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
OPERATIONS = {"chat": "chat", "completion": "text_completion"}


def admitted(
    *,
    kind: str,
    model: str,
    group: str,
    request_id: str,
    body: Any,
    max_tokens: int,
    prompt_tokens: int,
) -> Span | None:
    """The current (server) span, with the request's GenAI attributes; None if not recording."""
    span = trace.get_current_span()
    if not span.is_recording():
        return None
    attributes: dict[str, Any] = {
        t.OPERATION: OPERATIONS.get(kind, kind),
        t.REQUEST_MODEL: model,
        t.MAX_TOKENS: max_tokens,
        t.RESPONSE_ID: request_id,
        t.GROUP: group,
        t.INPUT_TOKENS: prompt_tokens,
    }
    if body.temperature is not None:
        attributes[t.TEMPERATURE] = body.temperature
    if body.top_p is not None:
        attributes[t.TOP_P] = body.top_p
    span.set_attributes(attributes)
    return span


@contextmanager
def publishing(
    tracer: Tracer, subject: str, request_id: str, headers: MutableMapping[str, str]
) -> Iterator[None]:
    """A PRODUCER span around the JetStream publish, its context injected into ``headers``;
    an exception inside marks it failed (and propagates). A child of the current (server)
    span, never current itself: nothing under it starts spans, so no context is attached."""
    attributes = {
        "messaging.system": "nats",
        "messaging.operation.type": "send",
        "messaging.destination.name": subject,
        "messaging.message.id": request_id,
    }
    span = tracer.start_span(f"publish {subject}", kind=SpanKind.PRODUCER, attributes=attributes)
    t.inject(headers, span)
    try:
        yield
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()


def landed(
    span: Span,
    *,
    status: int,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str | None,
) -> None:
    """Usage and finish reason on the server span (the middleware sets the HTTP status)."""
    if not span.is_recording():
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
