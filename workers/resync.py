"""Resync: after a NATS reconnect, every caller gets the chunks it missed.

Chunks travel on core NATS (at most once). Around a NATS restart some are gone: those
written to the old socket just before it died, and those published while the caller's
own connection was not back yet. Without a resync the caller holds a gap that never
fills (or never sees the final chunk) until its deadline, although the worker finished.

So the worker watches its client's reconnect count, and each gateway's (its heartbeat
carries it: the gateway's link may drop while the worker's does not, and then only the
gateway's streams need it). After a reconnect it asks the caller
of each request in flight, and of each finished shortly before or during the outage,
what it has, with the resume query a redelivered attempt sends (``qos.resume.<id>``,
DESIGN §2) but with the *same* attempt number, which changes nothing on the caller's
side, then re-publishes every chunk past that point; the caller drops what it already
has by ``seq``. No responder means the caller is not back yet: ask again, for up to
``window_s``; so does silence from a caller whose gateway still beats (a gateway answers
``closed`` when it has everything, so its silence is lateness); silence from one that went
quiet, or from a direct caller, means it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import nats.errors
from nats.aio.client import Client

from common.errors import ProtocolError
from common.protocol import ResumeQuery, ResumeReply
from common.subjects import Subjects
from common.tasks import cancel_and_wait
from workers.outbox import Flight

log = logging.getLogger(__name__)

# A finished request is kept this long for a resync (longer while the link is down): a
# caller asks again while a gap stays open, once a second at most, and gives up at 5 s
# (gateway.streams.GAP_GIVE_UP_S); 2 s lost the race to a caller whose loop was behind
# (the overload that dropped the chunk), and the request then hung to its deadline.
KEEP_S = 6.0
# How long a resync keeps asking a caller that is not reconnected yet.
WINDOW_S = 10.0
RETRY_S = 0.2
# A finished request its caller lists as silent is resynced at most this often (the list
# comes with every heartbeat while the stream stays open).
IDLE_RESYNC_GAP_S = 2.0


class Resync:
    """Remembers what each flight sent; after a reconnect re-sends what callers lack."""

    def __init__(
        self,
        subjects: Subjects,
        worker_id: str,
        max_payload: int,
        *,
        timeout_s: float = 1.0,
        keep_s: float = KEEP_S,
        window_s: float = WINDOW_S,
        origin_silent_s: Callable[[str], float] | None = None,
        origin_quiet_after_s: float = 2.0,
        on_closed: Callable[[Flight], None] | None = None,
        quiet_keep_s: float = WINDOW_S,
    ) -> None:
        self._subjects = subjects
        self._worker_id = worker_id
        self._max_payload = max_payload
        self._timeout_s = timeout_s
        self._keep_s = keep_s
        self._window_s = window_s
        # Seconds since a gateway's last heartbeat: a finished flight is kept while its
        # gateway is quiet (maybe cut off, to be resynced when it is back).
        self._origin_silent_s = origin_silent_s
        self._origin_quiet_after_s = origin_quiet_after_s
        # A finished flight whose gateway is still quiet is kept up to this long: cut off
        # past the orphan threshold, the gateway finds its requests ended here (aborted as
        # orphans), and only a resync when it is back tells its clients (else they wait for
        # their deadlines).
        self._quiet_keep_s = max(quiet_keep_s, window_s)
        # Told of a flight whose caller answered "closed": an abort it sent while this
        # worker was cut off never came, and the request must not run on for nobody.
        self._on_closed = on_closed
        self._recent: dict[str, tuple[float, Flight]] = {}
        # Finished flights whose gateway went quiet since -> when it was last seen quiet.
        self._quiet: dict[str, float] = {}
        self._reconnects = 0
        self._last_down = -float("inf")
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle_asked: dict[str, float] = {}  # request id -> its last resync for silence

    def finished(self, st: Flight) -> None:
        """``st`` sent its final chunk: keep it a while in case that chunk is lost."""
        self._recent[st.request.id] = (time.monotonic(), st)

    def tick(self, nc: Client, inflight: list[Flight]) -> None:
        """Called periodically: start resyncs after a reconnect, forget old flights."""
        now = time.monotonic()
        reconnects = int(nc.stats.get("reconnects", 0))
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            flights = self._flights(inflight)
            if flights:
                log.info("NATS reconnected: resyncing %d requests with their callers", len(flights))
            self._start(nc, flights)
        if not nc.is_connected:
            self._last_down = now
        # Whatever finished during an outage is kept until the resync window has passed;
        # so is what finished while its gateway went quiet, for as long as the window after
        # it was last seen quiet (up to quiet_keep_s), even once the gateway is heard again:
        # only its reconnect-count beat says whether it missed chunks, and a beat it queued
        # while cut off can arrive first.
        calm = now - self._last_down > self._window_s
        quiet: dict[str, bool] = {}  # per origin, this tick
        for rid, (at, st) in list(self._recent.items()):
            origin = st.request.origin
            if origin not in quiet:
                quiet[origin] = self._origin_quiet(st)
            if quiet[origin]:
                self._quiet[rid] = now
            if now - at > self._keep_s and (calm or at < self._last_down - self._keep_s):
                last_quiet = self._quiet.get(rid)
                if (
                    last_quiet is not None
                    and now - last_quiet < self._window_s
                    and now - at < self._quiet_keep_s
                ):
                    continue
                del self._recent[rid]
                self._quiet.pop(rid, None)
                self._idle_asked.pop(rid, None)

    def caller_reconnected(self, nc: Client, origin: str, inflight: Iterable[Flight]) -> None:
        """Gateway ``origin`` reports a reconnect of its own: resync its streams."""
        flights = [st for st in self._flights(inflight) if st.request.origin == origin]
        if flights:
            log.info("gateway %s reconnected: resyncing %d requests", origin, len(flights))
        self._start(nc, flights)

    def idle_at_caller(self, nc: Client, origin: str, request_ids: Iterable[str]) -> None:
        """Caller ``origin`` has heard nothing for a while on these streams: those this
        worker finished lately lost their final chunk on the way (nothing came after it to
        show a gap), and are resynced. Those still running or never here are not ours to
        answer: a stream merely slow costs a lookup."""
        now = time.monotonic()
        flights = []
        for rid in request_ids:
            kept = self._recent.get(rid)
            if kept is None or kept[1].request.origin != origin:
                continue
            if now - self._idle_asked.get(rid, -float("inf")) < IDLE_RESYNC_GAP_S:
                continue
            self._idle_asked[rid] = now
            flights.append(kept[1])
        if flights:
            log.info("caller %s heard nothing more of %d finished requests: resyncing them",
                     origin, len(flights))  # fmt: skip
        self._start(nc, flights)

    def _flights(self, inflight: Iterable[Flight]) -> list[Flight]:
        """Requests in flight and those finished recently, once each."""
        flights = {st.request.id: st for _, st in self._recent.values()}
        flights.update((st.request.id, st) for st in inflight)
        return list(flights.values())

    def _start(self, nc: Client, flights: Iterable[Flight]) -> None:
        for st in flights:
            task = asyncio.create_task(self._resync(nc, st), name="worker-resync")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _origin_quiet(self, st: Flight) -> bool:
        origin = st.request.origin
        if not origin or self._origin_silent_s is None:
            return False
        return self._origin_silent_s(origin) > self._origin_quiet_after_s

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks), what="resync tasks")
        self._recent.clear()
        self._quiet.clear()
        self._idle_asked.clear()

    async def _resync(self, nc: Client, st: Flight) -> None:
        reply = await self._ask(nc, st)
        if reply is not None and reply.closed and self._on_closed is not None:
            self._on_closed(st)
        if reply is None or reply.closed:  # gone, or finished with it: nothing to re-send
            return
        delivered = len(reply.token_ids)
        resent = 0
        for chunk in list(st.sent_chunks):
            if chunk.seq + len(chunk.token_ids) > delivered or chunk.finish_reason is not None:
                with contextlib.suppress(Exception):
                    await nc.publish(st.request.reply, chunk.to_bytes())
                    resent += 1
        if resent:
            log.info("request %s: re-sent %d chunks after a reconnect", st.request.id, resent)

    def _caller_beats(self, st: Flight) -> bool:
        origin = st.request.origin
        if not origin or self._origin_silent_s is None:
            return False
        return self._origin_silent_s(origin) < self._origin_quiet_after_s

    async def _ask(self, nc: Client, st: Flight) -> ResumeReply | None:
        """The caller's answer; None when it stays silent (done or gone) or never returns."""
        query = ResumeQuery(id=st.request.id, attempt=st.attempt, worker=self._worker_id)
        subject = self._subjects.resume(st.request.id)
        give_up = time.monotonic() + self._window_s
        while time.monotonic() < give_up:
            try:
                answer = await nc.request(subject, query.to_bytes(), timeout=self._timeout_s)
                return ResumeReply.from_bytes(answer.data, self._max_payload)
            except ProtocolError:
                return None
            except (nats.errors.TimeoutError, TimeoutError):
                # A gateway answers closed when it has everything: silence from one that
                # still beats is a late event loop (every worker resyncs at once after a
                # NATS restart), not an answer. Ask again within the window; give up on a
                # caller that went quiet too, or on a direct one (no origin).
                if not self._caller_beats(st):
                    return None
            except Exception:  # no responder yet, or our own link is still down
                await asyncio.sleep(RETRY_S)
        return None
