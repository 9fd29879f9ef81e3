"""Per-request response streams: every output token exactly once, in order, across redeliveries.

One :class:`Dispatcher` owns two wildcard subscriptions for the whole gateway,
``<prefix>.out.*`` (chunks) and ``<prefix>.resume.*`` (resume queries), and routes each
message by the subject's last token to the request's :class:`ResponseStream`. One
subscription instead of one per request keeps SUB/UNSUB traffic and nats-py's per-
subscription task off the hot path.

Chunk rules (DESIGN §2, ``seq`` = index of the chunk's first token in the output):

- ``seq == delivered``: delivered as is.
- ``seq < delivered``: an overlap after a redelivery; the tokens already delivered are
  trimmed and only the rest goes out (nothing left and not final: dropped).
- ``seq > delivered``: a gap; the chunk waits in a small buffer until the gap fills.
- ``attempt`` below the latest resume query's attempt: a stale worker still talking after
  its request was redelivered; dropped, because the new attempt continues from exactly
  what the client has.

A resume query is answered with every token delivered so far and the length (in
characters) of the text delivered with them. A closed stream is forgotten, so a resume
query for it gets no answer and the worker drops the request.

A request that JetStream gave up on (``max_deliver`` deliveries, each ending in a worker's
death: a poison message) would otherwise wait for its deadline. The dispatcher listens
for the stream's ``MAX_DELIVERIES`` advisories and fails that request at once with an
explicit error, matched by the stream sequence its publish was acknowledged with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from common.errors import (
    InternalError,
    ProtocolError,
    QosError,
    RequestGivenUpError,
    ServiceUnavailableError,
)
from common.gap_watch import GapWatch
from common.idle_streams import IdleStreams
from common.logging import about
from common.nats import on_slow_consumer
from common.protocol import Chunk, Control, ResumeQuery, ResumeReply, TopLogprobs, Usage
from common.recent_ids import RecentIds
from common.sequencer import (
    GAP_GIVE_UP_S,
    GAP_RESYNC_S,
    ChunkSequencer,
    DecodeTail,
    gap_given_up,
    second_run_stop,
)
from common.subjects import Subjects
from common.tasks import watch

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
# How long, and how many, finished request ids a gateway remembers for resume queries: a
# redelivery comes ack_wait (30 s) after the lost ack, its retries within a minute more.
CLOSED_TTL_S = 600.0
CLOSED_MAX = 100_000
MAX_QUEUED_DELETES = 10_000  # aborted requests' stream messages waiting to be deleted
ABORT_FLUSH_S = 2.0  # how long a stopping gateway waits for its queued aborts to go out
ACK_WAIT_FOR_STOP_S = 2.0  # how long a second run's stop waits to name the message followed
# A streaming client whose socket takes nothing for this long is cut off, whatever its
# deadline (a day at most, its own to choose): it held an admission slot all that time.
WRITE_STALL_S = 30.0
# GAP_RESYNC_S, GAP_GIVE_UP_S (common.sequencer): a gap open that long asks the workers
# to resync (Dispatcher.on_lost_chunks), then ends the stream with a retryable 503.


def sse_event(obj: Any) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ClientClosedRequest(QosError):
    """The client hung up (nginx's 499). It only ends the request's own loop: nobody
    is left to send it to."""

    http_status = 499
    error_type = "client_closed_request"
    default_code = "client_closed_request"


@dataclass(slots=True)
class Delivery:
    """Tokens ready for the client, in order; or the final state; or an error."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    error: QosError | None = None
    stop_reason: int | str | None = None  # what ended a "stop" (None: EOS), as vLLM says
    # With the first tokens, when asked (echo with logprobs): prompt tokens 1.. (see Chunk).
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    completion_tokens: int = 0  # the request's tokens so far, these included (usage)


class ResponseStream:
    """The chunks of one request, reordered and deduplicated; read with :meth:`next`.

    Sequencing (dedupe, reorder, resume) is :class:`~common.sequencer.ChunkSequencer`, the
    same core the NATS-native client uses; this adds the waiting reader and OpenAI's view
    of endings (only "stop" and "length" are finish reasons; the rest end in an error).
    """

    __slots__ = ("_ready", "_seq", "_waiter", "finished", "group", "stream_seq", "worker_done")

    def __init__(self, request_id: str, group: str, decode_tail: DecodeTail) -> None:
        self.group = group
        self._seq = ChunkSequencer(request_id, decode_tail)
        self.finished = False
        # The worker ended it (its final chunk, its error, or JetStream gave it up): nothing
        # to abort. A stream the gateway ends itself (an undecodable chunk, a gap that never
        # fills, shutting down) is finished but not this, and its worker is told to stop.
        self.worker_done = False
        self.stream_seq: int | None = None  # the request's sequence in the stream, once acked
        self._ready: deque[Delivery] = deque()
        self._waiter: asyncio.Future[None] | None = None

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def token_ids(self) -> list[int]:
        """Tokens delivered so far: what a resume query gets back."""
        return self._seq.token_ids

    @property
    def text_len(self) -> int:
        return self._seq.text_len

    # -- producer side (the dispatcher's callbacks) ---------------------------------------

    def feed(self, chunk: Chunk) -> None:
        """Take one chunk from a worker; whatever becomes deliverable wakes the reader."""
        if self.finished:
            return
        try:
            ready = self._seq.feed(chunk)
        except QosError as exc:
            # The worker's own error ends its work; a gap the gateway gave up on does not.
            self.worker_done = chunk.error is not None or chunk.finish_reason == "error"
            if not self.worker_done:  # the gateway's own verdict: nothing else would say it
                log.warning("request %s: ending it: %s", self.request_id, exc.message,
                            extra=about(self.request_id))  # fmt: skip
            self.fail(exc)
            return
        for c in ready:
            if c.finish_reason == "abort":
                self.worker_done = True
                self.fail(
                    ServiceUnavailableError("the worker aborted the request", retry_after_s=1)
                )
                return
            if c.finish_reason is not None:
                self.finished = self.worker_done = True
            delivery = Delivery(c.token_ids, c.text, c.logprobs, c.top_logprobs, c.finish_reason)
            delivery.usage, delivery.stop_reason = c.usage, c.stop_reason
            if c.prompt_logprobs:
                delivery.prompt_logprobs = c.prompt_logprobs
                delivery.prompt_top_logprobs = c.prompt_top_logprobs
            self._push(delivery)

    @property
    def holding_gap(self) -> bool:
        return not self.finished and self._seq.holding_gap

    def take_second_run(self) -> tuple[int, str] | None:
        """A second run of one delivery whose chunks were dropped: (attempt, worker), once."""
        return self._seq.take_second_run()

    def fail(self, error: QosError) -> None:
        """End the stream with ``error`` (the reader raises or sends it as an SSE event).
        Resume queries are answered ``closed`` from now on, as the NATS client's are: a
        redelivered attempt was told where to resume and generated for nobody until the
        error event had reached a slow reader and the request was landed."""
        if not self.finished:
            self.finished = self._seq.finished = True
            self._push(Delivery(error=error))

    def hang_up(self) -> None:
        """The client left: wake the reader with :class:`ClientClosedRequest`. The stream
        stays unfinished, so whoever lands the request aborts the worker."""
        self._push(Delivery(error=ClientClosedRequest("the client closed the connection")))

    def resume(self, query: ResumeQuery) -> ResumeReply:
        """Answer a redelivered attempt: what the client has; older attempts go quiet."""
        return self._seq.resume(query)

    @property
    def has_ready(self) -> bool:
        """Deliveries wait for the reader."""
        return bool(self._ready)

    @property
    def attempt(self) -> int:
        """The delivery whose chunks the stream takes (later resumes raise it)."""
        return self._seq.min_attempt

    def _push(self, delivery: Delivery) -> None:
        self._ready.append(delivery)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- consumer side (the HTTP handler) -------------------------------------------------

    async def next(self, timeout_s: float) -> Delivery | None:
        """The next delivery, or None when ``timeout_s`` passes first.

        A timer handle, not a task or ``wait_for``: thousands of streams wait at once.
        """
        if self._ready:
            return self._ready.popleft()
        if timeout_s <= 0:
            return None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(timeout_s, _release, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return self._ready.popleft() if self._ready else None


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SseResponse(StreamingResponse):
    """``text/event-stream`` that notices a client hanging up without Starlette's task group.

    Starlette's StreamingResponse runs the body and a disconnect listener in an anyio task
    group per response; at a thousand streams a second that machinery is a visible share
    of the gateway's CPU. Here one plain task waits for ``http.disconnect`` and calls
    ``on_disconnect`` (which wakes the generator); ``on_close`` runs however the response
    ends, even if the generator never started.
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        headers: Mapping[str, str],
        on_disconnect: Callable[[], None],
        on_close: Callable[[int], None],
        deadline: float | None = None,
        write_stall_s: float = WRITE_STALL_S,
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events  # Starlette types its body_iterator wider than our bytes
        self._on_disconnect = on_disconnect
        self._on_close = on_close  # with the status to record if the events did not land
        self._deadline = deadline  # time.monotonic(): the request's, plus a margin
        self._write_stall_s = write_stall_s
        self._sending_since: float | None = None  # loop time of the send() in progress
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stalled = False
        self._done = False
        self._receive: Receive
        self._watcher: asyncio.Future[Message]  # the pending receive(), for http.disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._watch()
        status = 499
        try:
            # A client that keeps its connection open and stops reading blocks send() once
            # the socket's buffers fill: the events' own deadline check never runs again,
            # and the stream held its admission slot for as long as the client liked.
            # The deadline is the client's to choose (up to a day): one that reads nothing for
            # write_stall_s is cut off sooner, by a check every half of that.
            left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            async with asyncio.timeout(left) as limit:
                self._stall_timer = asyncio.get_running_loop().call_later(
                    self._write_stall_s / 2, self._check_stall, limit
                )
                try:
                    await self._body(send)
                finally:
                    self._stall_timer.cancel()
        except TimeoutError:
            status = 504
            log.warning("a streaming client read nothing for %s: dropped",
                        "too long" if self._stalled else "until past its deadline")  # fmt: skip
        finally:
            self._done = True
            self._watcher.cancel()
            self._on_close(status)

    def _check_stall(self, limit: asyncio.Timeout) -> None:
        """Cut a stream whose send() has waited ``write_stall_s`` (the client's socket is
        full: it reads nothing); else look again in half that time."""
        loop = asyncio.get_running_loop()
        if limit.expired():
            return  # the deadline fired in this same loop turn: the response is ending
        since = self._sending_since
        if since is not None and loop.time() - since >= self._write_stall_s:
            self._stalled = True
            limit.reschedule(loop.time())
            return
        self._stall_timer = loop.call_later(self._write_stall_s / 2, self._check_stall, limit)

    async def _body(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        ended = False
        loop = asyncio.get_running_loop()
        async for event in self._events:
            # ``[DONE]`` is the stream's last event: it ends the body in the same write.
            ended = event.endswith(SSE_DONE)
            self._sending_since = loop.time()
            await send({"type": "http.response.body", "body": event, "more_body": not ended})
            self._sending_since = None
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _watch(self) -> None:
        self._watcher = asyncio.ensure_future(self._receive())
        self._watcher.add_done_callback(self._received)

    def _received(self, watcher: asyncio.Future[Message]) -> None:
        if self._done or watcher.cancelled() or watcher.exception() is not None:
            return
        if watcher.result().get("type") == "http.disconnect":
            self._on_disconnect()
        else:  # a late body message (the app read it all already): keep listening
            self._watch()


class Dispatcher:
    """Routes ``out``/``resume`` messages to open streams and publishes aborts."""

    def __init__(
        self, nc: Client, subjects: Subjects, max_payload_bytes: int, stream: str | None = None
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._max_payload = max_payload_bytes
        self._stream = stream  # the request stream, for its MAX_DELIVERIES advisories
        self._streams: dict[str, ResponseStream] = {}
        self._out_prefix = len(subjects.prefix) + len(".out.")
        self._resume_prefix = len(subjects.prefix) + len(".resume.")
        self._subs: list[Subscription] = []
        # Aborts are queued, not awaited: they are raised from cancelled generators.
        # (group, request id, reason, the request's sequence in the stream if known, and
        # the stream's epoch that sequence belongs to)
        self._aborts: asyncio.Queue[tuple[str, str, str, int | None, int]] = asyncio.Queue()
        # Bumped when the request stream is replaced (deleted, made again from 1 by another
        # service): a sequence held from the old one would name, and delete, a new request.
        self._epoch = 0
        self._abort_task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()  # second runs' stops awaiting an ack
        # Bounded: with JetStream slow and clients leaving in a crowd it grew without end; a
        # delete left out costs a replica fetching a request nobody waits for.
        self._deletes: asyncio.Queue[tuple[int, int]] = asyncio.Queue(MAX_QUEUED_DELETES)
        self._delete_task: asyncio.Task[None] | None = None
        # Requests this gateway finished with: a copy redelivered later (its ack was lost)
        # is told so, rather than met with silence that a live gateway's worker must read
        # as "busy, hand it back" until JetStream gives up and keeps it for good.
        self._closed = RecentIds(ttl_s=CLOSED_TTL_S, max_size=CLOSED_MAX)
        # Told when chunks may have been lost without a reconnect, which nothing else would
        # recover (the worker acked: no redelivery): the app asks the workers to resync.
        self.on_lost_chunks: Callable[[], None] | None = None
        self._gaps: dict[str, GapWatch] = {}  # open streams that have held a gap
        # When each open stream last heard from its worker: the silent ones are listed in
        # the heartbeat, for a final chunk lost with nothing after it (common/idle_streams.py).
        self._heard = IdleStreams()

    def _lost_chunks(self) -> None:
        if self.on_lost_chunks is not None:
            self.on_lost_chunks()

    def _watch_gap(self, stream: ResponseStream) -> None:
        """After ``stream`` took a chunk: time its open gap (common/gap_watch.py)."""
        rid = stream.request_id
        watch = self._gaps.get(rid)
        if watch is None:
            if not stream.holding_gap:
                return

            def give_up() -> None:
                self._gaps.pop(rid, None)
                log.warning("request %s: a gap in its chunks stayed open %.0f s; ending it",
                            rid, GAP_GIVE_UP_S, extra=about(rid))  # fmt: skip
                stream.fail(gap_given_up())

            watch = self._gaps[rid] = GapWatch(
                holding=lambda: stream.holding_gap and self._streams.get(rid) is stream,
                connected=lambda: self._nc is None or self._nc.is_connected,
                resync=self._lost_chunks,
                give_up=give_up,
                resync_s=GAP_RESYNC_S,
                give_up_s=GAP_GIVE_UP_S,
            )
        watch.update()

    def _on_slow_consumer(self, exc: nats.errors.SlowConsumerError) -> None:
        if exc.subject.startswith(f"{self._subjects.prefix}.out."):
            self._lost_chunks()

    async def start(self, on_failure: Callable[[str], None] | None = None) -> None:
        """Subscribe and start the abort and delete loops (``on_failure``: told if one dies)."""
        on_slow_consumer(self._nc, self._on_slow_consumer)
        prefix = self._subjects.prefix
        self._subs = [
            await self._nc.subscribe(f"{prefix}.out.*", cb=self._on_out),
            await self._nc.subscribe(f"{prefix}.resume.*", cb=self._on_resume),
        ]
        if self._stream is not None:
            advisories = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self._stream}.*"
            self._subs.append(await self._nc.subscribe(advisories, cb=self._on_max_deliveries))
            self._delete_task = asyncio.create_task(self._delete_aborted(), name="gateway-deletes")
        self._abort_task = asyncio.create_task(self._publish_aborts(), name="gateway-aborts")
        if on_failure is not None:
            for task in (self._delete_task, self._abort_task):
                if task is not None:
                    watch(task, on_failure)

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be closing already
                log.debug("unsubscribe failed", exc_info=True)
        # Streams still open (no server cut them first: a bare uvicorn, a test) are ended
        # below, after which their handlers find them closed and abort nothing: abort them
        # here, while the abort loop still runs.
        for stream in self._streams.values():
            if not stream.worker_done:
                self._aborts.put_nowait(
                    (stream.group, stream.request_id, "gateway stopping", stream.stream_seq,
                     self._epoch)
                )  # fmt: skip
        if self._abort_task is not None:
            # Let queued aborts go out first: workers free their KV blocks on them. Bounded:
            # a stalled link still looks connected, and nothing bounds a lifespan shutdown.
            deadline = time.monotonic() + ABORT_FLUSH_S
            while not self._aborts.empty() and self._nc.is_connected:
                if time.monotonic() > deadline:
                    log.warning("%d aborts not sent at shutdown", self._aborts.qsize())
                    break
                await asyncio.sleep(0.01)
            self._abort_task.cancel()
        if self._delete_task is not None:
            self._delete_task.cancel()
        for task in self._stopping:
            task.cancel()
        self.fail_all(ServiceUnavailableError("the gateway is shutting down", retry_after_s=1))
        self._streams.clear()
        for gap in self._gaps.values():
            gap.cancel()
        self._gaps.clear()

    def fail_all(self, error: QosError) -> None:
        """End every open stream with ``error`` (their handlers answer it and abort the
        requests on the workers)."""
        for stream in list(self._streams.values()):
            stream.fail(error)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, group: str, decode_tail: DecodeTail) -> ResponseStream:
        """Register a stream; call before publishing the request, so no chunk is missed."""
        stream = ResponseStream(request_id, group, decode_tail)
        self._streams[request_id] = stream
        self._heard.heard(request_id)
        return stream

    def idle_streams(self) -> list[str]:
        """Open streams silent for a while, the most recently heard first (the heartbeat's)."""
        return self._heard.idle()

    def forget_sequences(self) -> None:
        """The request stream was replaced: the sequences open requests hold name nothing
        of theirs (their messages went with the old stream), and a new stream numbered from
        1 may give them to other requests, which an abort would delete and an advisory
        would fail. Forgotten, and deletes still queued are dropped."""
        self._epoch += 1
        for stream in self._streams.values():
            stream.stream_seq = None

    def highest_seq(self) -> int:
        """The highest stream sequence an open request holds (0: none)."""
        return max((s.stream_seq or 0 for s in self._streams.values()), default=0)

    def is_open(self, stream: ResponseStream) -> bool:
        return self._streams.get(stream.request_id) is stream

    def close(self, stream: ResponseStream, *, abort: bool = False, reason: str = "") -> None:
        """Forget ``stream`` (resume queries are answered ``closed``); ``abort`` tells the
        worker."""
        self._streams.pop(stream.request_id, None)
        self._heard.forget(stream.request_id)
        self._closed.add(stream.request_id)
        watch = self._gaps.pop(stream.request_id, None)
        if watch is not None:
            watch.cancel()
        if abort:
            stream.finished = True
            self._aborts.put_nowait(
                (stream.group, stream.request_id, reason, stream.stream_seq, self._epoch)
            )

    async def _on_out(self, msg: Msg) -> None:
        stream = self._streams.get(msg.subject[self._out_prefix :])
        if stream is None:
            return  # finished, aborted, or another gateway's request
        try:
            chunk = Chunk.from_bytes(msg.data, self._max_payload)
        except ProtocolError as exc:
            stream.fail(InternalError(f"undecodable chunk from the worker: {exc.message}"))
            return
        stream.feed(chunk)
        self._heard.took_chunk(stream.request_id, stream.finished)
        self._watch_gap(stream)
        second = stream.take_second_run()
        if second is not None:
            await self._stop_second_run(stream, second)

    async def _stop_second_run(self, stream: ResponseStream, run: tuple[int, str]) -> None:
        """Another worker runs the request besides the one this stream follows
        (common/sequencer.py): it stops without an answer. A run of another message (the
        id published twice) terminates that message; one of the followed message (its
        consumer made again) leaves it to come back after ack_wait as a later delivery,
        which resumes the request if the followed run is gone."""
        log.warning("request %s: worker %s runs delivery %d a second time; stopping it",
                    stream.request_id, run[1], run[0], extra=about(stream.request_id))  # fmt: skip
        if stream.stream_seq is None:
            # The publish's ack is still on its way (the runs began first): the stop waits
            # for it in a task of its own (this callback serves every stream's chunks), so
            # that it names the message followed and a duplicate is terminated.
            task = asyncio.create_task(self._stop_once_acked(stream, run), name="second-run")
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
            return
        await self._publish_stop(stream, run)

    async def _stop_once_acked(self, stream: ResponseStream, run: tuple[int, str]) -> None:
        deadline = time.monotonic() + ACK_WAIT_FOR_STOP_S
        while stream.stream_seq is None and time.monotonic() < deadline and not stream.finished:
            await asyncio.sleep(0.01)
        await self._publish_stop(stream, run)

    async def _publish_stop(self, stream: ResponseStream, run: tuple[int, str]) -> None:
        supersede = second_run_stop(stream.group, stream.request_id, run, stream.stream_seq)
        with contextlib.suppress(Exception):
            await self._nc.publish(self._subjects.abort(stream.group), supersede.to_bytes())

    async def _on_resume(self, msg: Msg) -> None:
        request_id = msg.subject[self._resume_prefix :]
        stream = self._streams.get(request_id)
        if not msg.reply or (stream is None and request_id not in self._closed):
            return  # another gateway's request, or silence: the caller is gone
        try:
            query = ResumeQuery.from_bytes(msg.data, self._max_payload)
        except ProtocolError as exc:
            log.warning("bad resume query on %s: %s", msg.subject, exc.message)
            return
        if query.id != request_id:  # a query about one request cannot steer another
            log.warning("resume query for %r on %s's subject ignored", query.id, request_id)
            return
        reply = ResumeReply(id=request_id, closed=True) if stream is None else stream.resume(query)
        await self._nc.publish(msg.reply, reply.to_bytes())
        if stream is not None and not reply.closed:
            # The stream follows this attempt now: a replica still serving an earlier
            # delivery (its in_progress came late) stops, rather than spend a batch slot
            # and ack the message under the replica that serves it.
            # The attempt it follows, not the query's: a replica cut off since an earlier one
            # asks with that one (a resync), and is the one to stop.
            supersede = Control(
                action="supersede", issued_ms=int(time.time() * 1000), group=stream.group,
                request_id=request_id, attempt=stream.attempt, reason="resumed elsewhere",
            )  # fmt: skip
            await self._nc.publish(self._subjects.abort(stream.group), supersede.to_bytes())

    async def _on_max_deliveries(self, msg: Msg) -> None:
        try:
            advisory = json.loads(msg.data)
            seq, deliveries = int(advisory["stream_seq"]), int(advisory.get("deliveries", 0))
        except (ValueError, KeyError, TypeError):
            log.warning("unreadable advisory on %s", msg.subject)
            return
        stream = next((s for s in self._streams.values() if s.stream_seq == seq), None)
        if stream is None:
            return  # another gateway's request, or one that ended already
        log.warning(
            "request %s failed on all %d deliveries (JetStream gave up: %s); answering with an error",
            stream.request_id, deliveries, advisory.get("consumer", "?"),
        )  # fmt: skip
        stream.worker_done = True  # JetStream gave it up: no worker holds it
        # A work queue keeps a message past max_deliver for good: delete it.
        self._queue_delete(seq, self._epoch)
        stream.fail(
            RequestGivenUpError(
                f"the request failed on every one of its {deliveries} deliveries to workers "
                "and was given up"
            )
        )

    async def _publish_aborts(self) -> None:
        while True:
            group, request_id, reason, stream_seq, epoch = await self._aborts.get()
            control = Control(
                action="abort",
                issued_ms=int(time.time() * 1000),
                group=group,
                request_id=request_id,
                reason=reason,
            )
            try:
                await self._nc.publish(self._subjects.abort(group), control.to_bytes())
            except Exception:
                log.warning("could not publish abort for %s", request_id, exc_info=True)
            if self._stream is not None and stream_seq is not None:
                self._queue_delete(stream_seq, epoch)

    def _queue_delete(self, seq: int, epoch: int) -> None:
        try:
            self._deletes.put_nowait((seq, epoch))
        except asyncio.QueueFull:
            log.debug("delete queue full: stream message %d stays", seq)

    async def _delete_aborted(self) -> None:
        """Take aborted requests out of the stream. Still queued, one would be fetched later
        by a replica that never heard the abort (it subscribed after); gone already (a
        worker acked it) is the usual case, and fine. Apart from the aborts, so a slow
        JetStream never delays the workers' news."""
        assert self._stream is not None
        js = self._nc.jetstream(timeout=2.0)
        while True:
            seq, epoch = await self._deletes.get()
            if epoch != self._epoch:
                continue  # a sequence of a stream since replaced: another request's now
            with contextlib.suppress(Exception):
                await js.delete_msg(self._stream, seq)
