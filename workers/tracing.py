"""A worker's spans for one delivery of one request (see :mod:`common.tracing` for the tree).

The request span starts when the message is fetched, as a child of the gateway's publish
span (W3C ``traceparent`` in the NATS headers), and ends when the final chunk is out, or
when the message is handed back (``nak``): a redelivered request shows one span per
attempt, each with ``qos.attempt``. A request the gateway sampled out (flag 00) gets
nothing here, not even its attributes built: the worker follows the gateway's decision
(parent-based sampling), so a trace is whole or absent. The engine is never traced from
inside: its phases (queue, KV load, prefill, decode) are recorded afterwards, on the event
loop, with the start and end times the engine already keeps in the request's metrics, as
phases of the request span (:meth:`common.span_recorder.RecordedSpan.add_phase`: tuples,
exported with it). The attributes every delivery of a group shares (operation, model,
group, worker, subject) are one :class:`~common.span_recorder.Constants`, built once.

With our tracer and batch (the services' setup), nothing span-shaped is built on the event
loop for an answered delivery (one handed back or dropped, :meth:`RequestSpans.abandon`,
is rare and built at once): :meth:`RequestSpans.start` takes the sampling decision and keeps the delivery's
plain values (:class:`Delivery`), :meth:`RequestSpans.finish` adds the final ones and queues
a :class:`DeferredSpan`, and the export thread builds the span from them in its batch loop.
Live, each small step on the request path costs several times what it costs in a hot loop
(measured: +31 µs at fetch and +13 µs at the answer for the spans built there, against
+10 µs for both in ``bench.tracing_hooks``' hot loop), so the work moves to where it runs
hot. Any other
tracer or processor gets the span built at once, as before.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from opentelemetry.trace import Span, SpanKind, Tracer

from common import tracing as t
from common.protocol import Chunk, GenerateRequest, RequestParams
from common.span_batch import Deferred
from common.span_recorder import Constants, RecordedSpan
from common.span_recorder import Tracer as OurTracer
from common.trace_context import EMPTY_STATE, RemoteParent, Unsampled, from_headers


def operation(request_id: str) -> str:
    """``gen_ai.operation.name`` from the gateway's id prefix (``chatcmpl-`` → chat)."""
    return "chat" if request_id.startswith("chatcmpl-") else "text_completion"


class Delivery:
    """A sampled delivery as plain values: the request path's whole share of its span (ids
    drawn now, so log lines can name them; the span is built from these when it ends). It
    keeps the request's id, model and parameters, not the request: a prompt held until the
    export would be memory for nothing."""

    __slots__ = ("attempt", "created_ms", "fetched_at", "group", "model", "params", "parent",
                 "request_id", "span_id", "subject", "trace_id")  # fmt: skip

    def __init__(
        self,
        req: GenerateRequest,
        parent: RemoteParent | None,
        trace_id: int,
        span_id: int,
        *,
        group: str,
        attempt: int,
        subject: str,
        fetched_at: float,
    ) -> None:
        self.request_id = req.id
        self.model = req.model
        self.params: RequestParams = req.params
        self.created_ms = req.created_ms
        self.parent = parent
        self.trace_id = trace_id
        self.span_id = span_id
        self.group = group
        self.attempt = attempt
        self.subject = subject
        self.fetched_at = fetched_at


class DeferredSpan(Deferred):
    """A finished delivery waiting in the span batch, whose export thread calls
    :meth:`build`; ``_phases`` is what the batch reads to count the spans it stands for."""

    __slots__ = ("_phases", "delivery", "end_ns", "error", "finish_reason", "owner",
                 "preemptions", "resumed_tokens", "usage")  # fmt: skip

    def __init__(
        self,
        owner: RequestSpans,
        delivery: Delivery,
        chunk: Chunk,
        preemptions: int,
        resumed_tokens: int,
        phases: list[tuple[str, float, float]],
    ) -> None:
        self.owner, self.delivery, self._phases = owner, delivery, phases
        self.finish_reason, self.usage, self.error = chunk.finish_reason, chunk.usage, chunk.error
        self.preemptions, self.resumed_tokens = preemptions, resumed_tokens
        self.end_ns = time.time_ns()

    def build(self) -> RecordedSpan:
        """The delivery's span with its final facts and phases, ended without the
        processors (the export thread's work, or :meth:`common.span_recorder.Tracer.finish`
        's for any other processor)."""
        span = self.owner.span_of(self.delivery)
        self.owner.describe(span, self.finish_reason, self.usage, self.error,
                            self.preemptions, self.resumed_tokens)  # fmt: skip
        span._phases = self._phases or None
        span.close(self.end_ns)
        return span


