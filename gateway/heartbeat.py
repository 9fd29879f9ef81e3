"""The gateway's heartbeat: an empty message on ``qos.gw.<gateway id>`` every interval.

Requests carry the gateway's id (``GenerateRequest.origin``); a worker that stops hearing
from a request's gateway aborts it, since the caller's connection went down with the
gateway and nobody will read the rest (``WorkerConfig.orphan_after_s``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from nats.aio.client import Client

from common.subjects import Subjects
from common.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def new_gateway_id() -> str:
    """Unique per process: a restarted gateway must not vouch for its predecessor's requests."""
    return f"gw-{uuid.uuid4().hex[:16]}"


class Heartbeat:
    def __init__(self, nc: Client, subjects: Subjects, gateway_id: str, interval_s: float) -> None:
        self._nc = nc
        self._subject = subjects.gateway_heartbeat(gateway_id)
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._beat()  # workers hear of us before our first request reaches them
        self._task = asyncio.create_task(self._run(), name="gateway-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], what="gateway heartbeat")
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._beat()

    async def _beat(self) -> None:
        try:
            await self._nc.publish(self._subject, b"")
        except Exception as exc:  # reconnecting: the next beat goes out once it is back
            log.debug("heartbeat not sent: %s", exc)
