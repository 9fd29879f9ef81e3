"""A caller's heartbeat: a message on ``qos.gw.<caller id>`` every interval, from every
gateway and every NATS-native client (``common/client.py``).

Requests carry the caller's id (``GenerateRequest.origin``); a worker that stops hearing
from a request's caller aborts it, since the caller went down and nobody will read the
rest (``WorkerConfig.orphan_after_s``).

The payload is the gateway's NATS reconnect count in ASCII digits (empty from gateways
older than this field: read as no news). Chunks are core NATS: those a worker published
while the gateway's own connection was down never reached it, and the worker cannot tell
from its side. A worker that sees the count change re-sends each of that gateway's
streams past what the gateway holds (:mod:`workers.resync`); the gateway beats as soon as
it is back, so that happens within a fraction of a second, not an interval later.

The gateway also asks for a resync without a reconnect (:meth:`Heartbeat.request_resync`):
when its client dropped messages (a slow consumer: nats-py drops what overflows a
subscription's queue and only reports it) or a stream has held a gap in its chunks for a
while (a cluster route that flapped without either client reconnecting). The count it
beats is then the reconnect count plus those requests: a change all the same to workers.

A beat is followed, while the caller has streams silent for a while, by a second message
on the same subject: ``idle`` and their request ids (:func:`idle_payload`,
:mod:`common.idle_streams`), for the final chunks lost with nothing after them. A worker
from before it reads that as a beat with no count: alive, no news.

No beat is published while the link is down. nats-py would buffer it and send it on
reconnect, ahead of the first beat with the new count: a worker would hear "alive, no
reconnect" from a gateway that was cut off, stop keeping the streams it finished during
the cut for a resync, and drop them just before the news arrived (their callers then
waited for their deadline).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from nats.aio.client import Client

from common.idle_streams import IDLE_LIST_MAX
from common.protocol import heartbeat_payload
from common.subjects import Subjects, is_subject_token
from common.tasks import cancel_and_wait, watch

log = logging.getLogger(__name__)

# How often the beat loop looks at the reconnect count: the first beat after a reconnect
# is what starts the workers' re-sends.
_RECONNECT_POLL_S = 0.1
# Resync requests closer together than this are one (each costs a resume query per stream).
RESYNC_MIN_GAP_S = 1.0


_IDLE = b"idle "


def idle_payload(request_ids: list[str]) -> bytes:
    """The message listing a caller's silent streams (request ids are subject tokens)."""
    return _IDLE + " ".join(request_ids).encode()


def idle_request_ids(payload: bytes) -> list[str] | None:
    """The ids an idle message lists (at most :data:`IDLE_LIST_MAX`, valid ones only);
    None for a payload that is no idle message (a beat)."""
    if not payload.startswith(_IDLE):
        return None
    ids = payload[len(_IDLE) :].decode("ascii", "replace").split(" ", IDLE_LIST_MAX)
    return [rid for rid in ids[:IDLE_LIST_MAX] if is_subject_token(rid)]


def new_gateway_id() -> str:
    """Unique per process: a restarted gateway must not vouch for its predecessor's requests."""
    return f"gw-{uuid.uuid4().hex[:16]}"


class Heartbeat:
    def __init__(self, nc: Client, subjects: Subjects, gateway_id: str, interval_s: float) -> None:
        self._nc = nc
        self._subject = subjects.gateway_heartbeat(gateway_id)
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None
        self._told = 0  # the count of the latest beat
        self._resyncs = 0  # asked for without a reconnect (request_resync)
        self._resync_at = float("-inf")
        # The caller's streams silent for a while, listed after each beat (module docstring).
        self.idle_streams: Callable[[], list[str]] | None = None

    def request_resync(self) -> None:
        """Have every worker re-send this caller's streams past what it holds (chunks may
        have been lost without a reconnect); at most once per :data:`RESYNC_MIN_GAP_S`."""
        now = time.monotonic()
        if now - self._resync_at >= RESYNC_MIN_GAP_S:
            self._resync_at = now
            self._resyncs += 1
            log.warning("chunks may have been lost: asking the workers to resync")

    async def start(self, on_failure: Callable[[str], None] | None = None) -> None:
        """Beat now, then every interval (``on_failure``: told if the loop dies)."""
        await self._beat()  # workers hear of us before our first request reaches them
        self._task = asyncio.create_task(self._run(), name="gateway-heartbeat")
        if on_failure is not None:
            watch(self._task, on_failure)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], what="gateway heartbeat")
            self._task = None

    async def _run(self) -> None:
        poll = min(self._interval, _RECONNECT_POLL_S)
        last = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(poll)
            if not self._nc.is_connected:
                continue  # see the module docstring: a buffered beat would arrive stale
            now = asyncio.get_running_loop().time()
            if now - last >= self._interval or self._reconnects() != self._told:
                await self._beat()
                last = now

    def _reconnects(self) -> int:
        """What a beat carries: reconnects, plus resyncs asked for (either change is news)."""
        return int(self._nc.stats.get("reconnects", 0)) + self._resyncs

    async def _beat(self) -> None:
        count = self._reconnects()
        self._told = count  # the count workers last heard (sent or not: retried on change)
        idle = self.idle_streams() if self.idle_streams is not None else []
        try:
            await self._nc.publish(self._subject, heartbeat_payload(count))
            if idle:
                await self._nc.publish(self._subject, idle_payload(idle))
        except Exception as exc:  # reconnecting: the next beat goes out once it is back
            log.debug("heartbeat not sent: %s", exc)
