"""Spans → OTLP ``ExportTraceServiceRequest`` bytes, written directly (no protobuf classes).

The SDK's encoder builds a generated protobuf object per span, attribute and value and then
serialises the tree: ~10 µs a span and ~2 µs an attribute, on the batch export thread but
on the same cores as the request path (issue #7). This writes the wire format in one pass:
each message is its fields' bytes joined, prefixed by tag and length where it is nested.
Keys, resources and scopes repeat in every batch, so their encodings are kept, and so are
those of a recorded span's shared attributes (:class:`common.span_recorder.Constants`).
A recorded span's phases (children kept on it as tuples) are written from those tuples,
just before their parent.

The output parses to the same message the SDK's ``encode_spans`` produces (the tests pin
that), field for field: spans grouped by resource then scope, ``flags`` carrying only the
has-is-remote / is-remote bits, links without their trace state, as the SDK does.
"""

from __future__ import annotations

import logging
import struct
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, StatusCode, TraceState

from common.span_recorder import Constants, RecordedSpan

log = logging.getLogger(__name__)

_DOUBLE = struct.Struct("<d").pack
_FIXED32 = struct.Struct("<I").pack
_FIXED64 = struct.Struct("<Q").pack
_IDS = struct.Struct(">HQQHQ").pack
_PARENT = struct.Struct(">HQ").pack
_TIMES = struct.Struct("<BQBQ").pack
_VARINT1 = [bytes((i,)) for i in range(128)]
_INT64_MASK = (1 << 64) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

# SpanFlags: the "has is_remote" bit always, "is_remote" when the parent (or link) is remote.
_FLAGS_LOCAL = b"\x85\x01" + _FIXED32(0x100)
_FLAGS_REMOTE = b"\x85\x01" + _FIXED32(0x300)
_LINK_FLAGS_LOCAL = b"\x35" + _FIXED32(0x100)
_LINK_FLAGS_REMOTE = b"\x35" + _FIXED32(0x300)
# SpanKind (API enum 0..4) → field 6 with the proto's values (1..5).
_KIND = [b"\x30" + bytes((k + 1,)) for k in range(5)]
_TRUE, _FALSE = b"\x10\x01", b"\x10\x00"  # AnyValue.bool_value: in a oneof, so False is sent
# A phase's kind (INTERNAL), after its name; and its end: an empty status, local parent.
_PHASE_KIND = _KIND[0]
_PHASE_END = b"\x7a\x00" + _FLAGS_LOCAL


