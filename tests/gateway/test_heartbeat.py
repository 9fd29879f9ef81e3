"""The gateway's heartbeat: nothing queued while cut off, the new count first when back."""

from __future__ import annotations

import asyncio

from common.heartbeat import Heartbeat
from common.subjects import Subjects


class FakeLink:
    """What the heartbeat reads of nats-py's client, and what it published.

    The beat loop looks at ``is_connected`` once a pass: :meth:`passes` waits for passes of
    the loop, not for time, so what a test expects after some passes does not depend on
    how promptly a loaded machine runs them."""

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.up = True
        self.sent: list[bytes] = []
        self._looks = 0
        self._looked = asyncio.Event()

    @property
    def is_connected(self) -> bool:
        self._looks += 1
        self._looked.set()
        return self.up

    async def publish(self, subject: str, payload: bytes) -> None:
        # nats-py queues a publish while reconnecting and sends it on reconnect.
        self.sent.append(payload)

    async def passes(self, n: int) -> None:
        """Return once the beat loop has made ``n`` more passes (each ends before this
        wakes: the loop looks, then beats or not, without yielding in between)."""
        until = self._looks + n
        while self._looks < until:
            self._looked.clear()
            await asyncio.wait_for(self._looked.wait(), 5)


async def test_no_beat_is_queued_while_the_link_is_down() -> None:
    link = FakeLink()
    beat = Heartbeat(link, Subjects(), "gw-a", interval_s=0.05)  # type: ignore[arg-type]
    await beat.start()
    try:
        await link.passes(4)
        assert link.sent and set(link.sent) == {b"0"}
        link.up = False
        cut_at = len(link.sent)
        await link.passes(6)  # six passes cut off: a beat would be due in each
        assert len(link.sent) == cut_at, "beats were queued while the link was down"
        link.stats["reconnects"] = 1
        link.up = True
        await link.passes(1)  # the first pass back beats the new count
        assert link.sent[cut_at:] == [b"1"]
        await link.passes(3)
        after = link.sent[cut_at:]
        assert after[0] == b"1" and set(after) == {b"1"}
    finally:
        await beat.stop()


async def test_a_resync_asked_for_is_beaten_at_once_as_a_new_count_at_most_once_a_second() -> None:
    """Chunks lost without a reconnect: the count a beat carries changes all the same, and
    workers resend what the gateway lacks; a burst of asks is one resync."""
    link = FakeLink()
    beat = Heartbeat(link, Subjects(), "gw-a", interval_s=30.0)  # type: ignore[arg-type]
    await beat.start()  # no beat due by time: each one below is for a new count
    try:
        assert link.sent == [b"0"]
        beat.request_resync()
        beat.request_resync()  # the same second: one resync
        await link.passes(1)
        assert link.sent == [b"0", b"1"]
        await link.passes(2)  # and no second one
        assert link.sent == [b"0", b"1"]
        link.stats["reconnects"] = 1  # a reconnect later: still a change
        await link.passes(1)
        assert link.sent == [b"0", b"1", b"2"]
    finally:
        await beat.stop()
