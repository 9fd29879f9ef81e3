"""Spans recorded as plain data: the lightweight tracer behind :func:`common.tracing.tracer_for`.

A :class:`RecordedSpan` is its own ``ReadableSpan`` and goes to the provider's processors as
it is when it ends: no lock, copy or attribute cleaning on the request path (one built
from plain values by the batch thread, :class:`common.span_batch.Deferred`, is exported
by that thread itself). The SDK's exporters (OTLP batch, in-memory) take it like one of
the SDK's own spans.

Two shapes keep a traced request's cost on the event loop small (issue #7):
:class:`Constants`, the attributes many spans share (model, group, worker, subject), built
once and encoded once by the exporter; and *phases*, children with only a name and two
times (a worker's queue, prefill, decode, stream), kept on their parent as tuples
(:meth:`RecordedSpan.add_phase`) and made into spans only for an exporter or processor
that wants spans (our OTLP encoder writes them from the tuples).

Sampling is decided once per request, where it enters a service (:meth:`Tracer.sampled_trace`,
or :meth:`Tracer.start_remote` where the span is built at once):
the SDK's built-in samplers are read once into a plain function of the trace id and the
caller's sampled flag, so a request sampled out costs a random number and a comparison,
and no span, attribute or ``Context`` object is built for it.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.util._decorator import _agnosticcontextmanager

from common.span_batch import Deferred, SpanBatch
from common.trace_context import RemoteParent, Unsampled

_SAMPLED, _NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
_EMPTY_STATE = TraceState()
_INTERNAL = SpanKind.INTERNAL

_UNSET = Status(StatusCode.UNSET)


class _Resource(Resource):
    """A Resource that hashes once: the OTLP encoder hashes it for every span it exports
    (a JSON dump of the attributes each time, ~15 % of the encoding)."""

    _hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = super().__hash__()
        return self._hash


class Constants:
    """Attributes shared by many spans, built once: a span given them (:meth:`RecordedSpan.
    set_constants`) holds a reference, not a copy, and the OTLP encoder writes their bytes
    once and reuses them (``encoded``, set by the encoder). None values are left out, as
    the SDK leaves them out of a span."""

    __slots__ = ("encoded", "items", "keys")

    def __init__(self, items: Mapping[str, Any]) -> None:
        self.items: Mapping[str, Any] = MappingProxyType(
            {k: v for k, v in items.items() if v is not None}
        )
        self.keys = frozenset(self.items)
        self.encoded: bytes | None = None  # the KeyValue fields of a Span, once encoded

    def __repr__(self) -> str:
        return f"Constants({dict(self.items)!r})"


# A phase kept on its parent: (name, start s, end s), ``time.time()`` seconds.
Phase = tuple[str, float, float]


class RecordedSpan(Span, ReadableSpan):
    """A span as plain data, handed to the processors as it is when it ends (it is its own
    ``ReadableSpan``, as the SDK's span is, with no lock, copy or attribute cleaning).

    Its attributes are ``_constants`` (shared, or None) overlaid by ``_vars`` (its own);
    ``_attributes``, what the SDK's ``ReadableSpan`` reads, is the two merged.

    Not thread-safe, unlike the SDK's: a request's spans live on one event loop.
    """

    trace_id: int
    span_id: int
    # Defaults most spans keep, read from the class: fewer stores per span started.
    _constants: Constants | None = None
    _phases: list[Phase] | None = None
    _phase_ids: list[int] | None = None
    _end_time: int | None = None
    _status = _UNSET
    _events: Sequence[Event] = ()
    _links: Sequence[Link] = ()
    _instrumentation_info = None
    _built_context: SpanContext | None = None  # built when asked (logs, export)

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        kind: SpanKind,
        trace_id: int,
        span_id: int,
        parent: SpanContext | RecordedSpan | RemoteParent | None,
        recording: bool,
        trace_state: TraceState,
        attributes: dict[str, Any],
        start_time: int,
    ) -> None:
        # ReadableSpan's fields, by its names (its properties read them).
        self._name = name
        self._kind = kind
        # The parent as given; its SpanContext is built only when asked (the encoder reads
        # the two plain fields).
        self._parent_of = parent
        if parent is None:
            self._parent_id, self._parent_remote = 0, False
        elif isinstance(parent, RecordedSpan):
            self._parent_id, self._parent_remote = parent.span_id, False
        else:
            self._parent_id, self._parent_remote = parent.span_id, parent.is_remote
        self._vars = attributes
        self._start_time = start_time
        self._resource = tracer.resource
        self._instrumentation_scope = tracer.scope
        self.tracer = tracer
        self.trace_id = trace_id
        self.span_id = span_id
        self.recording = recording
        self.trace_state = trace_state

    @property
    def _parent(self) -> SpanContext | None:  # type: ignore[override]
        """The parent's ``SpanContext`` (the SDK's ``ReadableSpan.parent`` reads this name)."""
        parent = self._parent_of
        if isinstance(parent, RecordedSpan):
            parent = self._parent_of = parent.get_span_context()
        elif isinstance(parent, RemoteParent):
            parent = self._parent_of = parent.span_context()
        return parent

    @property
    def _attributes(self) -> dict[str, Any]:  # type: ignore[override]
        """All the attributes (the SDK's ``ReadableSpan`` reads this name)."""
        if self._constants is None:
            return self._vars
        return {**self._constants.items, **self._vars}

    def set_constants(self, constants: Constants) -> None:
        """Share ``constants`` (they replace any same-named attribute set before)."""
        if not self.recording:
            return
        old = self._constants
        if old is not None and not old.keys <= constants.keys:  # keep what is not replaced
            self._vars = {**old.items, **self._vars}
        if not constants.keys.isdisjoint(self._vars):
            self._vars = {k: v for k, v in self._vars.items() if k not in constants.keys}
        self._constants = constants

    def add_phase(self, name: str, start_s: float, end_s: float) -> None:
        """A finished INTERNAL child with no attributes, ``time.time()`` seconds: kept here
        as a tuple and exported with this span (it must end after its phases)."""
        if self.recording:
            if self._phases is None:
                self._phases = [(name, start_s, end_s)]
            else:
                self._phases.append((name, start_s, end_s))

    def phase_ids(self) -> list[int]:
        """The phases' span ids, drawn when first asked, after the span ended (by the export
        thread, off the request path; nothing refers to a phase before)."""
        phases = self._phases or ()
        ids = self._phase_ids
        if ids is None or len(ids) != len(phases):
            generate = self.tracer.id_generator.generate_span_id
            ids = self._phase_ids = [generate() for _ in phases]
        return ids

    def phase_spans(self) -> list[RecordedSpan]:
        """This span's phases as spans of their own, for processors that want spans."""
        if not self._phases:
            return []
        out = []
        for span_id, (name, start_s, end_s) in zip(self.phase_ids(), self._phases, strict=True):
            span = RecordedSpan(
                self.tracer, name, _INTERNAL, self.trace_id, span_id, self, True,
                self.trace_state, {}, int(start_s * 1e9),
            )  # fmt: skip
            span._end_time = int(end_s * 1e9)
            out.append(span)
        return out

    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.recording else '00'}"

    def get_span_context(self) -> SpanContext:
        if self._built_context is None:
            self._built_context = SpanContext(
                self.trace_id,
                self.span_id,
                is_remote=False,
                trace_flags=_SAMPLED if self.recording else _NOT_SAMPLED,
                trace_state=self.trace_state,
            )
        return self._built_context

    @property
    def _context(self) -> SpanContext:  # type: ignore[override]
        # What the SDK's ReadableSpan reads directly (to_json, the console exporter): a
        # span built on the export thread had none, and printed "context": null.
        return self.get_span_context()

    @property
    def context(self) -> SpanContext:
        return self.get_span_context()

    def is_recording(self) -> bool:
        return self.recording and self._end_time is None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.recording:
            if self._constants is not None and not self._constants.keys.isdisjoint(attributes):
                self._fold_constants()
            self._vars.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.recording:
            if self._constants is not None and key in self._constants.keys:
                self._fold_constants()
            self._vars[key] = value

    def _fold_constants(self) -> None:
        """A shared attribute is overwritten: this span keeps its own copy from now on."""
        assert self._constants is not None
        self._vars = {**self._constants.items, **self._vars}
        self._constants = None

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
        if self.recording:
            self._events = (*self._events, exception_event(exception, attributes, timestamp,
                                                           escaped))  # fmt: skip

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self.close(end_time or time.time_ns())
        if self.recording:
            self.tracer.on_end(self)

    def close(self, end_time: int) -> None:
        """End without handing the span to the processors: for a span the export thread
        built from plain values, which it exports itself."""
        self._end_time = end_time
        if self.recording and None in self._vars.values():  # the SDK drops None values
            self._vars = {k: v for k, v in self._vars.items() if v is not None}


