"""The gateway puts the request stream and the group consumers back when they go missing.

Every service makes sure they exist when it starts, but they can go while the deployment
runs: an operator's ``nats consumer rm`` or ``nats stream rm``, a NATS server that lost
its store. Workers then fetch from nothing, and every request waits out its deadline
until some service restarts. The gateway looks every ``gateway.jetstream_check_s`` and
recreates what is gone, where its NATS user may: under ``deploy/nats/permissions.conf``
no service may (whoever can create a consumer on the request stream can read its
prompts), and each look logs what is missing until ``qosserve provision`` runs again. Workers need no help: a pull names its consumer, so their next fetch reaches
the new one. What the stream held when it was deleted is lost with it; the gateway fails
those requests as their deadlines pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from common.config import NatsConfig
from common.nats import ensure_group_consumer, ensure_stream
from common.subjects import Subjects
from common.tasks import cancel_and_wait, watch

log = logging.getLogger(__name__)

# How far past the highest sequence seen a recreated stream starts: what this gateway saw
# may be a check old, and other gateways and NATS clients were handed numbers since.
# Skipped numbers cost nothing.
SEQ_GAP = 1_000_000


class StreamKeeper:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        cfg: NatsConfig,
        groups: Sequence[str],
        interval_s: float,
        held_seq: Callable[[], int] = lambda: 0,
        on_replaced: Callable[[], None] = lambda: None,
    ) -> None:
        """``held_seq``: the highest sequence this gateway's open requests hold;
        ``on_replaced``: called when the stream is found replaced (see :meth:`check`)."""
        self._nc, self._js, self._cfg = nc, js, cfg
        self._held_seq = held_seq
        self._on_replaced = on_replaced
        # When the stream seen last was created: another one under the name is a new stream
        # (another service made it again, perhaps numbering from 1, before this one looked).
        self._created: object = None
        self._groups = list(groups)
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None
        # The stream's last sequence when last seen: a recreated stream numbers on from it.
        # Callers hold requests by their sequence (to delete one they abort, to match a
        # MAX_DELIVERIES advisory); from 1 again, an old request's number would name a new one.
        self._last_seq = 0

    async def start(self, on_failure: Callable[[str], None] | None = None) -> None:
        self._task = asyncio.create_task(self._run(), name="gateway-stream-keeper")
        if on_failure is not None:
            watch(self._task, on_failure)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], what="gateway stream keeper")
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if not self._nc.is_connected:
                continue  # a NATS outage is not a deletion: ask again once back
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a slow server, a refusal: the next look may pass
                log.warning("checking the request stream and consumers failed: %r", exc)

    async def check(self) -> list[str]:
        """Recreate the stream and the consumers that are missing; returns what was."""
        cfg, put_back = self._cfg, []
        try:
            info = await self._js.stream_info(cfg.stream)
        except nats.js.errors.NotFoundError:
            # Gone: the sequences open requests hold name nothing now, whoever makes it
            # again (this gateway, another, `qosserve provision` numbering from 1), so they
            # are forgotten first, not once it is back: an abort meanwhile would delete a
            # new request under an old number.
            first = max(self._last_seq, self._held_seq()) + SEQ_GAP  # before they go
            self._created = None  # the next look learns the new one's
            self._on_replaced()
            # wait_s 0: not allowed to, it says so now; the next look tries again.
            await ensure_stream(self._js, cfg, self._groups, first_seq=first, wait_s=0)
            put_back.append(f"stream {cfg.stream}")
        else:
            self._last_seq = max(self._last_seq, info.state.last_seq)
            if self._created is not None and info.created != self._created:
                log.warning("%s was replaced by another service (deleted and created again): "
                            "requests it held are lost with it", cfg.stream)  # fmt: skip
                self._on_replaced()
            self._created = info.created
        for group in self._groups:
            name = Subjects.consumer(group)
            try:
                await self._js.consumer_info(cfg.stream, name)
            except nats.js.errors.NotFoundError:
                await ensure_group_consumer(self._js, cfg, group, wait_s=0)
                put_back.append(f"consumer {name}")
        if put_back:
            log.warning("recreated %s: deleted while the deployment ran (requests queued "
                        "in a deleted stream are lost with it)", ", ".join(put_back))  # fmt: skip
        return put_back