class RequestSpans:
    """Starts and ends the spans of deliveries; one per worker, stateless."""

    def __init__(self, tracer: Tracer, worker_id: str, model: str) -> None:
        self.tracer = tracer
        self.worker_id = worker_id
        self.model = model
        self._shared: dict[tuple[str, str, str, str], Constants] = {}
        # Plain values on the request path where our tracer decides by a plain function;
        # the span built by the export thread where our batch is its only processor.
        self._ours = tracer if isinstance(tracer, OurTracer) and tracer.decide else None

    def _constants(self, op: str, model: str, group: str, subject: str) -> Constants:
        """What every delivery of (operation, model, group, subject) here has in common."""
        key = (op, model, group, subject)
        found = self._shared.get(key)
        if found is None:
            if len(self._shared) >= 256:  # models and subjects come from messages: bounded
                self._shared.clear()
            found = self._shared[key] = t.constants(self.tracer, (
                (t.OPERATION, op), (t.PROVIDER, t.PROVIDER_NAME), (t.REQUEST_MODEL, model),
                (t.GROUP, group), (t.WORKER, self.worker_id), ("messaging.system", "nats"),
                ("messaging.operation.type", "process"), ("messaging.destination.name", subject),
            ))  # fmt: skip
        return found

    def start(
        self,
        req: GenerateRequest,
        headers: dict[str, str] | None,
        *,
        group: str,
        attempt: int,
        subject: str,
        fetched_at: float,
    ) -> Span | Delivery | None:
        """This delivery, fetched at ``fetched_at`` (``time.time()``): with our tracer its
        plain values (:class:`Delivery`), else its CONSUMER span; None when sampled out."""
        parent = from_headers(headers)
        ours = self._ours
        if ours is not None:
            trace_id = ours.sampled_trace(parent, root=root_trace_id(req.id))
            if isinstance(trace_id, Unsampled):
                return None
            span_id = ours.id_generator.generate_span_id()
            return Delivery(req, parent, trace_id, span_id, group=group, attempt=attempt,
                            subject=subject, fetched_at=fetched_at)  # fmt: skip
        op = operation(req.id)
        model = req.model or self.model
        span = t.start_remote(self.tracer, f"{op} {model}", parent, SpanKind.CONSUMER,
                              t.ns(fetched_at))  # fmt: skip
        if isinstance(span, Unsampled):
            return None
        span.set_attributes(
            _start_attributes(req.id, req.params, req.created_ms, attempt, fetched_at)
        )
        t.set_constants(span, self._constants(op, model, group, subject))
        return span

    def span_of(self, delivery: Delivery) -> RecordedSpan:
        """The CONSUMER span ``delivery`` stands for, started at its fetch (not ended)."""
        assert self._ours is not None
        op = operation(delivery.request_id)
        model = delivery.model or self.model
        parent = delivery.parent
        attributes = _start_attributes(delivery.request_id, delivery.params,
                                       delivery.created_ms, delivery.attempt,
                                       delivery.fetched_at)  # fmt: skip
        span = RecordedSpan(
            self._ours, f"{op} {model}", SpanKind.CONSUMER, delivery.trace_id,
            delivery.span_id, parent, True,
            parent.trace_state() if parent is not None else EMPTY_STATE,
            attributes, t.ns(delivery.fetched_at),
        )  # fmt: skip
        span.set_constants(self._constants(op, model, delivery.group, delivery.subject))
        return span

    def finish(
        self,
        span: Span | Delivery,
        chunk: Chunk,
        *,
        output: Any,
        fetched_at: float,
        stream: tuple[float, float] | None,
        resumed_tokens: int,
    ) -> None:
        """End ``span`` with the final ``chunk``: usage, finish reason, the engine's phases
        (from ``output.metrics``) and the ``stream`` interval (first, last chunk out)."""
        phases = _phases(output.metrics, fetched_at) if output is not None else []
        if stream is not None:
            phases.append(("stream", *stream))
        phases = [(name, start, max(start, end)) for name, start, end in phases]
        preemptions = output.metrics.num_preemptions if output is not None else 0
        if isinstance(span, Delivery):
            assert self._ours is not None
            self._ours.finish(DeferredSpan(self, span, chunk, preemptions, resumed_tokens, phases))
            return
        if not span.is_recording():  # sampled out: nothing to describe
            span.end()
            return
        self.describe(span, chunk.finish_reason, chunk.usage, chunk.error, preemptions,
                      resumed_tokens)  # fmt: skip
        for name, start, end in phases:
            t.add_phase(self.tracer, span, name, start, end)
        span.end()

    @staticmethod
    def describe(
        span: Span,
        finish_reason: str | None,
        usage: Any,
        error: Any,
        preemptions: int,
        resumed_tokens: int,
    ) -> None:
        """The final chunk's facts on ``span``: finish reason, usage, resumed tokens,
        preemptions, and the error if there was one."""
        attributes: dict[str, Any] = {t.FINISH_REASONS: t.finish_reasons(finish_reason)}
        if usage is not None:
            attributes[t.INPUT_TOKENS] = usage.prompt_tokens
            attributes[t.OUTPUT_TOKENS] = usage.completion_tokens
            attributes["qos.cached_tokens"] = usage.cached_tokens
        if resumed_tokens:
            attributes["qos.resumed_tokens"] = resumed_tokens
        if preemptions:
            attributes["qos.preemptions"] = preemptions
        span.set_attributes(attributes)
        if error is not None:
            t.set_error(span, error.code, error.message)

    def abandon(self, span: Span | Delivery, outcome: str) -> None:
        """End a delivery this replica did not answer (handed back, dropped): say why."""
        if isinstance(span, Delivery):
            span = self.span_of(span)
        span.set_attribute("qos.outcome", outcome)
        span.add_event(outcome)
        span.end()


