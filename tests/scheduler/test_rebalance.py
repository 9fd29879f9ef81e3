"""A backlog on `long` while `short` idles: an idle short replica moves over, nothing is lost."""

from __future__ import annotations

import asyncio
import json

from common.protocol import RequestParams
from tests.scheduler.conftest import until
from workers.sim import SimCost

SLOW_LONG = SimCost(base_s=0.1, prefill_s_per_token=0.0, decode_s_per_seq=0.0)  # 1 s a request


async def test_backlog_moves_an_idle_replica_and_drains_with_nothing_lost(
    start_worker, start_scheduler, client, observer
):
    short = [await start_worker("s1"), await start_worker("s2")]
    long = await start_worker("l1", group="long", cost=SLOW_LONG)
    sched = await start_scheduler("sched")
    await until(lambda: sched.windows.replicas("short") == 2, 5, "short reporting")
    await until(lambda: sched.windows.replicas("long") == 1, 5, "long reporting")

    async def one(i: int) -> int:
        ids, _, _ = await client.collect(
            group="long", prompt_token_ids=[1, 2, 3], params=RequestParams(max_tokens=10, seed=i),
            timeout_s=60,
        )  # fmt: skip
        return len(ids)

    requests = [asyncio.create_task(one(i)) for i in range(14)]  # 7 s of work for one replica
    await until(lambda: len(sched.moves) == 1, 8, "a move")
    move = sched.moves[0]
    assert (move.src, move.dst) == ("short", "long") and move.worker in ("s1", "s2")
    assigns = [(s, c.group) for s, c in observer.controls if c.action == "assign_group"]
    assert len(assigns) == 1 and assigns[0][1] == "long"
    assert assigns[0][0].endswith(f".ctl.{move.worker}")
    moved = next(w for w in short if w.worker_id == move.worker)
    await until(lambda: moved.group == "long", 5, "the worker to switch consumer")
    assert moved.bridge.batch_cap == 2  # the new group's batch limit

    results = await asyncio.wait_for(asyncio.gather(*requests), 30)
    assert results == [10] * 14
    assert len(long.telemetry.e2e.values()) + len(moved.telemetry.e2e.values()) == 14
    assert len(moved.telemetry.e2e.values()) > 0  # the moved replica took part of the backlog
    assert len(sched.moves) == 1  # short is at its minimum of 1 now
    assert sched.windows.replicas("short") >= 1
    desired = json.loads((await observer.kv.get("desired.long")).value)
    assert desired["replicas"] >= 2
