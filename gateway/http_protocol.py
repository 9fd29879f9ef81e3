"""uvicorn's httptools protocol with bounds on a request's head: its size and the time it
takes to arrive.

uvicorn bounds neither, and the API-key check runs in the app, only once the head is
complete: anyone who could reach the port could trickle header bytes for ever (a
connection, a file descriptor and a buffer each: slowloris) or send megabytes of headers
(httptools rebuilds a long header value by concatenation, so its cost grows with the
square of its length). Here a head over ``max_head_bytes`` gets a 431 and a head not
complete ``head_timeout_s`` after the connection opened, or after its previous response
ended, gets a 408; both close the connection, both in OpenAI's error shape. A connection
busy with a response (a long stream) is never timed. A response that ends before its
request's body has all arrived (an early 401, 413 or 408) gives the rest of the body the
head's time to arrive, unread, and then closes the connection: uvicorn kept such a
connection alive and stopped timing it, so a client trickling a chunked body held it for
ever (enough of them took every slot of ``gateway.max_connections``). Closing at once
would reset a connection whose client is still sending (httpx sends the head and the body
apart: the body is in flight or unread in the kernel), and the reset loses the answer it
has not read yet; a request waiting on ``Expect: 100-continue`` that sent none of its body
is closed at once, or its next request would be read as that body. uvicorn's own 400 for a
malformed request is in OpenAI's error shape too.

A request asking to switch protocols (``Upgrade: h2c``, Java's HttpClient) is served as
HTTP/1.1 with its body (httptools dropped it: :meth:`BoundedHeadProtocol._decline_upgrade`).

``/health`` and ``/metrics`` are answered past ``gateway.max_connections``: uvicorn
answered every request 503 once that many connections were open, idle keep-alives
included, so a gateway saturated by long streams failed its liveness probe (Kubernetes
restarted it, cutting every stream it held) and went dark to Prometheus when it was most
worth watching. Everything else still gets the 503, in OpenAI's error shape with a
``Retry-After`` (uvicorn's was plain text).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.errors import ServiceUnavailableError

log = logging.getLogger(__name__)

DEFAULT_MAX_HEAD_BYTES = 32 * 1024
DEFAULT_HEAD_TIMEOUT_S = 30.0

# Paths answered whatever the connection count: probes and scrapes (module docstring).
PROBE_PATHS = frozenset({b"/health", b"/metrics"})

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _HeadTooLarge(Exception):
    """Raised from the parser's callback to stop it: nothing of the request goes on."""


class BoundedHeadProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` that refuses a request head too large or too slow."""

    max_head_bytes: ClassVar[int] = DEFAULT_MAX_HEAD_BYTES
    head_timeout_s: ClassVar[float] = DEFAULT_HEAD_TIMEOUT_S
    # Told the status of each request refused here, before the app (and its metrics) ran:
    # a 503 past max_connections, a 408/431/400 head. The gateway counts them under group
    # "-", as its other refusals before classification: under overload they were missing
    # from the request and 5xx panels just when those mattered.
    on_refused: ClassVar[Callable[[int], None] | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # the bytes arriving belong to a request's head
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_seen = False  # bytes of the current request's body have arrived
        self._draining = False  # answered early: the rest of its body is read and dropped
        self._resuming_body = False  # a declined upgrade's body: its stand-in head is parsed

    # -- the head's time ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        if not self._resuming_body:
            super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._resuming_body:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._resuming_body:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._resuming_body:
            return
        self._reading_head = False
        self._cancel_head_timer()
        # A head that arrived in one read (uvloop reads up to 256 KiB) was never counted by
        # data_received while it was incomplete: count what was parsed.
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_head_bytes:
            self._refuse_large_head()
            raise _HeadTooLarge  # the parser stops; send_400_response sees it closed
        limit = self.limit_concurrency
        if limit is not None:
            probe = self.url.split(b"?", 1)[0] in PROBE_PATHS
            over = len(self.connections) >= limit or len(self.tasks) >= limit
            if probe or over:
                # uvicorn's own check answers a plain-text 503: probes pass it, the rest
                # get OpenAI's shape with a Retry-After (the openai SDK retries on it).
                app = self.app
                self.limit_concurrency = None  # both read by uvicorn for this request only
                if not probe:
                    self.app = _over_capacity
                    self._count_refusal(503)
                try:
                    super().on_headers_complete()
                finally:
                    self.limit_concurrency, self.app = limit, app
                return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_seen = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # What arrives next is the next request's head (timed once this response ends).
        self._reading_head = True
        self._head_bytes = 0
        self._body_seen = False
        if self._draining:  # the early answer's body is all in: the next head is timed
            self._draining = False
            self._arm_head_timer()

    def on_response_complete(self) -> None:
        # With a pipelined request queued, ``cycle`` is that one's (its body may still be
        # coming) and the request just answered was read whole before its head began.
        unread = not self.pipeline and self.cycle is not None and self.cycle.more_body
        if unread and not self.transport.is_closing():
            # Answered before its body was all in (module docstring).
            super().on_response_complete()
            if not self._body_seen and self.expect_100_continue:
                self.transport.close()  # it waits for a 100 Continue: no body is coming
            else:
                self._draining = True
                self._cancel_head_timer()
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._drain_timed_out)
            return
        pipelined = bool(self.pipeline)  # its head is in already: the next response starts
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _drain_timed_out(self) -> None:
        self._head_timer = None
        if self._draining and not self.transport.is_closing():
            log.info("closed a connection from %s: the body of a request answered early "
                     "did not end within %g s", _peer(self.client), self.head_timeout_s)  # fmt: skip
            self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head:
            return
        self._refuse(
            408,
            "request_timeout",
            f"the request's headers did not arrive within {self.head_timeout_s:g} s "
            "(gateway.header_timeout_s)",
            # A connection that sent nothing (a pool's or a browser's preconnect) held no
            # request: answered, not counted as one.
            count=self._head_bytes > 0,
        )

    # -- the head's size ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.send_400_response("Invalid HTTP request received.")  # uvicorn's own words
            return
        except httptools.HttpParserUpgrade as upgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
                return
            self._decline_upgrade(data[upgrade.args[0] :])
        # Judged after parsing: the chunk that completes a head may carry body bytes too.
        if (
            self._reading_head
            and self._head_bytes > self.max_head_bytes
            and not self.transport.is_closing()
        ):
            self._refuse_large_head()

    def _decline_upgrade(self, rest: bytes) -> None:
        """A request asking to switch protocols (``Upgrade: h2c``, sent by Java's
        HttpClient on every ``http://`` request) is served as plain HTTP/1.1, as RFC 9110
        §7.8 allows. httptools skips such a request's body and stops (uvicorn's bug #2722:
        the app read an empty body, a 400 "not valid JSON"; the body's bytes, arriving
        later, were taken for a malformed next request): the body is read here instead,
        by a fresh parser that is handed a stand-in head of the same framing."""
        log.debug("declined an upgrade to %r from %s", self._get_upgrade(), _peer(self.client))
        self.parser = httptools.HttpRequestParser(self)
        cycle = self.cycle
        framing = self._body_framing()
        if framing is not None and cycle is not None and not cycle.response_complete:
            # The app has not run yet (it starts on this callback's return): its first
            # read waits for the body, which the end of the stand-in message completes.
            cycle.more_body = True
            self._reading_head = False
            self._resuming_body = True
            try:
                self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n")
            finally:
                self._resuming_body = False
        if rest:
            self.data_received(rest)

    def _body_framing(self) -> bytes | None:
        """The request's body framing header, for the stand-in head (None: no body)."""
        length = None
        for name, value in self.headers:
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                return b"transfer-encoding: chunked\r\n"
            if name == b"content-length":
                length = value
        if length is None or length.strip() in (b"", b"0"):
            return None
        return b"content-length: " + length.strip() + b"\r\n"

    def _refuse_large_head(self) -> None:
        self._refuse(
            431,
            "request_header_fields_too_large",
            f"the request's headers exceed {self.max_head_bytes} bytes (gateway.max_header_bytes)",
        )

    def _count_refusal(self, status: int) -> None:
        count = type(self).on_refused
        if count is not None:
            count(status)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a malformed request, in OpenAI's error shape; nothing when the
        connection is closing already (a refusal stopped the parser)."""
        if not self.transport.is_closing():
            self._refuse(400, "invalid_http_request", msg)

    def _refuse(self, status: int, code: str, message: str, *, count: bool = True) -> None:
        """Answer ``status`` in OpenAI's error shape and close the connection."""
        self._reading_head = False
        self._cancel_head_timer()
        log.warning("refused a request from %s: %s", _peer(self.client), message)
        cycle = self.cycle
        if (
            cycle is not None
            and not cycle.response_complete
            and not (cycle.more_body and not cycle.response_started)
        ):
            # A pipelined request's head went wrong while the one before it is answered
            # (an answer now would land inside that response, or be read as its answer).
            # Just close. A refusal of the request still being read (its body malformed),
            # before its own answer began, is its answer.
            self.transport.close()
            return
        if self._draining:
            # The rest of a body answered early went wrong: that request has its answer, and
            # a second one would be read as the next request's.
            self.transport.close()
            return
        # Counted only for a request the app never saw: one whose body went wrong while the
        # app read it counts its own 499.
        app_saw_it = cycle is not None and not cycle.response_complete
        if count and not app_saw_it:
            self._count_refusal(status)
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None,
                       "code": code}}
        ).encode()  # fmt: skip
        self.transport.write(
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
            + b"content-type: application/json\r\n"
            + b"content-length: %d\r\n" % len(body)
            + b"connection: close\r\n\r\n"
            + body
        )
        self.transport.close()


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """The answer past ``gateway.max_connections``: a 503 in OpenAI's shape, and close."""
    error = ServiceUnavailableError(
        "the gateway is at its limit of open connections (gateway.max_connections); retry",
        code="too_many_connections",
        retry_after_s=1,
    )
    body = json.dumps(error.to_openai()).encode()
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), *headers]})  # fmt: skip
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"


def bounded_head_protocol(
    max_head_bytes: int,
    head_timeout_s: float,
    on_refused: Callable[[int], None] | None = None,
) -> type[HttpToolsProtocol]:
    """A :class:`BoundedHeadProtocol` with these bounds, for ``uvicorn.Config(http=...)``
    (uvicorn builds the protocol itself, one per connection)."""
    bounds = {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s}
    # staticmethod: a plain function as a class attribute would be bound to the instance.
    refused = {"on_refused": staticmethod(on_refused) if on_refused is not None else None}
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,), bounds | refused)