def root_trace_id(request_id: str) -> int:
    """The trace of a request that came with none (a NATS caller without ``traceparent``,
    a gateway with tracing off): derived from its id, so every delivery of it, on any
    worker, lands in one trace (a random one each made a redelivery's attempts two traces,
    sampled apart). A hash: as uniform as the ratio sampler needs."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


def _start_attributes(
    request_id: str, params: RequestParams, created_ms: int, attempt: int, fetched_at: float
) -> dict[str, Any]:
    """What a delivery's span says from the start: the request's parameters and attempt."""
    attributes: dict[str, Any] = {
        t.MAX_TOKENS: params.max_tokens,
        t.TEMPERATURE: params.temperature,
        t.TOP_P: params.top_p,
        t.RESPONSE_ID: request_id,
        t.ATTEMPT: attempt,
    }
    if created_ms > 0:  # how long JetStream held it (clocks of two hosts: roughly)
        attributes["qos.jetstream_wait_s"] = max(0.0, fetched_at - created_ms / 1000)
    return attributes


def _phases(metrics: Any, fetched_at: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of the engine's phases that happened, in ``time.time()`` seconds."""
    scheduled = metrics.first_scheduled_time
    first = metrics.first_token_time
    done = metrics.finish_time
    phases: list[tuple[str, float, float]] = []
    if scheduled is None:
        return phases
    # Reading KV-tier blocks (host memory, Redis) at admission; none without a tier hit
    # (and from the sim), rather than a made-up span. The queue ends where it begins: the
    # request is scheduled once its blocks are in (the queue held the load, overlapping it).
    kv_start = getattr(metrics, "kv_load_start", None)
    queued_until = scheduled if kv_start is None else min(kv_start, scheduled)
    phases.append(("queue", fetched_at, max(fetched_at, queued_until)))
    if kv_start is not None:
        phases.append(("kv load", kv_start, kv_start + metrics.kv_load_s))
    if first is not None:
        phases.append(("prefill", scheduled, first))
        if done is not None:
            phases.append(("decode", first, done))
    return phases
