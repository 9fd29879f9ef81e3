"""OTLP export in a process of its own: the service's export thread only packs records.

Encoding spans to OTLP protobuf is Python work that holds the GIL: in a worker, the GIL the
event loop and the engine thread share, so at ratio 1 it slowed the worker's step cycle
(issue #7: ~29 µs per request of a ~0.7 ms budget on the sim stack). With
``QOSSERVE_OTLP_EXPORT_PROCESS=1`` and ``OTEL_TRACES_EXPORTER=otlp`` (not a ``QOS_*`` name:
those are configuration keys), the batch processor hands its spans to
:class:`ProcessSpanExporter`, which packs each as a flat msgpack record (no pickle) and
writes the batch, length-prefixed, to a child interpreter's stdin (``python -m
common.span_process``); the child rebuilds the spans and exports them with
:class:`~common.otlp_export.OtlpSpanExporter` (same encoder, settings and retries).
Resources, scopes and shared attributes (:class:`~common.span_recorder.Constants`) cross
once and are referred to by number after.

The service's CPU per span shrinks to the packing; the encoding's CPU moves to the child,
so on a machine with cores to spare the request path gains and the total stays about the
same. ``export`` returns once a batch is in the pipe; the child reports after each batch
how many of its spans (phases counted) its exporter delivered or gave up on, and the batch
processor counts those (``qos_trace_spans_total``), not the hand-over. The child answers
``force_flush``/``shutdown`` only once what it was sent before is exported; a shutdown past
its budget (a collector down, the child retrying) tells the child to stop retrying, then
kills it, and counts what it still held as failed. When the service dies its end of the
pipe closes, and the child exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import msgpack
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceState

from common.span_recorder import Constants, RecordedSpan

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
ENV_SWITCH = "QOSSERVE_OTLP_EXPORT_PROCESS"
_FRAME = struct.Struct(">I")  # a frame's length, before its msgpack bytes
MAX_REFS = 4096
_ATTRIBUTES = 12  # where a record holds the span's own attributes
_PHASES = 14  # where a record holds the span's phases
# A stopping service's wait for the child to export what it holds (as SpanBatch's own).
SHUTDOWN_S = 5.0
# After "stop retrying": the send in flight ends within its timeout, the rest fail at once.
STOP_RETRYING_GRACE_S = 2.0


class ProcessSpanExporter(SpanExporter):
    """Packs batches for the export process (see the module docstring)."""

    reads_phases = True  # records carry a span's phases; the child's encoder writes them
    reports_delivery = True  # SUCCESS means "in the pipe": delivered/undelivered say the rest

    def __init__(
        self,
        env: Mapping[str, str],
        protocol: str,
        timeout_s: float = 30.0,
        shutdown_s: float = SHUTDOWN_S,
    ) -> None:
        # A plain child interpreter (not multiprocessing's spawn, which would import the
        # service's __main__ again, engine and all): frames over its stdin and stdout.
        # A session of its own: a terminal's Ctrl-C reaches the service, which drains and
        # flushes its last spans through the child; it killed the child first. Stdin EOF
        # still ends it with its parent.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "common.span_process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
            start_new_session=True,
        )  # fmt: skip
        self._timeout_s = timeout_s
        self._shutdown_s = shutdown_s
        self._lock = threading.Lock()  # one batch in the pipe at a time; flush waits its turn
        # Spans (phases counted) handed to the child, and what the child said became of them;
        # written by the export thread and the reader thread, one count each.
        self.handed = 0
        self.delivered = 0
        self.undelivered = 0
        self._lost = 0  # held by a child that ended without saying: counted failed
        self._answers: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(
            target=self._read_reports, name="qos-span-process-reader", daemon=True
        )
        # id(object) -> (object, its number): the object kept so its id is not reused.
        self._refs: dict[int, tuple[Any, int]] = {}
        self._next = 0
        self._reader.start()
        self._send(msgpack.packb(["init", dict(env), protocol]))

    def _read_reports(self) -> None:
        """The child's stdout: a report after each batch, and answers to commands."""
        while (frame := _read_frame(self._proc.stdout)) is not None:
            message = msgpack.unpackb(frame)
            if message[0] == "sent":
                self.delivered += message[1]
                self.undelivered += message[2]
            else:
                self._answers.put(message[0])
        # The child is gone: what it held and did not report is lost.
        self._lost = max(0, self.handed - self.delivered - self.undelivered)

    @property
    def failed_spans(self) -> int:
        """Spans the child gave up on or held when it ended."""
        return self.undelivered + self._lost

    def _send(self, payload: bytes) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(_FRAME.pack(len(payload)) + payload)
        self._proc.stdin.flush()

    # -- the service side -------------------------------------------------------------------

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._proc.poll() is not None:
                return SpanExportResult.FAILURE
            defs: list[Any] = []
            if len(self._refs) >= MAX_REFS:  # constants churn with models and subjects
                self._refs.clear()  # between batches: no record refers to a number forgotten
                defs.append([0, "forget"])  # the child forgets them too, first
            records = [self._record(span, defs) for span in spans]
            try:
                payload = msgpack.packb(["spans", defs, records], use_bin_type=True)
            except (OverflowError, TypeError, ValueError):
                payload = self._pack_leniently(defs, records)
            try:
                self._send(payload)
            except (OSError, ValueError) as exc:
                log.error("span export process unreachable: %s; %d spans dropped", exc, len(spans))
                return SpanExportResult.FAILURE
            self.handed += sum(1 + len(r[_PHASES]) for r in records)
        return SpanExportResult.SUCCESS

    def _ref(self, obj: Any, defs: list[Any], definition: list[Any]) -> int:
        """The number of ``obj`` (a resource, scope or constants); its definition joins
        ``defs`` the first time."""
        found = self._refs.get(id(obj))
        if found is not None:
            return found[1]
        self._next += 1
        self._refs[id(obj)] = (obj, self._next)
        defs.append([self._next, *definition])
        return self._next

    def _record(self, span: ReadableSpan, defs: list[Any]) -> list[Any]:
        resource = self._ref(
            span.resource,
            defs,
            ["resource", dict(span.resource.attributes), span.resource.schema_url],
        )
        scope = span.instrumentation_scope
        scope_ref = (
            0 if scope is None
            else self._ref(scope, defs, ["scope", scope.name, scope.version, scope.schema_url,
                                         dict(scope.attributes or {})])
        )  # fmt: skip
        status = span.status
        events = [[e.name, e.timestamp, dict(e.attributes or {})] for e in span.events]
        if type(span) is RecordedSpan:
            constants = span._constants
            shared = 0 if constants is None else self._ref(
                constants, defs, ["constants", dict(constants.items)]
            )  # fmt: skip
            state = span.trace_state.to_header() if span.trace_state else ""
            return [
                span.trace_id >> 64, span.trace_id & _MASK64, span.span_id, span._parent_id,
                span._parent_remote, span._name, span._kind.value, span._start_time,
                span._end_time, status.status_code.value, status.description or "", state,
                span._vars, shared, span._phases or [], events, resource, scope_ref,
            ]  # fmt: skip
        ctx = span.get_span_context()
        assert ctx is not None
        parent = span.parent
        return [
            ctx.trace_id >> 64, ctx.trace_id & _MASK64, ctx.span_id,
            parent.span_id if parent is not None else 0,
            parent is not None and parent.is_remote, span.name, span.kind.value,
            span.start_time, span.end_time, status.status_code.value, status.description or "",
            ctx.trace_state.to_header() if ctx.trace_state else "",
            dict(span.attributes or {}), 0, [], events, resource, scope_ref,
        ]  # fmt: skip

    @staticmethod
    def _pack_leniently(defs: list[Any], records: list[list[Any]]) -> bytes:
        """A batch msgpack refused (an int past 64 bits, an odd type): each attribute that
        cannot be packed is left out, as the encoder leaves out what it cannot encode."""
        for record in records:
            kept = {}
            for key, value in record[_ATTRIBUTES].items():
                try:
                    msgpack.packb(value, use_bin_type=True)
                except (OverflowError, TypeError, ValueError):
                    log.warning("span attribute %r not exported: cannot be packed", key)
                    continue
                kept[key] = value
            record[_ATTRIBUTES] = kept
        return msgpack.packb(["spans", defs, records], use_bin_type=True)

    def _call(self, command: str, timeout_s: float) -> bool:
        """Send ``command``; whether the child answered within ``timeout_s`` (its queue
        exported)."""
        with self._lock:
            if self._proc.poll() is not None:
                return False
            while not self._answers.empty():  # an answer that came after its caller left
                self._answers.get_nowait()
            try:
                self._send(msgpack.packb([command]))
            except (OSError, ValueError):
                return False
        try:
            return self._answers.get(timeout=max(0.0, timeout_s)) == command
        except queue.Empty:
            return False

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._call("flush", min(self._timeout_s, timeout_millis / 1000))

    def stop_retrying(self) -> None:
        """The child's exporter stops retrying (the batch processor ran out of time)."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.kill(self._proc.pid, signal.SIGUSR1)

    def shutdown(self) -> None:
        """What the child holds exported within ``shutdown_s``; past it the child stops
        retrying, then is killed (a collector down kept a stopping service waiting on every
        batch's retries, up to a minute)."""
        deadline = time.monotonic() + self._shutdown_s
        if not self._call("stop", self._shutdown_s):
            self.stop_retrying()
            left = max(0.0, deadline - time.monotonic())
            self._call("stop", min(self._timeout_s, left + STOP_RETRYING_GRACE_S))
        try:
            self._proc.wait(STOP_RETRYING_GRACE_S)
        except subprocess.TimeoutExpired:
            log.error("span export process did not stop; killed")
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._reader.join(STOP_RETRYING_GRACE_S)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        if self.failed_spans:
            log.warning("span export process: %d spans not delivered", self.failed_spans)


def _read_frame(stream: Any) -> bytes | None:
    """One length-prefixed frame; None at end of stream."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


# -- the export process -----------------------------------------------------------------------


def main() -> None:
    """The child: rebuild each batch and export it until told to stop or stdin closes."""
    from common.otlp_export import OtlpSettings, OtlpSpanExporter

    read, out = sys.stdin.buffer, sys.stdout.buffer
    first = _read_frame(read)
    if first is None:
        return
    _, env, protocol = msgpack.unpackb(first, raw=False)
    exporter = OtlpSpanExporter(OtlpSettings.from_env(env, protocol))
    # The service's shutdown ran out of time: the send in flight ends, the rest fail at once.
    signal.signal(signal.SIGUSR1, lambda *_: exporter.stop_retrying())
    tables: dict[int, Any] = {}
    tracer = SimpleNamespace(id_generator=RandomIdGenerator())
    try:
        while (frame := _read_frame(read)) is not None:  # None: the service is gone
            message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
            command = message[0]
            if command == "spans":
                _define(tables, message[1])
                weight = sum(1 + len(r[_PHASES]) for r in message[2])
                result = exporter.export([_rebuild(r, tables, tracer) for r in message[2]])
                ok = result is SpanExportResult.SUCCESS
                _write_frame(out, ["sent", weight if ok else 0, 0 if ok else weight])
            elif command in ("flush", "stop"):
                _write_frame(out, [command])
                if command == "stop":
                    break
    finally:
        exporter.shutdown()


def _write_frame(out: Any, message: list[Any]) -> None:
    payload = msgpack.packb(message)
    out.write(_FRAME.pack(len(payload)) + payload)
    out.flush()


def _define(tables: dict[int, Any], defs: list[Any]) -> None:
    for number, kind, *rest in defs:
        if kind == "forget":
            tables.clear()
        elif kind == "resource":
            attributes, schema_url = rest
            tables[number] = Resource(attributes, schema_url)
        elif kind == "scope":
            name, version, schema_url, attributes = rest
            tables[number] = InstrumentationScope(name, version, schema_url, attributes or None)
        else:
            tables[number] = Constants(rest[0])


def _rebuild(record: list[Any], tables: dict[int, Any], tracer: Any) -> RecordedSpan:
    (hi, lo, span_id, parent_id, remote, name, kind, start, end, code, description, state,
     attributes, shared, phases, events, resource, scope) = record  # fmt: skip
    tracer.resource, tracer.scope = tables[resource], tables.get(scope)
    trace_id = (hi << 64) | lo
    parent = SpanContext(trace_id, parent_id, is_remote=remote) if parent_id else None
    trace_state = TraceState.from_header([state]) if state else TraceState()
    span = RecordedSpan(
        tracer, name, SpanKind(kind), trace_id, span_id, parent, True, trace_state,
        attributes, start,
    )  # fmt: skip
    span._end_time = end
    if shared:
        span._constants = tables[shared]
    if phases:
        span._phases = [tuple(p) for p in phases]
    if code or description:
        span._status = Status(StatusCode(code), description or None)
    if events:
        span._events = [Event(n, a, t) for n, t, a in events]
    return span


if __name__ == "__main__":
    main()
