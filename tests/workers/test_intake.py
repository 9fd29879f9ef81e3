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
