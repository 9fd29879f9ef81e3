"""A slow state bucket must not silence a worker: its reports keep their rhythm."""

from __future__ import annotations

import asyncio
import json
import time

from nats.js.kv import KeyValue

from common.subjects import HEARTBEAT_KEY_PREFIX
from tests.scheduler.conftest import until


class SlowBucket:
    """The worker's real state bucket, each write held 3 s first (a JetStream leader
    election, a full disk): the worker's heartbeat writes are all it is asked for here."""

    def __init__(self, real: KeyValue) -> None:
        self.real = real
        self.puts = 0
        self.landed = 0
        self.pending = 0
        self.most_pending = 0

    async def put(self, key: str, value: bytes) -> int:
        self.puts += 1
        self.pending += 1
        self.most_pending = max(self.most_pending, self.pending)
        try:
            await asyncio.sleep(3.0)
            revision = await self.real.put(key, value)
        finally:
            self.pending -= 1
        self.landed += 1
        return revision

    async def purge(self, key: str) -> None:
        await self.real.purge(key)


async def test_a_worker_whose_heartbeat_bucket_is_slow_stays_known_to_the_scheduler(
    start_worker, start_scheduler
):
    """Each round awaited its heartbeat write: 3 s writes made 3 s silences, past
    worker_silent_s (1.5 s), and the scheduler forgot a replica that served all along."""
    worker = await start_worker("w1")
    sched = await start_scheduler("sched")
    await until(lambda: "w1" in sched.windows.worker_ids(), 5, "w1 reporting")
    assert worker.kv is not None
    key = HEARTBEAT_KEY_PREFIX + "w1"
    before = json.loads((await worker.kv.get(key)).value)["ts_ms"]
    bucket = SlowBucket(worker.kv)
    worker.kv = bucket  # type: ignore[assignment]
    started = time.monotonic()
    while time.monotonic() - started < 3.5:  # past the first write's end
        assert "w1" in sched.windows.worker_ids(), f"forgotten {time.monotonic() - started:.1f}s in"
        await asyncio.sleep(0.1)
    # Still written, one write at a time: rounds skip theirs rather than queue them.
    await until(lambda: bucket.landed >= 1 and bucket.puts >= 2, 3, "the next heartbeat write")
    assert bucket.most_pending == 1
    assert json.loads((await bucket.real.get(key)).value)["ts_ms"] > before  # it landed
