"""The scheduler across a NATS outage, fed synthetic telemetry (the wire format workers use)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import common.nats as qnats
from common.protocol import Telemetry
from common.subjects import Subjects
from tests.scheduler.conftest import make_config, until


async def test_breaker_state_survives_a_nats_outage_and_the_machine_carries_on(
    nats_config, fresh_nats_server, start_scheduler
):
    server = fresh_nats_server()
    config = make_config(nats_config.model_copy(update={"url": server.url}))
    sched = await start_scheduler("sched", config)
    nc = await qnats.connect(config.nats, "test-telemetry")
    kv = await qnats.ensure_kv(nc.jetstream(), config.nats)
    subject = Subjects(config.nats.subject_prefix).telemetry("short", "w1")
    p99 = {"now": 900.0}

    async def report() -> None:
        done = 0
        while True:
            done += 5
            message = Telemetry(worker="w1", group="short", ts_ms=int(time.time() * 1000),
                                running=1, batch_cap=8, requests_done=done, samples=50,
                                e2e_p99_ms=p99["now"])  # fmt: skip
            if nc.is_connected:  # not buffered for after the outage: stale by then
                await nc.publish(subject, message.to_bytes())
            await asyncio.sleep(0.2)

    reporter = asyncio.create_task(report())
    try:
        await until(lambda: sched.breakers["short"].state == "open", 10, "open")
        opened = json.loads((await kv.get("breaker.short")).value)
        assert opened["state"] == "open"

        server.stop()  # longer than wait_open_s and the lease TTL
        await asyncio.sleep(2.5)
        server.start()  # same port, same file store
        p99["now"] = 50.0
        await until(lambda: sched.is_leader, 10, "the lease again")
        # The transition and its record's turn to be written come in one step; the record
        # leaves the unsaved ones once its put succeeded (a fixed wait guessed when: a put
        # retried while NATS recovers takes longer). Then the bucket must say closed.
        await until(
            lambda: sched.breakers["short"].state == "closed" and "short" not in sched._unsaved,
            15, "closed, and its record written",
        )  # fmt: skip
        record = json.loads((await kv.get("breaker.short")).value)
        assert record["state"] == "closed" and record["batch_cap"] == 8
        history = [json.loads(e.value)["state"] for e in await kv.history("breaker.short")]
        assert history[0] == "open" and history[-1] == "closed" and "half_open" in history
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        await nc.close()
