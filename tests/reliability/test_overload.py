"""Overload: twice the capacity offered, as an open loop.

The sim worker's steps cost a fixed 20 ms, so capacity is known: a batch of 4 and 10
tokens a request is 4 / 0.2 s = 20 requests/s. Offered 40/s, the gateway must shed what it
cannot admit (429 with ``Retry-After``), serve what it admits in turn behind no more than
its queue cap (``max_pending``), keep its queues capped while the burst lasts, and serve a
normal request once the burst is over, every slot given back.

Counts and orders, not seconds: how fast a loaded CI machine runs this says nothing about
the gateway (the benchmarks measure speed).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from common.services import NatsServer
from common.tokenizer import BaseTokenizer
from tests.reliability.conftest import StackFactory
from tests.reliability.harness import Outcome, body, completion, expected_text, group
from tests.reliability.test_nats_restart import queued_messages

STEP_S = 0.02
BATCH = 4
MAX_TOKENS = 10
MAX_PENDING = 16
CAPACITY_RPS = BATCH / (MAX_TOKENS * STEP_S)  # 20
OFFERED_RPS = 2 * CAPACITY_RPS
BURST_S = 5.0
ARRIVALS = int(BURST_S * OFFERED_RPS)


async def test_twice_the_capacity_is_shed_with_429_admitted_requests_are_served_in_turn_and_it_recovers(
    private_nats: NatsServer, make_stack: StackFactory, tokenizer: BaseTokenizer
) -> None:
    stack = make_stack(
        private_nats.url, {"short": group(BATCH, max_pending=MAX_PENDING)}, {"short": 1},
        step_s=STEP_S,
    )  # fmt: skip
    url = f"{stack.base_url}/completions"
    samples: list[tuple[int, int]] = []  # (gateway in flight, messages in the stream)
    outcomes: dict[int, Outcome] = {}  # by seed, which is the order they were sent in
    ended: list[int] = []  # seeds in the order their answers came

    async def one(http: httpx.AsyncClient, seed: int) -> None:
        outcomes[seed] = await completion(
            http, url, body(stack.model, seed, MAX_TOKENS, stream=False)
        )
        ended.append(seed)

    async def watch(http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            samples.append(
                (await in_flight(http), queued_messages(private_nats, stack.config.nats.stream))
            )
            await asyncio.sleep(0.1)

    async def in_flight(http: httpx.AsyncClient) -> int:
        health = (await http.get(f"{stack.url}/health")).json()
        return health["groups"]["short"]["in_flight"]

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        started = time.monotonic()
        watcher = asyncio.create_task(watch(http, started + BURST_S))
        tasks = []
        for i in range(ARRIVALS):  # open loop: arrivals do not wait
            tasks.append(asyncio.create_task(one(http, i)))
            await asyncio.sleep(max(0.0, started + (i + 1) / OFFERED_RPS - time.monotonic()))
        await asyncio.gather(*tasks)
        await watcher
        # Every slot given back once all answers are out (a leak would shrink the group's
        # queue for good). A deadline for the last releases, not a speed bound.
        deadline = time.monotonic() + 10
        while (left := await in_flight(http)) != 0:
            assert time.monotonic() < deadline, f"{left} slots never given back"
            await asyncio.sleep(0.05)
        after = await completion(http, url, body(stack.model, 10_000, MAX_TOKENS, stream=False))

    served = sorted(seed for seed, o in outcomes.items() if o.kind == "complete")
    shed = [o for o in outcomes.values() if o.kind == "error"]
    assert [o for o in outcomes.values() if o.kind == "lost"] == []
    assert shed and {o.status for o in shed} == {429}, {o.status for o in shed}
    assert all(o.code == "rate_limit_exceeded" and "retry-after" in o.headers for o in shed)
    for seed in served:
        assert outcomes[seed].text == expected_text(tokenizer, MAX_TOKENS, seed)
    # Admitted requests are served in turn: one waits behind at most the queue it joined,
    # so no request sent after it is answered before it, beyond that queue and a batch
    # (answers of one step come in any order; so may arrivals sent close together). A
    # request left waiting (starved, or lost until a redelivery) is overtaken by most.
    position = {seed: i for i, seed in enumerate(ended)}
    overtaken = {
        seed: sum(1 for later in served if later > seed and position[later] < position[seed])
        for seed in served
    }
    assert max(overtaken.values()) <= MAX_PENDING + BATCH, overtaken
    # Capacity was used, not shed away: the queue was refilled as it drained, to the end
    # of the burst (more served than one full queue and batch, some of the last quarter).
    assert len(served) > MAX_PENDING + BATCH, len(served)
    assert any(seed >= ARRIVALS * 3 // 4 for seed in served), served
    # Queues stayed capped the whole time.
    assert samples and max(f for f, _ in samples) <= MAX_PENDING
    assert max(q for _, q in samples) <= MAX_PENDING
    assert after.kind == "complete" and after.text == expected_text(tokenizer, MAX_TOKENS, 10_000)
