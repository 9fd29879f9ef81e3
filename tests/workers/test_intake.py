"""The intake's fetch loop on its own: it sends no pull while NATS is unreachable (nats-py
would buffer each one and send them all at the reconnect, grabbing a burst of the backlog)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats.errors

from workers.intake import Intake


class CountingPulls:
    """A pull subscription whose every fetch times out, counting them."""

    pending_msgs = 0

    def __init__(self) -> None:
        self.fetches = 0

    async def fetch(self, batch: int, timeout: float) -> list[Any]:
        self.fetches += 1
        await asyncio.sleep(timeout)
        raise nats.errors.TimeoutError


async def test_no_pull_goes_out_while_disconnected_and_pulls_resume_after() -> None:
    pulls = CountingPulls()
    connected = [False]
    intake = Intake(
        pulls,  # type: ignore[arg-type]
        ready=lambda: True,
        accept=lambda msg: None,
        fetch_timeout_s=0.02,
        connected=lambda: connected[0],
    )
    intake.start()
    try:
        await asyncio.sleep(0.3)
        assert pulls.fetches == 0  # without the check: one pull per fetch timeout, ~15
        connected[0] = True
        deadline = time.monotonic() + 5
        while pulls.fetches <= 3:  # and they resume
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        await intake.halt()


async def _pull_subscription(nats_config: Any, js: Any, name: str) -> tuple[Any, str]:
    """A stream of its own and a pull subscription to it; (subscription, subject)."""
    subject = f"{nats_config.subject_prefix}.{name}"
    await js.add_stream(name=nats_config.stream, subjects=[subject])
    return await js.pull_subscribe(subject, durable=name, stream=nats_config.stream), subject


async def _arrives_late(js: Any, psub: Any, subject: str) -> None:
    """A request answering a pull after its fetch returned: a pull of our own, delivered to
    the subscription's inbox, lands in its local queue."""
    await js._nc.publish(psub._nms, b'{"batch": 1, "expires": 2000000000}', reply=psub._deliver)
    await js.publish(subject, b"request")


async def test_a_message_landing_after_its_fetch_is_handed_back_while_not_ready(
    nats_config: Any, js: Any
) -> None:
    """A long-poll answered right at its expiry lands in the local queue after fetch()
    returned. While the intake was not ready (drained, capped) nothing read that queue: the
    message sat unacknowledged until ack_wait redelivered it elsewhere, and once ready
    again this replica served its stale copy too."""
    psub, subject = await _pull_subscription(nats_config, js, "late")
    handed_back: list[bytes] = []

    async def hand_back(msg: Any) -> None:
        handed_back.append(msg.data)
        await msg.nak()

    intake = Intake(psub, ready=lambda: False, accept=lambda msg: None, hand_back=hand_back,
                    fetch_timeout_s=0.2)  # fmt: skip
    intake.start()
    try:
        await _arrives_late(js, psub, subject)
        deadline = time.monotonic() + 5
        while not handed_back:
            assert time.monotonic() < deadline, "the late message was never handed back"
            await asyncio.sleep(0.02)
        assert handed_back == [b"request"]
    finally:
        await intake.halt()


async def test_a_message_landing_while_the_replica_is_only_full_is_taken_not_handed_back(
    nats_config: Any, js: Any
) -> None:
    """Handed back at once while merely full (not draining), a late message cost a delivery
    and a resume round trip, and on its last delivery a 503; left in the local queue, nothing
    sent in_progress for it. It is taken, one over the cap (the engine queues it)."""
    psub, subject = await _pull_subscription(nats_config, js, "full")
    handed_back: list[bytes] = []
    accepted: list[bytes] = []

    async def hand_back(msg: Any) -> None:
        handed_back.append(msg.data)
        await msg.nak()

    intake = Intake(psub, ready=lambda: False, accept=lambda msg: accepted.append(msg.data),
                    hand_back=hand_back, fetch_timeout_s=0.2, draining=lambda: False)  # fmt: skip
    intake.start()
    try:
        await _arrives_late(js, psub, subject)
        deadline = time.monotonic() + 5
        while not accepted:
            assert time.monotonic() < deadline, "the late message was never taken"
            await asyncio.sleep(0.02)
        assert accepted == [b"request"] and handed_back == []
    finally:
        await intake.halt()