def exception_event(
    exception: BaseException,
    attributes: Mapping[str, Any] | None = None,
    timestamp: int | None = None,
    escaped: bool = False,
) -> Event:
    """The ``exception`` event the SDK records for ``exception`` (semantic conventions)."""
    fields = {
        "exception.type": type(exception).__qualname__,
        "exception.message": str(exception),
        "exception.stacktrace": "".join(traceback.format_exception(exception)),
        "exception.escaped": str(escaped),
        **(attributes or {}),
    }
    return Event("exception", fields, timestamp or time.time_ns())


Decide = Callable[[int, "bool | None"], bool]


def decision_of(sampler: Sampler) -> Decide | None:
    """``sampler``'s decision as a plain function of (trace id, the remote parent's sampled
    flag or None without a parent), for the SDK's built-in samplers (always on/off, trace id
    ratio, parent-based over those); None for any other, which is then asked itself."""
    if isinstance(sampler, StaticSampler):
        on = sampler._decision is Decision.RECORD_AND_SAMPLE
        return lambda trace_id, parent: on
    if isinstance(sampler, TraceIdRatioBased):
        bound, limit = sampler.bound, sampler.TRACE_ID_LIMIT
        return lambda trace_id, parent: trace_id & limit < bound
    if isinstance(sampler, ParentBased):
        root = decision_of(sampler._root)
        yes = decision_of(sampler._remote_parent_sampled)
        no = decision_of(sampler._remote_parent_not_sampled)
        if root is None or yes is None or no is None:
            return None

        def parent_based(trace_id: int, parent: bool | None) -> bool:
            if parent is None:
                return root(trace_id, None)
            return (yes if parent else no)(trace_id, parent)

        return parent_based
    return None


