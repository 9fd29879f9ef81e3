"""What each HTTP request looked like: its server span and its access-log line.

A pure ASGI middleware, so a streamed answer is measured to its last byte (the app call
returns only when the body is sent) and nothing is buffered. With tracing on, a request
under ``/v1/`` is sampled here, once (parent-based: a client's sampled ``traceparent`` is
honoured): sampled, its server span continues the client's trace, and the generator's
publish span and the worker's spans hang under it. With our tracer the server span is a
:class:`~gateway.tracing.ServerCall` (plain values, built by the export thread) whose ids
the request's log lines carry; with another SDK's it is a span, current while the request
runs. Sampled out, only an :class:`~common.trace_context.Unsampled` is left for the
generator to pass on, and the request runs as with tracing off. ``send`` is wrapped (to read the
status) only for a request that has a span or an access-log line to write.

The access log (``qosserve.access``, ``log.access_log``) has method, path, status, group,
duration and request id; never a body, a query string or a header value. ``/health`` and
``/metrics`` log at debug only: probes and scrapes would drown everything else.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.logging import bind_trace, bound_request, unbind_trace
from common.trace_context import RemoteParent, Unsampled, parse
from gateway import tracing as traced
from gateway.tracing import SCOPE_KEY, ServerCall

access = logging.getLogger("qosserve.access")
log = logging.getLogger(__name__)
# Set on an exception whose traceback is logged, so the app's 500 handler does not log it twice.
LOGGED = "_qos_logged"
_QUIET = ("/health", "/metrics")


class ObserveMiddleware:
    """Server span (when ``tracer``) and access-log line (when ``access_log``) per request."""

    def __init__(self, app: ASGIApp, *, tracer: Tracer | None, access_log: bool) -> None:
        self.app = app
        self.tracer = tracer
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        span: ServerCall | Span | None = None
        token: Any = None
        if self.tracer is not None and path.startswith("/v1/"):
            decided = scope[SCOPE_KEY] = traced.decide(self.tracer, scope, _parent(scope))
            if isinstance(decided, ServerCall):
                span = decided  # log lines name it; no OpenTelemetry context is built
                token = bind_trace(decided.trace_id, decided.span_id)
            elif isinstance(decided, Unsampled):
                # Nothing recorded, but its log lines still carry the trace id the next hops
                # follow (as the SDK's log correlation does for an unsampled span).
                token = bind_trace(decided.trace_id, decided.span_id)
            elif decided is not None:
                span = decided
                token = context.attach(trace.set_span_in_context(span))
        logged = self.access_log and access.isEnabledFor(
            logging.DEBUG if path in _QUIET else logging.INFO
        )
        if span is None and not logged:
            try:
                await self.app(scope, receive, send)
            finally:
                unbind_trace(token)
            return
        started = time.perf_counter()
        seen: dict[str, Any] = {"status": 500}

        def send_and_look(message: Message) -> Awaitable[None]:
            # Not a coroutine of its own: a streamed answer passes here once a chunk.
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for key, value in message.get("headers", ()):
                    if key in (b"x-request-id", b"x-qos-group"):
                        seen[key.decode()] = value.decode("latin-1")
            return send(message)

        try:
            await self.app(scope, receive, send_and_look)
        except Exception as exc:
            if isinstance(span, ServerCall):
                span.failed(exc)
            elif span is not None:
                span.record_exception(exc)
            # Its traceback, here while the request's trace id is still bound: the app's
            # handler for it runs outside this middleware, after the unbind.
            log_unhandled(scope, exc)
            raise
        finally:
            status = seen["status"]
            route = getattr(scope.get("route"), "path", None)
            if isinstance(span, ServerCall):
                span.end(status, route)
            elif span is not None:
                self._end_span(span, scope["method"], route, status)
            if logged:  # still under the request's trace id
                self._log(scope, path, status, started, seen)
            if span is not None and not isinstance(span, ServerCall):
                context.detach(token)
            else:
                unbind_trace(token)

    @staticmethod
    def _end_span(span: Span, method: str, route: str | None, status: int) -> None:
        if route:  # the route template, not the path: /v1/{group}/completions
            span.update_name(f"{method} {route}")
            span.set_attribute("http.route", route)
        else:  # no route took it: the method alone (HTTP semconv), not a name per probed path
            span.update_name(method)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    @staticmethod
    def _log(scope: Scope, path: str, status: int, started: float, seen: dict[str, Any]) -> None:
        level = logging.DEBUG if path in _QUIET else logging.INFO
        duration_ms = round((time.perf_counter() - started) * 1000, 2)
        fields = {
            "method": scope["method"],
            "path": path,
            "status": status,
            "group": seen.get("x-qos-group", "-"),
            "duration_ms": duration_ms,
        }
        # The answer's id, else the one the request was bound to (common.logging): a "-"
        # here hid the bound id of an answer without the header (a 499, say).
        fields["request_id"] = seen.get("x-request-id") or bound_request() or "-"
        access.log(
            level, "%s %s %d %.1fms", scope["method"], path, status, duration_ms,
            extra={"fields": fields},
        )  # fmt: skip


def log_unhandled(scope: Scope, exc: BaseException) -> None:
    """A bug's traceback, once per exception, with the request's ids (the 500 handler of
    ``gateway.app`` and this middleware both call it; the first one logs)."""
    if getattr(exc, LOGGED, False):
        return
    log.error("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
    with contextlib.suppress(AttributeError):  # an exception type with __slots__
        setattr(exc, LOGGED, True)


class _LoggedOnce(logging.Filter):
    """Drops the server's own "Exception in ASGI application" for an exception already
    logged by :func:`log_unhandled` (Starlette re-raises it after the 500 so servers can)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not getattr(exc, LOGGED, False)


_LOGGED_ONCE = _LoggedOnce()


def quiet_server_duplicates() -> None:
    """One traceback per bug: uvicorn's copy of one we logged is dropped (idempotent)."""
    logging.getLogger("uvicorn.error").addFilter(_LOGGED_ONCE)


def _parent(scope: Scope) -> RemoteParent | None:
    """The client's W3C parent, read from the raw headers (several ``tracestate`` headers
    make one list, as W3C says)."""
    traceparent = None
    states: list[str] = []
    for key, value in scope["headers"]:
        if key == b"traceparent":
            traceparent = value.decode("latin-1")
        elif key == b"tracestate":
            states.append(value.decode("latin-1"))
    if traceparent is None:
        return None
    return parse(traceparent, ",".join(states) if states else None)
