"""Replicas of one group: shared load, a crash mid-stream, a graceful SIGTERM drain."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from typing import Any

from nats.aio.client import Client

from common.client import QosClient
from common.protocol import Chunk, RequestParams, Telemetry
from common.subjects import Subjects
from tests.workers.conftest import expected_tokens
from workers.sim import SimCost, SimEngine

# A slow engine (30 ms a step) keeps requests in flight long enough to kill or stop.
SLOW = SimCost(base_s=0.03, prefill_s_per_token=0.0, decode_s_per_seq=0.0)
SLOW_FLAGS = (
    "--sim-base-ms",
    "30",
    "--sim-prefill-us-per-token",
    "0",
    "--sim-decode-us-per-seq",
    "0",
)


async def stream_all(
    client: QosClient, prompt: list[int], max_tokens: int, seed: int = 0
) -> list[Chunk]:
    params = RequestParams(max_tokens=max_tokens, seed=seed)
    return [
        c
        async for c in client.generate(
            group="short", prompt_token_ids=prompt, params=params, timeout_s=30
        )
    ]


def tokens(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def wait_serving(
    nc: Client, subjects: Subjects, worker_id: str, timeout_s: float = 30
) -> None:
    """Until the worker's telemetry says it serves (a child takes seconds to import torch)."""
    sub = await nc.subscribe(subjects.telemetry("short", worker_id))
    try:
        while Telemetry.from_bytes((await sub.next_msg(timeout=timeout_s)).data).state != "serving":
            pass
    finally:
        await sub.unsubscribe()


async def test_two_replicas_share_a_groups_load_and_serve_each_request_once(
    start_worker: Any, client: QosClient
) -> None:
    for name in ("a", "b"):
        await start_worker(engine=SimEngine(max_batch_size=4, cost=SLOW), worker_id=name)
    prompts = [[i + 1, i + 2] for i in range(12)]
    results = await asyncio.gather(
        *(stream_all(client, p, 8, seed=i) for i, p in enumerate(prompts))
    )
    served_by = Counter()
    for i, chunks in enumerate(results):
        assert tokens(chunks) == expected_tokens(2, 8, seed=i)
        assert {c.worker for c in chunks} in ({"a"}, {"b"}) and {c.attempt for c in chunks} == {1}
        served_by[chunks[0].worker] += 1
    assert served_by["a"] >= 2 and served_by["b"] >= 2, served_by


async def test_worker_crash_mid_stream_client_sees_every_token_once(
    spawn_worker: Any, start_worker: Any, client: QosClient, nc: Client, subjects: Subjects
) -> None:
    doomed = spawn_worker("doomed", *SLOW_FLAGS)
    await wait_serving(nc, subjects, "doomed")
    stream = client.generate(
        group="short",
        prompt_token_ids=[9, 9, 9],
        params=RequestParams(max_tokens=60, seed=11),
        timeout_s=30,
    )
    received: list[Chunk] = []
    async for chunk in stream:
        received.append(chunk)
        if len(tokens(received)) >= 10 and doomed.poll() is None:
            doomed.send_signal(signal.SIGKILL)  # no drain, no nak: only ack_wait brings it back
            doomed.wait()
            await start_worker(engine=SimEngine(max_batch_size=4, cost=SLOW), worker_id="heir")
    assert tokens(received) == expected_tokens(3, 60, seed=11)
    assert {c.worker for c in received} == {"doomed", "heir"}
    assert max(c.attempt for c in received) == 2
    assert received[-1].usage is not None and received[-1].usage.completion_tokens == 60


async def test_sigterm_drains_finishes_or_hands_back_in_flight_requests_and_loses_nothing(
    spawn_worker: Any, start_worker: Any, client: QosClient, nc: Client, subjects: Subjects
) -> None:
    leaving = spawn_worker("leaving", *SLOW_FLAGS, "--grace-s", "1")
    await wait_serving(nc, subjects, "leaving")
    tel = await nc.subscribe(subjects.telemetry("short", "leaving"))
    # Two finish within the grace period (10 steps), two need ~3 s and are handed back.
    plan = [(10, 1), (10, 2), (100, 3), (100, 4)]
    streams = [
        client.generate(
            group="short",
            prompt_token_ids=[s],
            params=RequestParams(max_tokens=n, seed=s),
            timeout_s=30,
        )
        for n, s in plan
    ]
    firsts = [await anext(s) for s in streams]  # all four are running on `leaving`
    assert {c.worker for c in firsts} == {"leaving"}
    await start_worker(engine=SimEngine(max_batch_size=4, cost=SLOW), worker_id="staying")
    leaving.send_signal(signal.SIGTERM)

    async def rest(first: Chunk, stream: Any) -> list[Chunk]:
        return [first] + [c async for c in stream]

    results = await asyncio.gather(*(rest(f, s) for f, s in zip(firsts, streams, strict=True)))
    for (n, seed), chunks in zip(plan, results, strict=True):
        assert tokens(chunks) == expected_tokens(1, n, seed=seed)
    assert {c.worker for c in results[0] + results[1]} == {"leaving"}
    assert {c.worker for c in results[2] + results[3]} == {"leaving", "staying"}
    assert await asyncio.to_thread(leaving.wait, 10) == 0
    states = []
    while not states or states[-1] != "stopped":
        states.append(Telemetry.from_bytes((await tel.next_msg(timeout=5)).data).state)
    assert states[-1] == "stopped" and "draining" in states