def _varint(n: int) -> bytes:
    if n < 128:
        return _VARINT1[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _string(tag: bytes, text: str) -> bytes:
    raw = text.encode()
    return tag + _varint(len(raw)) + raw


def _int(value: int) -> bytes:
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{value} does not fit an int64")
    return b"\x18" + _varint(value & _INT64_MASK)


def _any_value(value: Any) -> bytes:
    """An ``AnyValue``'s fields (the SDK's rules: bool before int, str and bytes before
    sequences; None is an empty value)."""
    kind = type(value)
    if kind is str:
        return _string(b"\x0a", value)
    if kind is bool:
        return _TRUE if value else _FALSE
    if kind is int:
        return _int(value)
    if kind is float:
        return b"\x21" + _DOUBLE(value)
    if kind is tuple or kind is list:  # finish reasons: before the ABCs' slow checks
        return _nested(b"\x2a", b"".join(_nested(b"\x0a", _any_value(v)) for v in value))
    if value is None:
        return b""
    if isinstance(value, bool):
        return _TRUE if value else _FALSE
    if isinstance(value, str):
        return _string(b"\x0a", value)
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return b"\x3a" + _varint(len(value)) + value
    if isinstance(value, Sequence):
        items = b"".join(_nested(b"\x0a", _any_value(v)) for v in value)
        return _nested(b"\x2a", items)
    if isinstance(value, Mapping):
        pairs = b"".join(
            _nested(b"\x0a", _string(b"\x0a", str(k)) + _nested(b"\x12", _any_value(v)))
            for k, v in value.items()
        )
        return _nested(b"\x32", pairs)
    raise TypeError(f"invalid attribute type {kind.__name__}")


def _nested(tag: bytes, body: bytes) -> bytes:
    return tag + _varint(len(body)) + body


def _dropped(span: ReadableSpan) -> bytes:
    """The span's dropped attribute, event and link counts (fields 10, 12, 14)."""
    out = b""
    if span.dropped_attributes:
        out += b"\x50" + _varint(span.dropped_attributes)
    if span.dropped_events:
        out += b"\x60" + _varint(span.dropped_events)
    if span.dropped_links:
        out += b"\x70" + _varint(span.dropped_links)
    return out


def _times(start: int | None, end: int | None) -> bytes:
    """Start (7) and end (8) time, when only one is known."""
    return (b"\x39" + _FIXED64(start) if start else b"") + (b"\x41" + _FIXED64(end) if end else b"")


def _trace_state(state: TraceState | None) -> bytes:
    if not state:
        return b""
    return _string(b"\x1a", ",".join(f"{k}={v}" for k, v in state.items()))


class SpanEncoder:
    """Encodes batches of finished spans; keeps the encodings of attribute keys, resources
    and scopes it has seen (one encoder per exporter: not thread-safe, and the batch
    processor exports from one thread)."""

    MAX_KEYS = 4096
    MAX_STRINGS = 4096

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        self._names: dict[str, bytes] = {}
        # Whole fields of attributes by (key, value), a table per field tag and value kind
        # (1 == 1.0 == True: one table would mix them): str and float values, ints (token
        # counts, attempts, statuses repeat), tuples of str (finish reasons).
        self._strings: defaultdict[bytes, dict[tuple[str, Any], bytes]] = defaultdict(dict)
        self._ints: defaultdict[bytes, dict[tuple[str, Any], bytes]] = defaultdict(dict)
        self._tuples: defaultdict[bytes, dict[tuple[str, Any], bytes]] = defaultdict(dict)
        # By id, holding the object so its id is not reused: resources and scopes are few
        # and immutable, and hashing a Resource dumps its attributes to JSON.
        self._resources: dict[int, tuple[Resource, bytes]] = {}
        self._scopes: dict[int, tuple[InstrumentationScope | None, bytes]] = {}

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        """The serialised ``ExportTraceServiceRequest`` carrying ``spans``."""
        # Grouped by the encodings: equal resources (each of our tracers has its own copy)
        # share one ResourceSpans, as they do when the SDK groups them by equality.
        groups: dict[bytes, dict[bytes, list[bytes]]] = {}
        resource: Resource | None = None
        scope: InstrumentationScope | None = None
        bucket: list[bytes] = []
        for span in spans:
            if span.resource is not resource or span.instrumentation_scope is not scope:
                resource, scope = span.resource, span.instrumentation_scope
                scopes = groups.setdefault(self._resource(span.resource), {})
                bucket = scopes.setdefault(self._scope(scope), [])
            if type(span) is RecordedSpan and span._phases:
                self._phases(span, bucket)
            bucket.append(self._span(span))
        out = []
        for resource_fields, by_scope in groups.items():
            body = [resource_fields]
            for scope_fields, encoded in by_scope.items():
                body.append(_nested(b"\x12", scope_fields + b"".join(encoded)))
            out.append(_nested(b"\x0a", b"".join(body)))
        return b"".join(out)

    def _attributes(self, tag: bytes, attributes: Mapping[str, Any] | None) -> list[bytes]:
        """Each attribute as a ``KeyValue`` field ``tag``; one that cannot be encoded is
        logged and left out (as the SDK does)."""
        if not attributes:
            return []
        out = []
        strings, ints, tuples = self._strings[tag], self._ints[tag], self._tuples[tag]
        for key, value in attributes.items():
            kind = type(value)
            # Most attributes, and most of their values repeat (model, group, counts).
            table = (
                strings if kind is str or kind is float
                else ints if kind is int
                else tuples if kind is tuple and all(type(v) is str for v in value)
                else None
            )  # fmt: skip
            if table is not None:
                field = table.get((key, value))
                if field is not None:
                    out.append(field)
                    continue
            try:
                field = self._attribute(tag, key, value, kind)
            except (TypeError, ValueError, UnicodeEncodeError) as exc:
                log.warning("span attribute %r not exported: %s", key, exc)
                continue
            if table is not None:
                if len(table) >= self.MAX_STRINGS:
                    table.clear()
                table[key, value] = field
            out.append(field)
        return out

    def _attribute(self, tag: bytes, key: str, value: Any, kind: type) -> bytes:
        """One ``KeyValue`` field; the common shapes written inline."""
        prefix = self._keys.get(key)
        if prefix is None:
            prefix = self._key(key)
        if kind is str:
            raw = value.encode()
            n = len(raw)
            if n < 120:
                pair = prefix + _VARINT1[n + 2] + b"\x0a" + _VARINT1[n] + raw
                return tag + _varint(len(pair)) + pair
        elif kind is float:
            return tag + _varint(len(prefix) + 10) + prefix + b"\x09\x21" + _DOUBLE(value)
        elif kind is int and 0 <= value < 128:  # token counts, attempts, statuses
            pair = prefix + b"\x02\x18" + _VARINT1[value]
            return tag + _varint(len(pair)) + pair
        encoded = _any_value(value)
        pair = prefix + _varint(len(encoded)) + encoded
        return tag + _varint(len(pair)) + pair

    def _key(self, key: str) -> bytes:
        """``KeyValue.key`` and the tag of ``KeyValue.value`` that follows it."""
        if type(key) is not str:
            raise TypeError(f"attribute key {key!r} is not a string")
        if len(self._keys) >= self.MAX_KEYS:
            self._keys.clear()
        encoded = self._keys[key] = _string(b"\x0a", key) + b"\x12"
        return encoded

    def _resource(self, resource: Resource) -> bytes:
        """``ResourceSpans``' resource and schema_url fields."""
        cached = self._resources.get(id(resource))
        if cached is not None:
            return cached[1]
        body = b"".join(self._attributes(b"\x0a", resource.attributes))
        encoded = _nested(b"\x0a", body)
        if resource.schema_url:
            encoded += _string(b"\x1a", resource.schema_url)
        if len(self._resources) >= 64:
            self._resources.clear()
        self._resources[id(resource)] = (resource, encoded)
        return encoded

    def _scope(self, scope: InstrumentationScope | None) -> bytes:
        """``ScopeSpans``' scope and schema_url fields."""
        cached = self._scopes.get(id(scope))
        if cached is not None:
            return cached[1]
        if scope is None:
            encoded = b"\x0a\x00"
        else:
            body = [_string(b"\x0a", scope.name)] if scope.name else []
            if scope.version:
                body.append(_string(b"\x12", scope.version))
            body.extend(self._attributes(b"\x1a", scope.attributes))
            encoded = _nested(b"\x0a", b"".join(body))
            if scope.schema_url:
                encoded += _string(b"\x1a", scope.schema_url)
        if len(self._scopes) >= 256:
            self._scopes.clear()
        self._scopes[id(scope)] = (scope, encoded)
        return encoded

    def _span(self, span: ReadableSpan) -> bytes:
        """A ``Span`` field of ``ScopeSpans`` (tag and length included)."""
        shared = b""
        if type(span) is RecordedSpan:  # plain fields: no SpanContext, proxy or copy built
            trace_id, span_id, state = span.trace_id, span.span_id, span.trace_state
            attributes: Mapping[str, Any] = span._vars
            if span._constants is not None:
                shared = span._constants.encoded or self._constants(span._constants)
            events, links = span._events, span._links
            dropped = b""
            parent_id, remote = span._parent_id or None, span._parent_remote
        else:
            ctx = span.get_span_context()
            assert ctx is not None
            trace_id, span_id, state = ctx.trace_id, ctx.span_id, ctx.trace_state
            attributes, events, links = span.attributes or {}, span.events, span.links
            dropped = _dropped(span)
            parent = span.parent
            parent_id = parent.span_id if parent is not None else None
            remote = parent is not None and parent.is_remote
        # trace_id (1) and span_id (2) in one pack; the tags read as big-endian shorts.
        parts = [_IDS(0x0A10, trace_id >> 64, trace_id & _INT64_MASK, 0x1208, span_id)]
        if state:
            parts.append(_trace_state(state))
        if parent_id is not None:
            parts.append(_PARENT(0x2208, parent_id))
        name = self._names.get(span.name)
        if name is None:
            name = self._name(span.name)
        start, end = span.start_time, span.end_time
        parts += (
            name,
            _KIND[span.kind._value_],
            _TIMES(0x39, start, 0x41, end) if start and end else _times(start, end),
            dropped,
            shared,
        )
        parts += self._attributes(b"\x4a", attributes)
        for event in events:
            parts.append(_nested(b"\x5a", self._event(event)))
        for link in links:
            parts.append(_nested(b"\x6a", self._link(link)))
        status = span.status
        code, message = status.status_code, status.description
        if message or code is not StatusCode.UNSET:
            message_field = _string(b"\x12", message) if message else b""
            code_field = b"\x18" + _VARINT1[code._value_] if code._value_ else b""
            parts.append(_nested(b"\x7a", message_field + code_field))
        else:
            parts.append(b"\x7a\x00")  # the SDK always sets a status, even an empty one
        parts.append(_FLAGS_REMOTE if remote else _FLAGS_LOCAL)
        body = b"".join(parts)
        n = len(body)
        return b"\x12" + (_VARINT1[n] if n < 128 else _varint(n)) + body

    def _constants(self, constants: Constants) -> bytes:
        """The shared attributes' fields, written once and kept on them."""
        encoded = constants.encoded = b"".join(self._attributes(b"\x4a", constants.items))
        return encoded

    def _phases(self, span: RecordedSpan, bucket: list[bytes]) -> None:
        """``span``'s phases as ``Span`` fields: INTERNAL children with a name and two
        times, the parent's trace id and trace state, an empty status (as the SDK writes
        a child span with no attributes)."""
        trace_id = span.trace_id
        hi, lo = trace_id >> 64, trace_id & _INT64_MASK
        middle = _PARENT(0x2208, span.span_id)
        if span.trace_state:
            middle = _trace_state(span.trace_state) + middle
        names = self._names
        for span_id, (name, start_s, end_s) in zip(
            span.phase_ids(), span._phases or (), strict=True
        ):
            name_field = names.get(name) or self._name(name)
            start, end = int(start_s * 1e9), int(end_s * 1e9)
            body = b"".join((
                _IDS(0x0A10, hi, lo, 0x1208, span_id), middle, name_field, _PHASE_KIND,
                _TIMES(0x39, start, 0x41, end) if start and end else _times(start, end),
                _PHASE_END,
            ))  # fmt: skip
            n = len(body)
            bucket.append(b"\x12" + (_VARINT1[n] if n < 128 else _varint(n)) + body)

    def _name(self, name: str) -> bytes:
        """``Span.name``: names repeat (a route, "queue", "decode"), so they are kept."""
        if len(self._names) >= self.MAX_KEYS:
            self._names.clear()
        encoded = self._names[name] = _string(b"\x2a", name)
        return encoded

    def _event(self, event: Any) -> bytes:
        parts = [b"\x09", _FIXED64(event.timestamp)] if event.timestamp else []
        if event.name:
            parts.append(_string(b"\x12", event.name))
        parts += self._attributes(b"\x1a", event.attributes)
        if event.dropped_attributes:
            parts += (b"\x20", _varint(event.dropped_attributes))
        return b"".join(parts)

    def _link(self, link: Any) -> bytes:
        ctx: SpanContext = link.context
        parts = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08"]
        parts.append(ctx.span_id.to_bytes(8, "big"))
        parts += self._attributes(b"\x22", link.attributes)
        if link.dropped_attributes:
            parts += (b"\x28", _varint(link.dropped_attributes))
        parts.append(_LINK_FLAGS_REMOTE if ctx.is_remote else _LINK_FLAGS_LOCAL)
        return b"".join(parts)
