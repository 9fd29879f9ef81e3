"""A final chunk lost with nothing after it: the caller lists the stream as silent, and the
worker that finished it re-sends the ending (``common/idle_streams.py``, ``workers.resync``).

Against a real nats-server: a worker on the sim engine whose final chunk is dropped on
its way out (the loss a route flap or a slow consumer's overflow makes), and the NATS-native
client, whose heartbeat lists its silent streams as a gateway's does.
"""

from __future__ import annotations

import time
from typing import Any

from nats.aio.client import Client

from common.client import QosClient
from common.heartbeat import idle_payload, idle_request_ids
from common.idle_streams import IdleStreams
from common.protocol import Chunk, GenerateRequest, RequestParams, ResumeReply, heartbeat_reconnects
from common.subjects import Subjects
from tests.workers.conftest import expected_tokens, new_id
from workers.outbox import Flight
from workers.resync import Resync


def test_silent_streams_are_listed_most_recently_heard_first_up_to_the_limit() -> None:
    now = [100.0]
    idle = IdleStreams(clock=lambda: now[0])
    for i, rid in enumerate(("a", "b", "c", "d")):
        now[0] = 100.0 + i
        idle.heard(rid)
    now[0] = 105.5  # a: 5.5 s silent, b 4.5, c 3.5, d 2.5
    assert idle.idle(min_s=3.0) == ["c", "b", "a"]
    assert idle.idle(min_s=3.0, limit=2) == ["c", "b"]
    idle.heard("a")  # a chunk came
    idle.forget("b")  # its stream ended
    assert idle.idle(min_s=3.0) == ["c"] and len(idle) == 3


def test_an_idle_message_is_no_beat_to_a_worker_of_any_release() -> None:
    payload = idle_payload(["r-1", "r_2"])
    assert idle_request_ids(payload) == ["r-1", "r_2"]
    assert heartbeat_reconnects(payload) is None  # an older worker: alive, no news
    assert idle_request_ids(b"12") is None  # a beat
    assert idle_request_ids(b"idle a.b * ok") == ["ok"]  # no subject token: dropped


def _flight(rid: str, origin: str, subjects: Subjects) -> Flight:
    req = GenerateRequest(id=rid, group="short", reply=subjects.out(rid), origin=origin)
    st = Flight(req, msg=None, attempt=1, start=0.0)
    st.sent_chunks = [
        Chunk(id=rid, seq=0, token_ids=[4, 5]),
        Chunk(id=rid, seq=2, token_ids=[6], finish_reason="length"),
    ]
    return st


async def test_a_worker_resyncs_only_what_it_finished_for_that_caller(
    nc: Client, subjects: Subjects
) -> None:
    """A stream merely slow (still running here, or never here, or another caller's)
    costs nothing; a finished one is asked about once, its ending re-sent."""
    resync = Resync(subjects, "w0", 1 << 20, timeout_s=0.5, window_s=2.0)
    done, other = _flight(new_id(), "gw-a", subjects), _flight(new_id(), "gw-b", subjects)
    resync.finished(done)
    resync.finished(other)
    asked: list[str] = []

    async def answer(msg: Any) -> None:  # the caller has the first two tokens
        rid = msg.subject.rsplit(".", 1)[-1]
        asked.append(rid)
        await msg.respond(ResumeReply(id=rid, token_ids=[4, 5]).to_bytes())

    for st in (done, other):
        await nc.subscribe(subjects.resume(st.request.id), cb=answer)
    resent = await nc.subscribe(subjects.out(done.request.id))
    resync.idle_at_caller(nc, "gw-a", [done.request.id, other.request.id, "running-one"])
    chunk = Chunk.from_bytes((await resent.next_msg(timeout=5)).data)
    assert chunk.finish_reason == "length" and chunk.seq == 2
    resync.idle_at_caller(nc, "gw-a", [done.request.id])  # the next beat: not again so soon
    await nc.flush()
    assert asked == [done.request.id]


async def test_a_client_whose_final_chunk_is_lost_gets_it_in_seconds_not_at_its_deadline(
    start_worker: Any, client: QosClient
) -> None:
    service = await start_worker()
    assert service.nc is not None
    publish = service.nc.publish
    dropped: list[Chunk] = []

    out = f"{service.subjects.prefix}.out."

    async def lose_the_first_ending(subject: str, payload: bytes = b"", *a: Any, **kw: Any) -> None:
        if subject.startswith(out) and not dropped:
            chunk = Chunk.from_bytes(payload)
            if chunk.finish_reason is not None:
                dropped.append(chunk)
                return
        await publish(subject, payload, *a, **kw)

    service.nc.publish = lose_the_first_ending  # type: ignore[method-assign]
    started = time.monotonic()
    got: list[int] = []
    async for chunk in client.generate(
        group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=5),
        timeout_s=60,
    ):  # fmt: skip
        got += chunk.token_ids
        final = chunk
    waited = time.monotonic() - started
    assert dropped and final.finish_reason == "length"
    assert got == expected_tokens(2, 5)
    assert waited < 8  # the silence listed after ~2 s, not the 60 s deadline
