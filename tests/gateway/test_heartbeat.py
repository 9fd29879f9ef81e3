"""The gateway's heartbeat: nothing queued while cut off, the new count first when back."""

from __future__ import annotations

import asyncio

from common.heartbeat import Heartbeat
from common.subjects import Subjects


class FakeLink:
    """What the heartbeat reads of nats-py's client, and what it published."""

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.is_connected = True
        self.sent: list[bytes] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        # nats-py queues a publish while reconnecting and sends it on reconnect.
        self.sent.append(payload)


async def test_no_beat_is_queued_while_the_link_is_down() -> None:
    link = FakeLink()
    beat = Heartbeat(link, Subjects(), "gw-a", interval_s=0.05)  # type: ignore[arg-type]
    await beat.start()
    try:
        await asyncio.sleep(0.2)
        assert link.sent and set(link.sent) == {b"0"}
        link.is_connected = False
        cut_at = len(link.sent)
        await asyncio.sleep(0.3)  # six intervals cut off
        assert len(link.sent) == cut_at, "beats were queued while the link was down"
        link.stats["reconnects"] = 1
        link.is_connected = True
        await asyncio.sleep(0.15)  # within the reconnect poll (0.05 s here)
        after = link.sent[cut_at:]
        assert after and after[0] == b"1" and set(after) == {b"1"}
    finally:
        await beat.stop()


async def test_a_resync_asked_for_is_beaten_at_once_as_a_new_count_at_most_once_a_second() -> None:
    """Chunks lost without a reconnect: the count a beat carries changes all the same, and
    workers resend what the gateway lacks; a burst of asks is one resync."""
    link = FakeLink()
    beat = Heartbeat(link, Subjects(), "gw-a", interval_s=30.0)  # no beat due by time
    await beat.start()
    try:
        assert link.sent == [b"0"]
        beat.request_resync()
        beat.request_resync()  # the same second: one resync
        await asyncio.sleep(0.3)
        assert link.sent == [b"0", b"1"]
        link.stats["reconnects"] = 1  # a reconnect later: still a change
        await asyncio.sleep(0.3)
        assert link.sent == [b"0", b"1", b"2"]
    finally:
        await beat.stop()
