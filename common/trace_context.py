"""W3C trace context (``traceparent`` / ``tracestate``) read and written as plain values.

A request's parent is read into a :class:`RemoteParent` (ids and the sampled flag), not
into an OpenTelemetry ``Context``: most requests are sampled out at a low ratio, and for
them nothing else is ever built. A request sampled out is an :class:`Unsampled`, which
still writes a ``traceparent`` (flag ``00``) onto the next hop, so the worker follows the
gateway's decision instead of taking one of its own (parent-based sampling, W3C).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import ClassVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED, _NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
EMPTY_STATE = TraceState()


@dataclass(frozen=True, slots=True)
class RemoteParent:
    """The caller's span, as its ``traceparent`` named it (``tracestate`` kept as text)."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str | None = None
    is_remote: ClassVar[bool] = True  # as SpanContext says it

    def trace_state(self) -> TraceState:
        """``tracestate`` parsed, as the W3C propagator parses it."""
        return TraceState.from_header([self.tracestate]) if self.tracestate else EMPTY_STATE

    def span_context(self) -> SpanContext:
        """The SDK's form, built only when asked (a processor reading ``parent``)."""
        flags = _SAMPLED if self.sampled else _NOT_SAMPLED
        return SpanContext(self.trace_id, self.span_id, True, flags, self.trace_state())

    def context(self) -> Context:
        """An OpenTelemetry ``Context`` with this parent current (for the API's calls)."""
        return trace.set_span_in_context(NonRecordingSpan(self.span_context()))


# W3C trace context: a tracestate list member is key=value, at most 32 of them, 512 chars.
_TRACESTATE_MEMBER = re.compile(
    r"^(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$"
)
_TRACESTATE_MAX_MEMBERS = 32
_TRACESTATE_MAX_CHARS = 512


def clean_tracestate(value: str | None) -> str | None:
    """``value``'s well-formed list members, at most 32 and 512 characters, whole members
    dropped from the end past that (the spec's rule), None when none is left: what we
    forward, never the client's text as is."""
    if not value:
        return None
    members: list[str] = []
    length = 0
    for raw in value.split(","):
        member = raw.strip()
        if not member or not _TRACESTATE_MEMBER.match(member):
            continue
        if len(members) == _TRACESTATE_MAX_MEMBERS:
            break
        added = len(member) + (1 if members else 0)
        if length + added > _TRACESTATE_MAX_CHARS:
            break
        members.append(member)
        length += added
    return ",".join(members) or None


def parse(traceparent: str | None, tracestate: str | None = None) -> RemoteParent | None:
    """The parent ``traceparent`` names, or None when it is absent or malformed (the span
    then starts a trace of its own), by the W3C propagator's rules."""
    if not traceparent:
        return None
    match = _TRACEPARENT.fullmatch(traceparent.strip())
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    sampled = bool(int(flags_hex, 16) & 1)
    return RemoteParent(trace_id, span_id, sampled, clean_tracestate(tracestate))


def from_headers(headers: Mapping[str, str] | None) -> RemoteParent | None:
    """The parent carried by message headers (NATS), if any."""
    if not headers:
        return None
    return parse(headers.get("traceparent"), headers.get("tracestate"))


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """The ``traceparent`` header value (version 00)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


@dataclass(frozen=True, slots=True)
class Unsampled:
    """A request the sampler left out: nothing is recorded for it anywhere, but the next
    hop is told so (``traceparent`` with flag 00) and follows. ``span_id`` is the caller's,
    passed through (W3C allows it), or a fresh one where this request starts the trace."""

    trace_id: int
    span_id: int
    tracestate: str | None = None

    def inject(self, headers: MutableMapping[str, str]) -> None:
        headers["traceparent"] = traceparent(self.trace_id, self.span_id, False)
        if self.tracestate:
            headers["tracestate"] = self.tracestate
