"""The NATS-native client, and the wire contract any NATS client can implement.

Python: ``async with await QosClient.connect(config) as client`` (or ``QosClient(nc)``), then
``async for chunk in client.generate(prompt=..., group="short", params=RequestParams(...))``.
Each yielded :class:`~common.protocol.Chunk` holds only tokens not yielded before; the last
one has ``finish_reason``, ``usage`` and ``stop_reason``; a worker error raises the matching
:class:`~common.errors.QosError` (its ``code`` as the README lists them); the deadline
raises ``DeadlineExceededError``. :class:`~common.sequencer.ChunkSequencer` is the
transport-free core (dedupe, reorder, resume), shared with the gateway.

The wire contract any NATS client can implement (subjects, the request and chunk maps,
resume queries, aborts, supersede, deadlines) is in the README, "Calling qosserve over NATS
(no HTTP)"; this client follows it as the gateway does. It also heartbeats as a gateway
does (``origin``): workers abort the requests of a client that died, and re-send what a
reconnect of the client's own link swallowed.

Leave a stream early with ``break`` inside ``async with contextlib.aclosing(gen)`` (or
call ``await gen.aclose()``) where ``gen = client.generate(...)`` is kept in a variable:
the abort goes out when the generator closes, which a kept reference delays.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from types import TracebackType
from typing import Any, Self

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from common.config import Config, NatsConfig
from common.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    ProtocolError,
    QosError,
    RequestGivenUpError,
    ServiceUnavailableError,
)
from common.gap_watch import GapWatch
from common.heartbeat import Heartbeat
from common.idle_streams import IdleStreams
from common.nats import barrier, refused_publishes
from common.protocol import (
    DEFAULT_MAX_PAYLOAD,
    Chunk,
    Control,
    GenerateRequest,
    RequestParams,
    ResumeQuery,
    ResumeReply,
)
from common.recent_ids import RecentIds
from common.request_publish import CancelledAfterAck, publish_error, publish_request
from common.sequencer import (
    GAP_GIVE_UP_S,
    GAP_RESYNC_S,
    ChunkSequencer,
    DecodeTail,
    gap_given_up,
    second_run_stop,
)
from common.subjects import Subjects

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
# How often a call waiting for chunks looks whether a connection the caller owns has closed
# for good (one made by connect() says so at once, through its closed callback).
CLOSED_CHECK_S = 1.0
HEARTBEAT_INTERVAL_S = 1.0  # gateway.heartbeat_interval_s's default: workers judge by it


class QosClient:
    """Publishes requests onto NATS and streams their answers (see the module docstring)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects | None = None,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
        owns_connection: bool = False,
        stream: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        heartbeat: bool = True,
        groups: Collection[str] | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects or Subjects()
        self._max_payload = max_payload_bytes
        self._owns = owns_connection
        self._stream = stream  # the request stream's name, when known: JetStream checks it
        # Requests carry it as their origin: workers watch its heartbeat, as a gateway's.
        # heartbeat=False (or a NATS user that may not publish P.gw.*): no origin is sent,
        # and workers neither reap nor resync this client's requests.
        self.client_id = f"cl-{uuid.uuid4().hex[:16]}"
        self._heartbeat = Heartbeat(nc, self.subjects, self.client_id, heartbeat_interval_s)
        # Its calls' streams silent for a while, listed in the heartbeat as the gateway's are
        # (a final chunk lost with nothing after it: common/idle_streams.py).
        self._heard = IdleStreams()
        self._heartbeat.idle_streams = self._heard.idle
        self._heartbeat_wanted = heartbeat
        self.origin = ""  # set once the first beat is known to have gone out
        self._started: asyncio.Task[None] | None = None  # what every first request waits for
        # Requests this client finished: a redelivered copy's resume query gets "closed"
        # (acked and dropped at once) rather than silence (handed back, delivery after
        # delivery, while the origin still beats).
        self._closed = RecentIds(ttl_s=600.0, max_size=10_000)
        # Ids in flight here (how many calls hold each): never answered "closed".
        self._live: collections.Counter[str] = collections.Counter()
        self._answers: Subscription | None = None  # their subscription (P.resume.*)
        # How to end each call in flight: close() wakes them (they waited for the deadline).
        self._failers: set[Callable[[QosError, bool], None]] = set()
        self._groups = groups  # the configured groups, when known: others are refused

    @classmethod
    async def connect(
        cls,
        config: Config | NatsConfig,
        name: str = "qos-client",
        service: str | None = None,
        heartbeat: bool = True,
    ) -> Self:
        """Connect with :func:`common.nats.connect`; :meth:`close` closes the connection.

        Replies (JetStream's publish acks) come back on ``nats.inbox_prefix``, else on
        ``_INBOX_<service>``, else on ``_INBOX``: under ``deploy/nats/permissions.conf``,
        whose users may each read their own inbox only, run as a user allowed to publish
        requests with the inbox it may read (``service="gateway"`` as the gateway's user).
        """
        from common.nats import connect

        cfg = config.nats if isinstance(config, Config) else config
        interval = (
            config.gateway.heartbeat_interval_s
            if isinstance(config, Config)
            else HEARTBEAT_INTERVAL_S
        )
        # The connection may close for good (credentials refused after a rotation, reconnect
        # attempts spent): the calls in flight then fail at once, not at their deadline.
        # Weak: the client is made after the connection, which must not keep it alive.
        client_ref: weakref.ref[Self] | None = None

        def closed() -> None:
            client = client_ref() if client_ref is not None else None
            if client is not None:
                client._connection_closed()

        nc = await connect(cfg, name, service=service, on_closed=closed)
        client = cls(
            nc,
            Subjects(cfg.subject_prefix),
            max_payload_bytes=cfg.max_payload_bytes,
            owns_connection=True,
            stream=cfg.stream,
            heartbeat_interval_s=interval,
            heartbeat=heartbeat,
            groups=frozenset(config.groups) if isinstance(config, Config) else None,
        )
        client_ref = weakref.ref(client)
        return client

    def _connection_closed(self) -> None:
        """The NATS connection ended for good: no chunk can come, so every call in flight
        ends now with a retryable error (it waited out its whole deadline)."""
        for fail in list(self._failers):
            fail(_connection_lost(), False)

    async def close(self) -> None:
        """End the calls still in flight (``ServiceUnavailableError``; each aborts its
        request on the worker as it unwinds), stop heartbeating (workers then abort what is
        still running for this client), and close the connection if :meth:`connect`
        opened it."""
        calls = list(self._failers)
        for fail in calls:
            fail(ServiceUnavailableError("the client was closed", retry_after_s=1), False)
        if calls:
            await asyncio.sleep(0)  # let them see it and send their aborts first
            for _ in range(100):  # each unwinds through a few awaits (unsubscribes, abort)
                if not self._failers:
                    break
                await asyncio.sleep(0.01)
        if self._started is not None:  # a start under way would beat on after this
            with contextlib.suppress(Exception):
                await self._started
        await self._heartbeat.stop()
        if self._answers is not None:  # a connection the caller keeps must not keep it
            with contextlib.suppress(Exception):
                await self._answers.unsubscribe()
            self._answers = None
        self._started = None
        self.origin = ""
        if self._owns:
            await self.nc.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _start(self) -> None:
        """Before the first request: the heartbeat (its first beat goes out first) and the
        answers for finished requests' resume queries. Requests made meanwhile wait for it:
        sent before their origin was known, they went without one."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start_once())
        await asyncio.shield(self._started)

    async def _start_once(self) -> None:
        with contextlib.suppress(Exception):  # a user that may not read them: silence then
            self._answers = await self.nc.subscribe(
                self.subjects.resume_wildcard, cb=self._answer_closed
            )
        if not self._heartbeat_wanted:
            return
        await self._heartbeat.start()
        # A user that may not publish P.gw.* has its beats refused (asynchronously): its
        # requests would carry an origin workers never hear, and be reaped as orphans.
        with contextlib.suppress(Exception):  # a user that may not ask: the beat's -ERR,
            await barrier(self.nc, timeout_s=1.0)  # if any, came first anyway
        beat = self.subjects.gateway_heartbeat(self.client_id)
        # Every refusal recorded (a later -ERR overwrites nats-py's last_error: the
        # barrier's own, for a user that may not send it).
        refusals = [*refused_publishes(self.nc), str(self.nc.last_error or "")]
        if any(beat in refusal for refusal in refusals):
            log.warning("NATS refused this client's heartbeat on %s: requests go without an "
                        "origin (workers neither reap nor resync them); allow publishing "
                        "%s to its user", beat, self.subjects.gateway_heartbeat_wildcard)  # fmt: skip
            await self._heartbeat.stop()
            return
        self.origin = self.client_id

    def _check_group(self, group: str) -> None:
        """``InvalidRequestError`` for a group the configuration does not have (known when
        :meth:`connect` was given a whole ``Config``): JetStream's stream takes ``P.req.*``
        and stored a request for a misspelt group, whose caller then waited out its whole
        deadline. A group that is configured but not served yet waits in the stream, as
        JetStream promises, until a worker of it starts or its deadline passes."""
        if self._groups is not None and group not in self._groups:
            raise InvalidRequestError(
                f"no instance group {group!r} is configured (groups: "
                f"{', '.join(sorted(self._groups))})",
                param="group",
            )

    async def _answer_closed(self, msg: Msg) -> None:
        if not msg.reply:
            return
        request_id = msg.subject.rsplit(".", 1)[-1]
        if request_id in self._closed and request_id not in self._live:
            await self.nc.publish(msg.reply, ResumeReply(id=request_id, closed=True).to_bytes())

    async def generate(
        self,
        *,
        group: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: RequestParams | None = None,
        deadline_ms: int | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        priority: int = 0,
        model: str = "",
        decode_tail: DecodeTail | None = None,
        cache_salt: str = "",
        headers: dict[str, str] | None = None,
    ) -> AsyncIterator[Chunk]:
        """Yield the answer's chunks, each with only new tokens; the last one is final.

        ``deadline_ms`` is absolute (epoch ms) and travels with the request; ``timeout_s``
        is relative; the earlier wins (default: :data:`DEFAULT_TIMEOUT_S`). Leaving the
        loop early, a timeout or cancellation aborts the request on the worker.
        ``headers`` go with the request message (``traceparent``/``tracestate``: the
        worker's spans join that trace).
        """
        now_ms = int(time.time() * 1000)
        if timeout_s is not None or deadline_ms is None:
            relative = now_ms + int(1000 * (DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s))
            deadline_ms = relative if deadline_ms is None else min(deadline_ms, relative)
        # The wire carries the wall-clock deadline (the worker's); this call waits on the
        # monotonic clock: an NTP step forward aborted healthy requests, one back let a call
        # whose worker died wait past its timeout.
        ends_at = time.monotonic() + max(0.0, deadline_ms / 1000 - time.time())
        rid = request_id or uuid.uuid4().hex
        request = GenerateRequest(
            id=rid,
            group=group,
            reply=self.subjects.out(rid),
            model=model,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids or []),
            params=params or RequestParams(),
            priority=priority,
            deadline_ms=deadline_ms,
            created_ms=now_ms,
            cache_salt=cache_salt,
        )
        request.validate()
        self._check_group(group)
        if self.nc.is_closed:  # nats-py's raw ConnectionClosedError from a subscribe else
            raise _connection_lost()
        await self._start()
        request.origin = self.origin
        stream = ChunkSequencer(rid, decode_tail)
        ready: asyncio.Queue[Chunk | QosError] = asyncio.Queue()
        # The worker is done with the request (its final or error chunk): nothing to abort.
        worker_done = [False]

        def fail(error: QosError, worker_finished: bool) -> None:
            stream.finished = True
            worker_done[0] = worker_done[0] or worker_finished
            ready.put_nowait(error)

        async def on_chunk(msg: Msg) -> None:
            if stream.finished:
                return
            try:
                chunk = Chunk.from_bytes(msg.data, self._max_payload)
            except ProtocolError as exc:  # the worker may run on: it is aborted
                fail(InternalError(f"undecodable chunk from the worker: {exc.message}"), False)
                return
            try:
                chunks = stream.feed(chunk)
            except QosError as exc:
                # The worker's own error ends its work; a gap given up on does not.
                fail(exc, chunk.error is not None or chunk.finish_reason == "error")
                return
            gap.update()
            self._heard.took_chunk(rid, stream.finished)
            second = stream.take_second_run()
            if second is not None:  # as the gateway does (its Dispatcher._stop_second_run)
                stop = second_run_stop(group, rid, second, queued[1] if queued else None)
                with contextlib.suppress(Exception):
                    await self.nc.publish(self.subjects.abort(group), stop.to_bytes())
            for item in chunks:
                if item.finish_reason == "abort":
                    # The worker gave it up (its origin fell silent, an operator): retryable,
                    # as the gateway answers it; as a final chunk it read as a short answer.
                    fail(ServiceUnavailableError(
                        "the worker aborted the request", retry_after_s=1), True)  # fmt: skip
                    return
                if item.finish_reason is not None:
                    worker_done[0] = True
                ready.put_nowait(item)

        # As the gateway's dispatcher: a gap that stays open asks for a resync (a chunk
        # lost with no reconnect: nothing else resends it), then ends the request with a
        # retryable error rather than wait to the timeout.
        gap = GapWatch(
            holding=lambda: not stream.finished and stream.holding_gap,
            connected=lambda: self.nc.is_connected,
            resync=self._heartbeat.request_resync,  # a no-op for workers without our beats
            give_up=lambda: fail(gap_given_up(), False),
            resync_s=GAP_RESYNC_S,
            give_up_s=GAP_GIVE_UP_S,
        )

        async def on_resume(msg: Msg) -> None:
            if not msg.reply:
                return
            try:
                query = ResumeQuery.from_bytes(msg.data, self._max_payload)
            except ProtocolError:
                return
            if query.id != rid:  # a query about one request cannot steer another
                return
            reply = ResumeReply(id=rid, closed=True) if stream.finished else stream.resume(query)
            await self.nc.publish(msg.reply, reply.to_bytes())
            if not reply.closed:
                # As the gateway does: a replica still on an earlier delivery (its
                # in_progress came late) stops, rather than spend a batch slot and ack the
                # message under the replica this stream follows now.
                supersede = Control(
                    action="supersede", issued_ms=int(time.time() * 1000), group=group,
                    request_id=rid, attempt=stream.min_attempt, reason="resumed elsewhere",
                )  # fmt: skip
                with contextlib.suppress(Exception):
                    await self.nc.publish(self.subjects.abort(group), supersede.to_bytes())

        done = False
        queued: tuple[str, int] | None = None  # (stream, sequence) of the request message
        # Until the publish says otherwise, the request may be in the stream (a timed-out
        # publish, a cancellation mid-publish): ending, it is aborted even without a sequence.
        maybe_queued = False
        subs: list[Subscription] = []
        self._live[rid] += 1
        self._heard.heard(rid)
        self._failers.add(fail)
        try:
            # Inside the try: a subscribe that raised (a closed connection) or was cancelled
            # left the first subscription and the live count behind for good.
            try:
                subs.append(await self.nc.subscribe(self.subjects.out(rid), cb=on_chunk))
                subs.append(await self.nc.subscribe(self.subjects.resume(rid), cb=on_resume))
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                raise _connection_lost() from None  # closed since the check above
            payload = request.to_bytes()
            maybe_queued = True
            try:
                ack, attempt = await publish_request(
                    self.js, self.subjects.request(group), payload,
                    {**(headers or {}), "Nats-Msg-Id": rid},
                    ends_at,
                    stream=self._stream,
                )  # fmt: skip
            except CancelledAfterAck as cancelled:
                if not (cancelled.ack.duplicate and cancelled.attempt == 0):  # ours: delete it
                    queued = (cancelled.ack.stream, cancelled.ack.seq)
                raise
            except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                maybe_queued = False
                raise ServiceUnavailableError(
                    f"no JetStream stream takes {self.subjects.request(group)}: is a worker "
                    "or gateway running against this NATS?",
                    retry_after_s=1,
                ) from None
            except Exception as exc:
                maybe_queued = not isinstance(exc, nats.errors.MaxPayloadError)
                error = publish_error(exc, len(payload), "this client")
                if error is None:
                    raise
                raise error from None
            if ack.duplicate and attempt == 0:
                maybe_queued = False
                # JetStream kept the earlier message with this id: nothing new is queued, and
                # its answer (running, or long finished) is not this caller's to wait for.
                done = True
                raise InvalidRequestError(
                    f"request id {rid!r} is in use (JetStream deduplicated this request "
                    "within its window); use a new id",
                    param="request_id",
                )
            queued = (ack.stream, ack.seq)

            async def on_given_up(msg: Msg) -> None:
                # JetStream stopped redelivering it (every delivery crashed or failed a
                # worker): no answer will come, so fail now rather than at the deadline.
                try:
                    advisory = json.loads(msg.data)
                    seq, deliveries = int(advisory["stream_seq"]), int(advisory["deliveries"])
                except (ValueError, KeyError, TypeError):
                    return
                if seq == ack.seq and not stream.finished:
                    fail(RequestGivenUpError(
                        f"request {rid} failed on every one of its {deliveries} deliveries "
                        "to workers and was given up"
                    ), True)  # fmt: skip
                    # A work queue keeps a message past max_deliver for good.
                    with contextlib.suppress(Exception):
                        await self.js.delete_msg(ack.stream, ack.seq)

            with contextlib.suppress(Exception):  # not permitted: the deadline still ends it
                subs.append(
                    await self.nc.subscribe(
                        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{ack.stream}."
                        f"{Subjects.consumer(group)}",
                        cb=on_given_up,
                    )
                )
            while not done:
                left = ends_at - time.monotonic()
                try:
                    # What came in time goes out first, however slowly the caller reads; a
                    # wait (a task per call) only when nothing is waiting already.
                    if not ready.empty():
                        item = ready.get_nowait()
                    else:
                        # Not wait_for: on Python 3.11 it can return a chunk and swallow a
                        # cancel that came with it, so a caller's timeout never fired and
                        # no abort reached the worker. A cancelled get leaves its item.
                        async with asyncio.timeout(max(min(left, CLOSED_CHECK_S), 0.0)):
                            item = await ready.get()
                except TimeoutError:
                    if self.nc.is_closed:  # a connection the caller made: no callback told us
                        raise _connection_lost() from None
                    if left > CLOSED_CHECK_S:
                        continue
                    raise DeadlineExceededError(
                        f"request {rid} passed its deadline", param="deadline_ms"
                    ) from None
                if isinstance(item, QosError):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            stream.finished = True
            gap.cancel()
            self._live[rid] -= 1
            if not self._live[rid]:
                del self._live[rid]
                self._heard.forget(rid)
            if queued is not None or maybe_queued:  # ours in the stream (not a duplicate)
                self._closed.add(rid)
            try:
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                if not worker_done[0] and (queued is not None or maybe_queued):
                    await self._abort(group, rid, "client stopped reading", queued)
            finally:
                # Last: close() waits for this before it closes the connection, which
                # cancelled an unsubscribe or abort still under way here. In a finally: a
                # second cancel (anyio's scopes cancel at every await) skipped it, and the
                # call's state stayed in memory, close() waiting a second on it.
                self._failers.discard(fail)

    async def _abort(
        self, group: str, request_id: str, reason: str, queued: tuple[str, int] | None = None
    ) -> None:
        """Abort on the group's control subject; and take the request out of the stream if it
        is still queued (a replica that joins later never heard the abort)."""
        control = Control(
            action="abort",
            issued_ms=int(time.time() * 1000),
            group=group,
            request_id=request_id,
            reason=reason,
        )
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.abort(group), control.to_bytes())
        if queued is not None:
            with contextlib.suppress(Exception):  # gone already (a worker acked it): fine
                await self.js.delete_msg(*queued)

    async def collect(self, **kwargs: Any) -> tuple[list[int], str, Chunk]:
        """Run :meth:`generate` to the end: (token ids, text, final chunk)."""
        ids: list[int] = []
        text = ""
        final: Chunk | None = None
        async for chunk in self.generate(**kwargs):
            ids += chunk.token_ids
            text += chunk.text
            final = chunk
        assert final is not None
        return ids, text, final


def _connection_lost() -> ServiceUnavailableError:
    """A call's error once the client's NATS connection has closed for good."""
    return ServiceUnavailableError(
        "this client's NATS connection is closed (credentials refused, reconnect attempts "
        "spent, or closed)",
        retry_after_s=2,
    )
