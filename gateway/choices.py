"""A response of several choices: OpenAI's ``n``, and a batch of prompts on
``/v1/completions`` (``n`` choices for each), each choice generated as a request of its own.

Each choice is published and streamed like any request (its own worker slot, resume and
redelivery; a seeded request's choice ``i`` of a prompt draws with ``seed + i``, as in
vLLM), and a worker's prefix cache shares their prompt's blocks. Choice ``p * n + i`` is
choice ``i`` of prompt ``p``, as OpenAI and vLLM number them. All are admitted at once, in
one group (the one the longest prompt needs): a group without room for them all answers
429 (or 503) with nothing started, where choices admitted one by one would have run and
been thrown away, or landed in different groups under a half-open breaker. The response
is accounted for once (its status, E2E, TTFT, one fallback, the server span's usage); any
choice failing fails the response and stops the others, as vLLM answers. Streamed, each
choice's chunks carry its ``index`` (its first chat chunk its role), interleaved as they
come.

This is the other half of :class:`gateway.generate.Generator`: it drives that class's
admission, take-off, publish, delivery and landing steps for every choice.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from common.errors import DeadlineExceededError, InternalError, InvalidRequestError, QosError
from common.logging import bind_request
from common.protocol import Usage
from gateway import tracing as traced
from gateway.admission import Route
from gateway.auth import KeyGrant
from gateway.classifier import Classification
from gateway.generate import (
    DISCONNECT_POLL_S,
    INLINE_LOGPROB_ENTRIES,
    SSE_HEADERS,
    ClientGone,
    Event,
    Flight,
    Generator,
    json_bytes,
    logprob_entries,
    shaped,
    sse_events,
)
from gateway.openai_api import ChatCompletionRequest, CompletionRequest
from gateway.responses import Echo, Kind, Shaper, merge, usage_dict
from gateway.streams import WRITE_STALL_S, ClientClosedRequest, Delivery, SseResponse

log = logging.getLogger(__name__)


class ChoiceRun:
    """The choices of one request in flight: ``n`` for each of its prompts."""

    def __init__(
        self,
        gen: Generator,
        kind: Kind,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        classified: Classification,
        prompts: list[list[int]],
        echoes: list[Echo | None],
        logprobs: int | None,
        started: float,
        deadline_ms: int,
    ) -> None:
        self.gen, self.kind, self.request, self.body = gen, kind, request, body
        self.classified, self.prompts, self.logprobs = classified, prompts, logprobs
        self.echoes = echoes
        self.started, self.deadline_ms = started, deadline_ms
        self.ends_at = started + deadline_ms / 1000
        self.n = body.choices()  # for each prompt
        self.count = self.n * len(prompts)
        # Each prompt once, as OpenAI counts them, however many choices it has.
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.key = ""  # the API key's name (serve_choices sets it)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.response_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.flights: list[Flight | None] = [None] * self.count
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.trace: traced.Decided = None
        self.first_token_at: float | None = None
        self.landed = False
        self.disconnect_check_at = time.monotonic() + DISCONNECT_POLL_S

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    # -- each choice ----------------------------------------------------------------------

    async def admit_all(
        self, grant: KeyGrant, max_tokens: int | None
    ) -> tuple[Route, Classification]:
        """A slot for every choice, all in one group, or none (429/503/504)."""
        limit = self.gen._config.groups[self.classified.group].max_pending
        if self.count > limit:  # never servable: a 429 would invite retries for ever
            asked = f"n={self.n} choices" if len(self.prompts) == 1 else (
                f"{len(self.prompts)} prompts x n={self.n} choices"
            )  # fmt: skip
            raise InvalidRequestError(
                f"{asked} exceed instance group {self.classified.group!r}'s limit of "
                f"{limit} pending requests",
                param="n" if len(self.prompts) == 1 else "prompt",
            )
        longest = max(len(ids) for ids in self.prompts)
        return await self.gen.admit(
            self.classified, longest, self.body, max_tokens, grant, self.ends_at, self.count
        )

    def start(self, route: Route, classified: Classification, salt: str, priority: int) -> None:
        gen = self.gen
        if gen._tracer is not None:
            self.trace = traced.admitted(
                gen._tracer, self.request.scope, kind=self.kind, model=gen._model,
                group=route.group, request_id=self.response_id, body=self.body,
                max_tokens=0 if self.body.scores_only() else classified.max_tokens,
                prompt_tokens=self.prompt_tokens,
            )  # fmt: skip
        for k in range(self.count):
            try:
                flight = gen._take_off(
                    self.kind, self.body, route, self.prompt_of(k), self.logprobs, self.started,
                    self.deadline_ms, choice=(k, self.response_id, self.created),
                    echo=self.echoes[k // self.n],
                )  # fmt: skip
            except BaseException:
                # Nothing else holds the slots of those not taken off yet.
                gen._admission.release(route, self.count - k)
                raise
            flight.trace = self.trace
            flight.key = self.key
            self.flights[k] = flight  # from here, landing the run lands it
            run = self._run(k, flight, classified.max_tokens, salt, priority)
            self.tasks.append(asyncio.create_task(run, name=f"{self.response_id}-choice-{k}"))
        # The workers log each choice under its own request id: this ties them to the
        # response's id, the one the client got.
        ids = [f.stream.request_id for f in self.flights if f is not None]
        log.info("%d choices in group %s, as requests %s", self.count, route.group, " ".join(ids))

    async def _run(self, i: int, flight: Flight, max_tokens: int, salt: str, priority: int) -> None:
        """Publish and stream choice ``i`` into :attr:`events`, its end or error too."""
        gen = self.gen
        try:
            await gen._publish(
                flight, self.body, self.prompt_of(i), max_tokens, self.request, salt, priority,
            )  # fmt: skip
            while True:
                delivery = await gen._next(flight, None)
                if flight.first_token_at is not None and self.first_token_at is None:
                    self.first_token_at = flight.first_token_at
                    series = gen._metrics.series(flight.route.group, gen._model)
                    series.ttft.observe((self.first_token_at or time.monotonic()) - self.started)
                self.events.put_nowait((i, delivery))
                if delivery.error is not None or delivery.finish_reason is not None:
                    return
        except QosError as exc:
            self.events.put_nowait((i, Delivery(error=exc)))
        except Exception:
            log.exception("choice %d of %s failed", i, self.response_id)
            error = InternalError("a choice of this request failed in the gateway")
            self.events.put_nowait((i, Delivery(error=error)))

    def hang_up(self) -> None:
        """The client left: wake every choice's reader (and so the response's)."""
        self.events.put_nowait((0, Delivery(error=ClientClosedRequest("the client left"))))

    async def next_event(self, poll_disconnect: bool) -> Event:
        """The next delivery of any choice; :class:`ClientGone` when ``poll_disconnect``
        finds the client gone (a whole response has no other way to notice)."""
        while True:
            now = time.monotonic()
            if poll_disconnect and now >= self.disconnect_check_at:
                # Also while events keep coming (n choices rarely fall silent together).
                self.disconnect_check_at = now + DISCONNECT_POLL_S
                if await self.request.is_disconnected():
                    raise ClientGone
            try:
                # Not wait_for: on Python 3.11 it can return a result and swallow a cancel
                # that came with it (the handler then ran on after its client left).
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    return await self.events.get()
            except TimeoutError:
                if time.monotonic() >= self.ends_at + WRITE_STALL_S:
                    # Every choice ends itself at the deadline; this is a backstop.
                    raise DeadlineExceededError(
                        "the request's deadline passed before it finished"
                    ) from None
                if poll_disconnect and await self.request.is_disconnected():
                    raise ClientGone from None

    # -- the end --------------------------------------------------------------------------

    def land(self, status: int, finish_reason: str | None = None) -> None:
        """End every choice (aborting those still running) and account for the response,
        once."""
        if self.landed:
            return
        self.landed = True
        for task in self.tasks:
            task.cancel()
        flights = [f for f in self.flights if f is not None]
        for flight in flights:
            self.gen._land(flight, status=status)
        if not flights:  # refused at admission: counted as a request refused there is
            self.gen._metrics.finished(self.classified.group, status)
            return
        group = flights[0].route.group
        completion = sum(f.completion_tokens for f in flights)
        if self.trace is not None:
            traced.landed(
                self.trace, status=status, prompt_tokens=self.prompt_tokens,
                completion_tokens=completion, finish_reason=finish_reason,
            )  # fmt: skip
        self.gen.account(
            group, status, self.started, self.first_token_at,
            key=self.key, tokens=(self.prompt_tokens, completion),
        )  # fmt: skip

    def usage(self) -> dict[str, object]:
        """The response's usage: each prompt once (as OpenAI counts it), every choice's
        output; cached tokens as each prompt's first reporting choice's worker saw them."""
        cached: Usage | None = None
        for p in range(len(self.prompts)):
            flights = self.flights[p * self.n : (p + 1) * self.n]
            worker = next((f.worker_usage for f in flights if f and f.worker_usage), None)
            if worker is not None:
                cached = cached or Usage()
                cached.cached_tokens += worker.cached_tokens
        completion = sum(f.completion_tokens for f in self.flights if f is not None)
        return usage_dict(self.prompt_tokens, completion, cached)

    async def next_streamed(self) -> Event:
        """:meth:`next_event` for a streamed response (its own task notices the client)."""
        return await self.next_event(poll_disconnect=False)

    def shaper(self, i: int) -> Shaper:
        flight = self.flights[i]
        assert flight is not None  # it delivered
        return flight.shaper

    def headers(self, i: int = 0) -> dict[str, str]:
        """Choice ``i``'s headers (the response's id, group, fallback), once it took off."""
        flight = self.flights[i]
        return dict(flight.headers) if flight is not None else {"X-Request-Id": self.response_id}

    def failed(self, error: QosError) -> QosError:
        """``error`` as the answer (a copy naming this response's id), all landed."""
        self.land(error.http_status)
        gen = self.gen
        if gen._tracer is not None:
            traced.rejected(
                gen._tracer, self.request.scope, kind=self.kind, model=gen._model,
                group=self.flights[0].route.group if self.flights[0] else self.classified.group,
                error=error.code,
            )  # fmt: skip
        answer = copy.copy(error)
        answer.request_headers = self.headers()
        return answer


async def serve_choices(
    gen: Generator,
    kind: Kind,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    classified: Classification,
    prompts: list[list[int]],
    echoes: list[Echo | None],
    logprobs: int | None,
    priority: int,
    grant: KeyGrant,
    started: float,
    deadline_ms: int,
    max_tokens: int | None,
    salt: str,
) -> Response:
    """Answer a request of more than one choice (see the module docstring)."""
    run = ChoiceRun(gen, kind, request, body, classified, prompts, echoes, logprobs, started,
                    deadline_ms)  # fmt: skip
    run.key = grant.name
    bind_request(run.response_id)
    streaming = False
    try:
        run.start(*await run.admit_all(grant, max_tokens), salt, priority)
        first = await run.next_event(poll_disconnect=True)
        if first[1].error is not None:
            raise first[1].error
        if not body.stream:
            return await _whole(run, first)
        response = SseResponse(
            sse_events(first, run.next_streamed, run.shaper, run.count, run.usage, run.land),
            headers={**run.headers(first[0]), **SSE_HEADERS},
            on_disconnect=run.hang_up,
            on_close=run.land,
            deadline=run.ends_at + WRITE_STALL_S,
        )
        streaming = True  # the response lands the run from here on
        return response
    except ClientGone:
        run.land(499)
        return Response(status_code=499, headers=run.headers())
    except QosError as exc:
        raise run.failed(exc) from None
    finally:
        if not streaming:
            run.land(500)  # a no-op unless something unexpected broke


async def _whole(run: ChoiceRun, first: Event) -> Response:
    """Every choice whole, in one body."""
    deliveries: list[list[Delivery]] = [[] for _ in range(run.count)]
    event, done = first, 0
    while True:
        i, delivery = event
        if delivery.error is not None:
            raise delivery.error
        deliveries[i].append(delivery)
        if delivery.finish_reason is not None:
            done += 1
            if done == run.count:
                break
        event = await run.next_event(poll_disconnect=True)
    usage = run.usage()
    choices = []
    reasons = []
    entries = 0
    for i, parts in enumerate(deliveries):
        flight = run.flights[i]
        assert flight is not None  # it delivered
        whole = merge(parts)
        reasons.append(whole.finish_reason)
        mine = logprob_entries(flight.shaper, len(whole.token_ids))
        body = await shaped(flight.shaper, whole, usage, mine > INLINE_LOGPROB_ENTRIES)
        entries += mine
        choices.extend(body["choices"])
    answer = {**body, "choices": choices, "usage": usage}
    run.land(200, reasons[0])
    content = await json_bytes(answer, entries > INLINE_LOGPROB_ENTRIES)
    return Response(content, media_type="application/json", headers=run.headers(0))