class Tracer(trace.Tracer):
    """Starts :class:`RecordedSpan` s with the provider's sampler, ids, resource and
    processors. A span with a local parent follows its parent's sampling decision (as the
    default parent-based sampler would) without asking the sampler again; processors see
    ``on_end`` only: export processors (batch, simple) do nothing ``on_start``."""

    def __init__(self, provider: TracerProvider, name: str) -> None:
        self.sampler = provider.sampler
        self.decide = decision_of(self.sampler)
        self.id_generator = provider.id_generator
        self.processor = provider._active_span_processor  # what the SDK's own tracer gets
        processors = self.processor._span_processors
        # One batch of ours: a span goes straight onto its queue, its phases with it (no
        # processor loop, no SpanContext built to read a sampled flag every span has).
        self.batch = (
            processors[0] if len(processors) == 1 and isinstance(processors[0], SpanBatch) else None
        )
        self.on_end: Callable[[RecordedSpan], None] = (
            self.batch.add if self.batch is not None else self._to_processors
        )
        self.scope = InstrumentationScope(name)
        resource = provider.resource
        self.resource = _Resource(resource.attributes, resource.schema_url)
        self._constants: dict[tuple[tuple[str, Any], ...], Constants] = {}

    def constants(self, items: tuple[tuple[str, Any], ...]) -> Constants:
        """The :class:`Constants` of these (key, value) pairs, built once per distinct set
        (a few hundred kept: a set per model, group and subject, not per request)."""
        found = self._constants.get(items)
        if found is None:
            if len(self._constants) >= 256:
                self._constants.clear()
            found = self._constants[items] = Constants(dict(items))
        return found

    def finish(self, item: Deferred) -> None:
        """A span recorded as plain values has ended: our batch's export thread builds it;
        any other processor gets it built now."""
        if self.batch is not None:
            self.batch.add(item)
        else:
            span = item.build()
            assert isinstance(span, RecordedSpan)
            self._to_processors(span)

    def sampled_trace(
        self, parent: RemoteParent | None, root: int | None = None
    ) -> int | Unsampled:
        """The trace id of a request entering this service under ``parent`` when the
        sampler (a plain function: :attr:`decide` is set) records it, else what to tell the
        next hop. ``root``: the trace id to start without a parent (else a random one)."""
        assert self.decide is not None
        if parent is not None:
            trace_id = parent.trace_id
        else:
            trace_id = root if root else self.id_generator.generate_trace_id()
        if self.decide(trace_id, None if parent is None else parent.sampled):
            return trace_id
        return self._unsampled(trace_id, parent)

    def _unsampled(self, trace_id: int, parent: RemoteParent | None) -> Unsampled:
        """A request sampled out: the caller's span id passes on, or a fresh one."""
        if parent is not None:
            return Unsampled(trace_id, parent.span_id, parent.tracestate)
        return Unsampled(trace_id, self.id_generator.generate_span_id())

    def _to_processors(self, span: RecordedSpan) -> None:
        """Any other processors: the phases as spans, ended before their parent (which then
        carries none: an exporter must not see them twice)."""
        if span._phases:
            for phase in span.phase_spans():
                self.processor.on_end(phase)
            span._phases = None
        self.processor.on_end(span)

    def start_remote(
        self,
        name: str,
        parent: RemoteParent | None,
        kind: SpanKind,
        start_time: int | None = None,
    ) -> RecordedSpan | Unsampled:
        """The span of a request entering this service under ``parent`` (a caller's
        ``traceparent``, or None), if it is sampled; else what to tell the next hop.

        The sampler decides without the span's attributes (the built-in ones never read
        them), so the caller builds them only for a span that is recorded."""
        attrs: dict[str, Any] = {}
        if self.decide is not None:
            sampled = self.sampled_trace(parent)
            if isinstance(sampled, Unsampled):
                return sampled
            trace_id = sampled
            # The built-in samplers keep the parent's tracestate.
            state = parent.trace_state() if parent is not None else _EMPTY_STATE
        else:
            trace_id = (
                parent.trace_id if parent is not None else self.id_generator.generate_trace_id()
            )
            context = parent.context() if parent is not None else None
            result = self.sampler.should_sample(context, trace_id, name, kind)
            if result.decision is not Decision.RECORD_AND_SAMPLE:
                return self._unsampled(trace_id, parent)
            state = result.trace_state or _EMPTY_STATE
            if result.attributes:
                attrs.update(result.attributes)
        return RecordedSpan(
            self, name, kind, trace_id, self.id_generator.generate_span_id(), parent,
            True, state, attrs, start_time or time.time_ns(),
        )  # fmt: skip

    def start_child(
        self,
        parent: RecordedSpan,
        name: str,
        kind: SpanKind = _INTERNAL,
        attributes: dict[str, Any] | None = None,
        start_time: int | None = None,
    ) -> RecordedSpan:
        """A child of ``parent`` (its sampling decision; ``attributes`` taken, not copied),
        with no ``Context`` built to find the parent."""
        return RecordedSpan(
            self, name, kind, parent.trace_id, self.id_generator.generate_span_id(),
            parent, parent.recording, parent.trace_state,
            attributes if attributes is not None else {}, start_time or time.time_ns(),
        )  # fmt: skip

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
        parent: SpanContext | RecordedSpan | None
        if isinstance(parent_span, RecordedSpan):  # local parent: its decision, no sampler
            parent = parent_span
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
