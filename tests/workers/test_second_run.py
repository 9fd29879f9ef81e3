"""A worker told that its caller follows another worker's run of the same delivery stops
its own, unanswered and unacked (``Control.worker``; ``common/sequencer.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client

from common.config import Config
from common.protocol import Chunk, Control, RequestParams
from common.subjects import Subjects
from tests.workers.test_service import _queued, eventually
from workers.sim import SimCost, SimEngine


async def eventually_async(fetch: Any, check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check(await fetch()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_only_the_named_workers_run_of_that_delivery_stops(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.02))
    )
    rid, chunks = await _queued(
        nc, subjects, worker_config, prompt_token_ids=[1, 2], params=RequestParams(max_tokens=200)
    )
    await chunks.next_msg(timeout=5)

    def stop(worker: str, attempt: int) -> bytes:
        return Control(action="supersede", issued_ms=int(time.time() * 1000), group="short",
                       request_id=rid, attempt=attempt, worker=worker).to_bytes()  # fmt: skip

    await nc.publish(subjects.abort("short"), stop("someone-else", 1))
    await nc.publish(subjects.abort("short"), stop(service.worker_id, 2))  # not its delivery
    await nc.flush()
    assert Chunk.from_bytes((await chunks.next_msg(timeout=5)).data).finish_reason is None
    assert rid in service._inflight
    await nc.publish(subjects.abort("short"), stop(service.worker_id, 1))
    await eventually(lambda: rid not in service._inflight)
    # Stopped without a word: no final chunk (the caller ignores this run), no ack (the
    # message comes back as a later delivery if the followed run is gone).
    while True:
        try:
            chunk = Chunk.from_bytes((await chunks.next_msg(timeout=0.5)).data)
        except TimeoutError:
            break
        assert chunk.finish_reason is None
    info = await nc.jetstream().consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
    assert info.num_ack_pending == 1


async def test_a_run_of_another_message_with_the_id_is_terminated_not_left_to_come_back(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """The same id published twice (no Nats-Msg-Id): the run of the message its caller
    does not follow was left unacked, came back as a later delivery, resumed the request
    and superseded the healthy run, back and forth every ack_wait."""
    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.02))
    )
    rid, chunks = await _queued(
        nc, subjects, worker_config, prompt_token_ids=[1, 2], params=RequestParams(max_tokens=200)
    )
    await chunks.next_msg(timeout=5)
    own_seq = service._inflight[rid].msg.metadata.sequence.stream
    stop = Control(action="supersede", issued_ms=int(time.time() * 1000), group="short",
                   request_id=rid, attempt=1, worker=service.worker_id,
                   stream_seq=own_seq + 1000)  # fmt: skip
    await nc.publish(subjects.abort("short"), stop.to_bytes())
    await eventually(lambda: rid not in service._inflight)
    js = nc.jetstream()
    consumer = Subjects.consumer("short")
    await eventually_async(
        lambda: js.consumer_info(worker_config.nats.stream, consumer),
        lambda info: info.num_ack_pending == 0 and info.num_pending == 0,
        timeout_s=1.0,  # settled by the stop, not by a redelivery after ack_wait (2 s here)
    )
