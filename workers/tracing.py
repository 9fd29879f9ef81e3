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
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import Span, SpanKind, Tracer

from common import tracing as t
from common.protocol import Chunk, GenerateRequest
from common.span_recorder import Constants
from common.trace_context import Unsampled, from_headers


def operation(request_id: str) -> str:
    """``gen_ai.operation.name`` from the gateway's id prefix (``chatcmpl-`` → chat)."""
    return "chat" if request_id.startswith("chatcmpl-") else "text_completion"


class RequestSpans:
    """Starts and ends the spans of deliveries; one per worker, stateless."""

    def __init__(self, tracer: Tracer, worker_id: str, model: str) -> None:
        self.tracer = tracer
        self.worker_id = worker_id
        self.model = model
        self._shared: dict[tuple[str, str, str, str], Constants] = {}

    def _constants(self, op: str, model: str, group: str, subject: str) -> Constants:
        """What every delivery of (operation, model, group, subject) here has in common."""
        key = (op, model, group, subject)
        found = self._shared.get(key)
        if found is None:
            if len(self._shared) >= 256:  # models and subjects come from messages: bounded
                self._shared.clear()
            found = self._shared[key] = t.constants(self.tracer, (
                (t.OPERATION, op), (t.REQUEST_MODEL, model), (t.GROUP, group),
                (t.WORKER, self.worker_id), ("messaging.system", "nats"),
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
    ) -> Span | None:
        """The CONSUMER span of this delivery, started at ``fetched_at`` (``time.time()``);
        None when it is sampled out."""
        op = operation(req.id)
        model = req.model or self.model
        span = t.start_remote(
            self.tracer, f"{op} {model}", from_headers(headers), SpanKind.CONSUMER,
            t.ns(fetched_at),
        )  # fmt: skip
        if isinstance(span, Unsampled):
            return None
        params = req.params
        attributes: dict[str, Any] = {
            t.MAX_TOKENS: params.max_tokens,
            t.TEMPERATURE: params.temperature,
            t.TOP_P: params.top_p,
            t.RESPONSE_ID: req.id,
            t.ATTEMPT: attempt,
        }
        if req.created_ms > 0:  # how long JetStream held it (clocks of two hosts: roughly)
            attributes["qos.jetstream_wait_s"] = max(0.0, fetched_at - req.created_ms / 1000)
        span.set_attributes(attributes)
        t.set_constants(span, self._constants(op, model, group, subject))
        return span

    def finish(
        self,
        span: Span,
        chunk: Chunk,
        *,
        output: Any,
        fetched_at: float,
        stream: tuple[float, float] | None,
        resumed_tokens: int,
    ) -> None:
        """End ``span`` with the final ``chunk``: usage, finish reason, the engine's phases
        (from ``output.metrics``) and the ``stream`` interval (first, last chunk out)."""
        if not span.is_recording():  # sampled out: nothing to describe
            span.end()
            return
        attributes: dict[str, Any] = {t.FINISH_REASONS: t.finish_reasons(chunk.finish_reason)}
        if chunk.usage is not None:
            attributes[t.INPUT_TOKENS] = chunk.usage.prompt_tokens
            attributes[t.OUTPUT_TOKENS] = chunk.usage.completion_tokens
            attributes["qos.cached_tokens"] = chunk.usage.cached_tokens
        if resumed_tokens:
            attributes["qos.resumed_tokens"] = resumed_tokens
        if output is not None and output.metrics.num_preemptions:
            attributes["qos.preemptions"] = output.metrics.num_preemptions
        span.set_attributes(attributes)
        if chunk.error is not None:
            t.set_error(span, chunk.error.code, chunk.error.message)
        phases = _phases(output.metrics, fetched_at) if output is not None else []
        if stream is not None:
            phases.append(("stream", *stream))
        for name, start, end in phases:
            t.add_phase(self.tracer, span, name, start, max(start, end))
        span.end()

    @staticmethod
    def abandon(span: Span, outcome: str) -> None:
        """End a delivery this replica did not answer (handed back, dropped): say why."""
        span.set_attribute("qos.outcome", outcome)
        span.add_event(outcome)
        span.end()


def _phases(metrics: Any, fetched_at: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of the engine's phases that happened, in ``time.time()`` seconds."""
    scheduled = metrics.first_scheduled_time
    first = metrics.first_token_time
    done = metrics.finish_time
    phases: list[tuple[str, float, float]] = []
    if scheduled is None:
        return phases
    phases.append(("queue", fetched_at, max(fetched_at, scheduled)))
    # An engine that times its KV-tier loads reports them here; the sim and today's
    # engine do not, and then there is no span rather than a made-up one.
    kv_load_s = getattr(metrics, "kv_load_s", None)
    if kv_load_s:
        phases.append(("kv load", scheduled, scheduled + kv_load_s))
    if first is not None:
        phases.append(("prefill", scheduled, first))
        if done is not None:
            phases.append(("decode", first, done))
    return phases
