"""One worker replica over a real nats-server: streaming, rejections, control, telemetry."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import struct
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgpack
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

import common.nats as qnats
from common.client import QosClient
from common.config import Config
from common.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from common.protocol import (
    Chunk,
    Control,
    GenerateRequest,
    RequestParams,
    ResumeQuery,
    ResumeReply,
    Telemetry,
)
from common.subjects import Subjects
from common.tokenizer import ByteTokenizer
from tests.workers.conftest import expected_tokens, new_id
from workers import bridge as bridge_module
from workers import service as worker_service
from workers.sim import SimCost, SimEngine


async def eventually(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def read_until_final(sub: Any, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Chunk maps up to the final one, decoded by hand (as the contract describes them)."""
    out: list[dict[str, Any]] = []
    while not out or "finish_reason" not in out[-1]:
        msg = await sub.next_msg(timeout=timeout_s)
        out.append(msgpack.unpackb(msg.data, raw=False))
    return out


def i32(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}i", data))


async def test_round_trip_streams_every_token_with_seq_usage_and_finish_reason(
    start_worker: Any, client: QosClient
) -> None:
    await start_worker()
    chunks = [
        c
        async for c in client.generate(
            group="short",
            prompt_token_ids=[1, 2, 3, 4],
            params=RequestParams(max_tokens=30, seed=5),
        )
    ]
    assert len(chunks[0].token_ids) == 1  # the first token goes out alone, at once
    seen = 0
    for c in chunks:
        assert c.seq == seen and c.attempt == 1 and c.worker == "w0"
        seen += len(c.token_ids)
    final = chunks[-1]
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(4, 30, seed=5)
    assert final.finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (4, 30)


async def test_a_raw_msgpack_request_written_from_the_contract_gets_an_answer(
    start_worker: Any, nc: Client, subjects: Subjects
) -> None:
    await start_worker()
    rid = new_id()
    p = subjects.prefix
    sub = await nc.subscribe(f"{p}.out.{rid}")
    request = {
        "v": 1,
        "id": rid,
        "group": "short",
        "reply": f"{p}.out.{rid}",
        "prompt_token_ids": struct.pack("<3i", 7, 8, 9),
        "params": {"max_tokens": 6, "seed": 3, "temperature": 0},
        "deadline_ms": int(time.time() * 1000) + 10_000,
    }
    await nc.jetstream().publish(
        f"{p}.req.short", msgpack.packb(request), headers={"Nats-Msg-Id": rid}
    )
    chunks = await read_until_final(sub)
    assert [t for c in chunks for t in i32(c["token_ids"])] == expected_tokens(3, 6, seed=3)
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "cached_tokens": 0}
    assert all(c["v"] == 1 and c["id"] == rid for c in chunks)


async def test_a_malformed_request_gets_an_error_chunk_is_terminated_and_the_worker_keeps_serving(
    start_worker: Any, nc: Client, client: QosClient, subjects: Subjects, worker_config: Config
) -> None:
    await start_worker()
    js = nc.jetstream()
    rid = new_id()
    sub = await nc.subscribe(subjects.out(rid))
    bad = {
        "v": 1,
        "id": rid,
        "group": "short",
        "reply": subjects.out(rid),
        "prompt": "x",
        "oops": 1,
    }
    await js.publish(subjects.request("short"), msgpack.packb(bad))
    await js.publish(subjects.request("short"), b"\xc1 not msgpack at all")
    (error,) = await read_until_final(sub)
    assert error["finish_reason"] == "error" and error["error"]["code"] == "protocol_error"
    assert "oops" in error["error"]["message"]
    ids, _, final = await client.collect(
        group="short", prompt_token_ids=[1], params=RequestParams(max_tokens=3)
    )
    assert ids == expected_tokens(1, 3) and final.finish_reason == "length"
    # The worker acks after the final chunk, so the last ack may trail the answer a moment.
    deadline = time.monotonic() + 5.0
    while True:
        info = await js.consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
        if info.num_ack_pending == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    # Terminated, not redelivered:
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)


async def test_a_malformed_request_is_answered_on_its_own_out_subject_whatever_it_names(
    start_worker: Any, nc: Client, subjects: Subjects
) -> None:
    """Without ``reply`` (derivable from the id, so easily left out), with a string that is
    not UTF-8, or with an integer map key, the lenient re-decode failed too: the message
    was terminated and its caller, on P.out.<id> already, heard nothing."""
    await start_worker()
    js = nc.jetstream()
    cases = {
        "no reply": lambda rid: msgpack.packb({"v": 1, "id": rid, "group": "short", "prompt": "x"}),
        "bad utf-8": lambda rid: msgpack.packb(
            {"v": 1, "id": rid, "group": "short", "reply": subjects.out(rid), "prompt": "x",
             "model": b"\xff\xfe"}, use_bin_type=False),
        "int key": lambda rid: msgpack.packb(
            {"v": 1, "id": rid, "group": "short", "reply": subjects.out(rid), "prompt": "x",
             "params": {1: 2}}),
        "elsewhere": lambda rid: msgpack.packb(
            {"v": 1, "id": rid, "group": "short", "reply": "qos.out.other", "prompt": "x",
             "oops": 1}),
    }  # fmt: skip
    for name, build in cases.items():
        rid = new_id()
        sub = await nc.subscribe(subjects.out(rid))
        await js.publish(subjects.request("short"), build(rid))
        (error,) = await read_until_final(sub)
        assert error["finish_reason"] == "error", name
        assert error["error"]["code"] == "protocol_error", name
        assert error["id"] == rid, name
        await sub.unsubscribe()


async def test_a_request_past_its_deadline_gets_deadline_exceeded(
    start_worker: Any, nc: Client, subjects: Subjects
) -> None:
    await start_worker()
    rid = new_id()
    sub = await nc.subscribe(subjects.out(rid))
    request = {
        "v": 1,
        "id": rid,
        "group": "short",
        "reply": subjects.out(rid),
        "prompt": "late",
        "deadline_ms": int(time.time() * 1000) - 1000,
    }
    await nc.jetstream().publish(subjects.request("short"), msgpack.packb(request))
    (error,) = await read_until_final(sub)
    assert error["error"]["code"] == "deadline_exceeded" and error["finish_reason"] == "error"


async def test_a_deadline_passing_while_generating_stops_the_request_with_deadline_exceeded(
    start_worker: Any, nc: Client, subjects: Subjects
) -> None:
    service = await start_worker(engine=SimEngine(cost=SimCost(base_s=0.02)))
    rid = new_id()
    sub = await nc.subscribe(subjects.out(rid))
    request = {
        "v": 1,
        "id": rid,
        "group": "short",
        "reply": subjects.out(rid),
        "prompt": "slow",
        "params": {"max_tokens": 500},
        "deadline_ms": int(time.time() * 1000) + 300,
    }
    await nc.jetstream().publish(subjects.request("short"), msgpack.packb(request))
    chunks = await read_until_final(sub)
    assert chunks[-1]["error"]["code"] == "deadline_exceeded" and len(chunks) > 1
    await eventually(lambda: service.bridge.stats.num_running == 0)


async def test_tokens_are_coalesced_but_the_first_goes_out_alone(
    start_worker: Any, client: QosClient, worker_config: Config
) -> None:
    config = worker_config.model_copy(
        update={"worker": worker_config.worker.model_copy(update={"coalesce_ms": 50.0})}
    )
    await start_worker(engine=SimEngine(cost=SimCost(base_s=0.005)), config=config)
    params = RequestParams(max_tokens=40)
    chunks = [c async for c in client.generate(group="short", prompt="hi", params=params)]
    assert len(chunks[0].token_ids) == 1
    assert sum(len(c.token_ids) for c in chunks) == 40 and len(chunks) <= 12


class StallingSim(SimEngine):
    """A sim engine whose fourth step takes ``stall_s``: the engine goes quiet mid-stream."""

    def __init__(self, stall_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stall_s = stall_s

    def step(self) -> Any:
        if self.num_steps == 3 and self.stall_s:
            stall, self.stall_s = self.stall_s, 0.0
            time.sleep(stall)
        return super().step()


async def test_held_tokens_go_out_when_their_window_ends_though_the_engine_goes_quiet(
    start_worker: Any, client: QosClient, worker_config: Config
) -> None:
    config = worker_config.model_copy(
        # 300 ms: token 3 must cross from the engine thread inside the window (at 30 ms a
        # descheduled thread on a loaded machine split the chunk), and the window still ends
        # well before the 1.5 s stall.
        update={"worker": worker_config.worker.model_copy(update={"coalesce_ms": 300.0})}
    )
    await start_worker(engine=StallingSim(1.5, cost=SimCost(base_s=0.001)), config=config)
    params = RequestParams(max_tokens=6, ignore_eos=True)
    arrived: list[tuple[float, int]] = []
    async for c in client.generate(group="short", prompt_token_ids=[1, 2], params=params):
        arrived.append((time.monotonic(), len(c.token_ids)))
    assert [n for _, n in arrived[:2]] == [1, 2]  # the first token alone, then steps 2-3 held
    assert arrived[1][0] - arrived[0][0] < 0.75  # sent when the window ended, not after the stall
    # The rest came after the stall (less the first chunk's delivery time, under load).
    assert arrived[-1][0] - arrived[0][0] >= 1.4 and sum(n for _, n in arrived) == 6


@pytest.mark.parametrize("checks", ["working", "failing"])
async def test_in_progress_keeps_a_request_longer_than_ack_wait_from_redelivering(
    start_worker: Any, client: QosClient, worker_config: Config, checks: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Also when the tick's other checks fail on every tick (a bug in one of them): the
    in_progress heartbeats must not stop with them."""
    assert worker_config.nats.ack_wait_s == 2.0
    if checks == "failing":

        async def broken(self: Any) -> None:
            raise RuntimeError("a bug in a check")

        monkeypatch.setattr(worker_service.WorkerService, "_tick_checks", broken)
    await start_worker(engine=SimEngine(cost=SimCost(base_s=0.025)))
    params = RequestParams(max_tokens=110, seed=1)
    started = time.monotonic()
    chunks = [c async for c in client.generate(group="short", prompt_token_ids=[4], params=params)]
    assert time.monotonic() - started > 2.5  # outlived ack_wait
    assert {c.attempt for c in chunks} == {1}
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(1, 110, seed=1)


async def test_a_prompt_too_long_for_the_engine_raises_context_length_exceeded(
    start_worker: Any, client: QosClient
) -> None:
    await start_worker()  # the sim engine's max_seq_len is 256
    with pytest.raises(ContextLengthExceededError):
        await client.collect(group="short", prompt_token_ids=[1] * 300)


class PoisonedSim(SimEngine):
    """Fails every step once a request whose prompt starts with 666 has 3 tokens."""

    def step(self) -> list[Any]:
        if any(r.prompt_token_ids[0] == 666 and len(r.output_token_ids) >= 3 for r in self.running):
            raise RuntimeError("simulated kernel failure")
        return super().step()


async def test_an_engine_exception_fails_only_the_affected_request(
    start_worker: Any, client: QosClient
) -> None:
    # Batch 1: the request queued behind the failing one is not in the failed step.
    engine = PoisonedSim(max_batch_size=1, cost=SimCost(base_s=0.05))
    await start_worker(engine=engine)
    poisoned = client.generate(group="short", prompt_token_ids=[666, 1])
    await anext(poisoned)  # it runs
    queued = asyncio.ensure_future(
        client.collect(group="short", prompt_token_ids=[2], params=RequestParams(max_tokens=3))
    )
    with pytest.raises(InternalError, match="engine step failed") as failed:
        async for _ in poisoned:
            pass
    assert "simulated kernel failure" not in str(failed.value)  # the text stays in the log
    ids, _, _ = await queued
    assert ids == expected_tokens(1, 3)
    ids, _, _ = await client.collect(
        group="short", prompt_token_ids=[5, 6], params=RequestParams(max_tokens=2)
    )
    assert ids == expected_tokens(2, 2)


async def test_output_the_worker_fails_to_handle_ends_its_request_with_an_internal_error(
    start_worker: Any, client: QosClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception handling one request's output (a bug) was only logged: the request
    went on missing what was lost (or, on its final delta, stayed in flight until its
    deadline, for good without one, its slot held)."""
    from workers.outbox import Flight

    service = await start_worker(engine=SimEngine(max_batch_size=4, cost=SimCost(base_s=0.05)))
    real, broken = Flight.absorb, [True]

    def absorb_once_broken(self: Flight, delta: Any) -> None:
        if broken and broken.pop():
            raise RuntimeError("a bug handling output")
        real(self, delta)

    monkeypatch.setattr(Flight, "absorb", absorb_once_broken)
    with pytest.raises(InternalError, match="handling this request's output"):
        await client.collect(group="short", prompt_token_ids=[3, 4],
                             params=RequestParams(max_tokens=6), timeout_s=10)  # fmt: skip
    await eventually(lambda: not service.engine.has_unfinished())  # stopped in the engine
    assert service.state == "serving" and not service.inflight_ids
    ids, _, _ = await client.collect(
        group="short", prompt_token_ids=[5, 6], params=RequestParams(max_tokens=2)
    )
    assert ids == expected_tokens(2, 2)


async def test_control_caps_the_batch_drains_and_resumes(
    start_worker: Any,
    client: QosClient,
    nc: Client,
    subjects: Subjects,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refused() -> int:  # controls the worker has read and turned down
        return sum("refused on" in r.getMessage() for r in caplog.records)

    service = await start_worker()
    ctl = subjects.control_group("short")
    await nc.publish(ctl, Control(action="set_batch_cap", batch_cap=1).to_bytes())
    await eventually(lambda: service.bridge.batch_cap == 1)
    assert await service.bridge.call(lambda e: e.max_batch_size) == 1
    await nc.publish(subjects.control("w0"), Control(action="drain").to_bytes())
    await eventually(lambda: service.state == "draining")
    pending = asyncio.ensure_future(
        client.collect(group="short", prompt_token_ids=[1], params=RequestParams(max_tokens=2))
    )
    await asyncio.sleep(0.7)  # more than a fetch long-poll: a drained worker fetches nothing
    assert not pending.done()
    # The group's shared subjects (caps, aborts) cannot resume, drain or move it: those go
    # to one replica's own subject, so a caller allowed to abort cannot empty a group.
    await nc.publish(ctl, Control(action="resume").to_bytes())
    await nc.publish(subjects.abort("short"), Control(action="resume").to_bytes())
    await eventually(lambda: refused() == 2)  # both read, and turned down
    assert service.state == "draining"
    await nc.publish(subjects.control("w0"), Control(action="resume").to_bytes())
    ids, _, _ = await asyncio.wait_for(pending, 5)
    assert ids == expected_tokens(1, 2) and service.state == "serving"
    await nc.publish(subjects.abort("short"), Control(action="drain").to_bytes())
    await nc.publish(
        subjects.abort("short"), Control(action="set_batch_cap", batch_cap=1).to_bytes()
    )
    await nc.publish(ctl, Control(action="set_batch_cap").to_bytes())  # back to the group's
    await eventually(lambda: service.bridge.batch_cap > 1)
    await eventually(lambda: refused() == 4)
    # The abort subject (gateways', NATS callers') neither drains nor caps.
    assert service.state == "serving" and service.bridge.batch_cap > 1


async def test_a_command_of_an_earlier_scheduler_term_is_ignored(
    start_worker: Any, nc: Client, subjects: Subjects, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler cut off from NATS had its publishes queued; sent when it got back, after a
    standby had taken over, its stale cap (or move) was obeyed over today's leader's."""
    service = await start_worker()
    ctl = subjects.control_group("short")
    now_ms = int(time.time() * 1000)
    today = Control(action="set_batch_cap", issued_ms=now_ms, batch_cap=3, fence=20)
    await nc.publish(ctl, today.to_bytes())
    await eventually(lambda: service.bridge.batch_cap == 3)
    late = Control(action="set_batch_cap", issued_ms=now_ms - 2000, batch_cap=1, fence=10)
    await nc.publish(ctl, late.to_bytes())
    await eventually(
        lambda: any("earlier scheduler term" in r.getMessage() for r in caplog.records)
    )
    assert service.bridge.batch_cap == 3
    await nc.publish(ctl, Control(action="set_batch_cap", issued_ms=now_ms, fence=20).to_bytes())
    await eventually(lambda: service.bridge.batch_cap > 3)  # today's leader still obeyed


async def test_a_cap_no_scheduler_renews_lapses_back_to_the_groups_max(
    start_worker: Any, nc: Client, subjects: Subjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A breaker's cap outlives no dead scheduler: gateways stop diverting from an unrenewed
    open breaker, so the group's replicas must take their full batch again too."""
    monkeypatch.setattr(worker_service, "CAP_LAPSE_S", 0.6)
    service = await start_worker()
    group_max = service.config.groups["short"].max_batch
    ctl = subjects.control_group("short")
    cap = Control(action="set_batch_cap", batch_cap=1).to_bytes()
    await nc.publish(ctl, cap)
    await eventually(lambda: service.bridge.batch_cap == 1)
    for _ in range(4):  # renewed every 0.3 s: it holds past the lapse
        await asyncio.sleep(0.3)
        await nc.publish(ctl, cap)
    assert service.bridge.batch_cap == 1
    await eventually(lambda: service.bridge.batch_cap == group_max, timeout_s=5)


async def test_assign_group_moves_the_replica_to_the_new_groups_consumer(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects
) -> None:
    service = await start_worker()
    await nc.publish(
        subjects.control("w0"), Control(action="assign_group", group="realtime").to_bytes()
    )
    await eventually(lambda: service.group == "realtime" and service.state == "serving")
    assert service.bridge.batch_cap == 1  # realtime's max batch
    ids, _, final = await client.collect(
        group="realtime", prompt_token_ids=[3], params=RequestParams(max_tokens=2)
    )
    assert ids == expected_tokens(1, 2) and final.worker == "w0"


async def test_a_drained_replica_stays_drained_through_a_move_until_resumed(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects
) -> None:
    """A move ended by serving whatever came before: the scheduler's next move (or one
    naming the replica's own group, at once) undid an operator's drain."""
    service = await start_worker()
    own = subjects.control("w0")
    await nc.publish(own, Control(action="drain").to_bytes())
    await eventually(lambda: service.state == "draining")
    await nc.publish(own, Control(action="assign_group", group="short").to_bytes())
    await nc.publish(own, Control(action="assign_group", group="realtime").to_bytes())
    await eventually(lambda: service.group == "realtime")  # set before it binds: not done
    # The move's last step decides serving or not (it served again at once before): wait
    # for the move itself to end, then look.
    moves = [t for t in service._tasks if t.get_name() == "assign-group"]
    await asyncio.wait_for(asyncio.gather(*moves), 5)
    assert moves and service.group == "realtime" and service.state == "draining"
    await nc.publish(own, Control(action="resume").to_bytes())
    await eventually(lambda: service.state == "serving")
    ids, _, final = await client.collect(
        group="realtime", prompt_token_ids=[3], params=RequestParams(max_tokens=2)
    )
    assert ids == expected_tokens(1, 2) and final.worker == "w0"


async def test_a_resume_sent_during_a_move_serves_once_the_move_ends(
    start_worker: Any, nc: Client, subjects: Subjects
) -> None:
    """A resume that came while a move held the switch was ignored and the drain before it
    kept: the moved replica fetched nothing until someone resumed it again."""
    service = await start_worker()
    own = subjects.control("w0")
    await nc.publish(own, Control(action="drain").to_bytes())
    await eventually(lambda: service.state == "draining")
    async with service._switch_lock:  # a move under way (it waits for requests to end)
        await nc.publish(own, Control(action="resume").to_bytes())
        await nc.flush()
        await eventually(lambda: not service._drained)
        assert service.state == "draining"  # the intake stays halted until the move ends
    await service.assign_group("realtime")
    assert service.group == "realtime" and service.state == "serving"


async def test_a_too_big_ending_started_for_a_request_no_longer_held_sends_nothing(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """A drain's flush found the chunk too big and started a task to end the request with
    an error, then handed the message back: the task answered it 500 anyway (and acked a
    message that was no longer this replica's), and the resume heard "closed"."""
    from common.errors import InternalError
    from workers.outbox import Flight

    service = await start_worker()
    acked: list[str] = []
    rid = new_id()
    msg = SimpleNamespace(ack=lambda: acked.append("ack"), nak=lambda **_: None)
    req = GenerateRequest(id=rid, group="short", reply=subjects.out(rid))
    st = Flight(req, msg=msg, attempt=1, start=0.0)
    chunks = await nc.subscribe(subjects.out(rid))
    await service._send_error_if_ours(st, InternalError("too big"))  # not in the books
    with pytest.raises(nats.errors.TimeoutError):
        await chunks.next_msg(timeout=0.3)
    assert acked == []


async def test_a_drain_waits_for_an_answer_whose_final_chunk_is_still_going_out(
    start_worker: Any, client: QosClient
) -> None:
    """A request leaves the books before its final chunk and ack go out: a publish that
    paused on a full client buffer let the drain read the replica as idle, and the stop
    cancelled the pump before the ack (redelivered after ack_wait)."""
    service = await start_worker()
    gate = asyncio.Event()
    publish = service._publish

    async def slow_ending(st: Any, chunk: Any) -> None:
        if chunk.finish_reason is not None:
            await gate.wait()
        await publish(st, chunk)

    service._publish = slow_ending
    answer = asyncio.create_task(
        client.collect(group="short", prompt_token_ids=[3], params=RequestParams(max_tokens=2))
    )
    await eventually(lambda: bool(service._completing))
    waiting = asyncio.create_task(service._wait_idle(5.0))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # the answer is not out yet
    gate.set()
    await asyncio.wait_for(waiting, 5)
    ids, _, final = await asyncio.wait_for(answer, 5)
    assert ids == expected_tokens(1, 2) and final.finish_reason == "length"


async def test_a_replica_built_for_short_serves_long_requests_once_moved_there(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """The engine was built for its first group's limits: moved from short (batch 16, 4k
    tokens) to long, it refused every prompt over 4k; from long, it batched short's
    requests two at a time. Built for every group, it takes each group's own limits."""
    from workers.__main__ import build_engine, build_parser

    args = build_parser().parse_args(
        ["--group", "short", "--engine", "sim", "--model", "dummy:tiny"]
    )
    service = await start_worker(engine=build_engine(worker_config, args))
    short, long = worker_config.groups["short"], worker_config.groups["long"]
    assert (service.bridge.batch_cap, service.bridge.seq_limit) == (
        short.max_batch,
        short.max_seq_len,
    )
    await nc.publish(
        subjects.control("w0"), Control(action="assign_group", group="long").to_bytes()
    )
    await eventually(lambda: service.group == "long" and service.state == "serving")
    assert (service.bridge.batch_cap, service.bridge.seq_limit) == (
        long.max_batch,
        long.max_seq_len,
    )
    prompt = [3] * (short.max_seq_len + 100)  # beyond short's limit, within long's
    ids, _, final = await client.collect(
        group="long", prompt_token_ids=prompt, params=RequestParams(max_tokens=2)
    )
    assert len(ids) == 2 and final.finish_reason == "length" and final.error is None
    reports: asyncio.Queue[Telemetry] = asyncio.Queue()

    async def on_report(msg: Any) -> None:
        reports.put_nowait(Telemetry.from_bytes(msg.data))

    sub = await nc.subscribe(subjects.telemetry("long", "w0"), cb=on_report)
    report = await asyncio.wait_for(reports.get(), 5)
    await sub.unsubscribe()
    assert report.max_seq_len == long.max_seq_len  # what the gateway limits long's requests to
    assert report.engine_max_seq_len == service.bridge.built_max_seq_len  # what it could hold


async def test_a_moved_replica_reports_no_old_latency_and_takes_its_new_groups_cap(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects
) -> None:
    """Its old group's latencies (a long document's seconds) counted against its new
    group's SLO and opened that group's breaker; the move carries the destination's
    breaker cap; a cap the scheduler sent for the group it left is not applied."""
    service = await start_worker()
    await client.collect(group="short", prompt_token_ids=[3], params=RequestParams(max_tokens=2))
    assert service.telemetry.e2e.percentiles_ms()[2] == 1
    # A report sent while it binds (the telemetry loop runs on its own) already carries the
    # new group's name: the old latencies must be gone by then, not only once bound.
    during_bind: list[tuple[str, int]] = []
    real_bind = service._bind

    async def watched_bind(group: str, wait_s: float | None = None) -> None:
        during_bind.append((service.group, service.telemetry.e2e.percentiles_ms()[2]))
        assert wait_s == 0  # a move does not wait a minute for a consumer it may not make
        await real_bind(group, wait_s)

    service._bind = watched_bind
    move = Control(action="assign_group", group="long", batch_cap=1)
    await nc.publish(subjects.control("w0"), move.to_bytes())
    await eventually(lambda: service.group == "long" and service.state == "serving")
    assert during_bind == [("long", 0)]
    assert service.telemetry.e2e.percentiles_ms() == (0.0, 0.0, 0)
    assert service.telemetry.ttft.percentiles_ms() == (0.0, 0.0, 0)
    assert service.bridge.batch_cap == 1  # long's breaker is open: not its max batch of 2
    stale = Control(action="set_batch_cap", group="short", batch_cap=16)
    await nc.publish(subjects.control("w0"), stale.to_bytes())
    # Its control subject's messages are handled in order: once the drain sent after the
    # stale cap took effect, the cap was handled (a renewal of long's cap 1, sent after it,
    # would hide a stale cap obeyed: it never could fail that way).
    await nc.publish(subjects.control("w0"), Control(action="drain").to_bytes())
    await eventually(lambda: service.state == "draining")
    assert service.bridge.batch_cap == 1
    renewed = Control(action="set_batch_cap", group="long")  # long's own: obeyed, to its max
    await nc.publish(subjects.control("w0"), renewed.to_bytes())
    await eventually(lambda: service.bridge.batch_cap == 2)


@pytest.mark.parametrize("failures", [1, 99])
async def test_a_move_whose_bind_fails_retries_or_goes_back_never_serving_nothing(
    start_worker: Any,
    client: QosClient,
    nc: Client,
    subjects: Subjects,
    monkeypatch: pytest.MonkeyPatch,
    failures: int,
) -> None:
    """Binding to the new group fails once (a NATS hiccup: the retry moves it) or always
    (it goes back to its old group): either way it serves a group it fetches from."""
    service = await start_worker()
    real = qnats.group_pull_subscription
    left = {"realtime": failures}

    async def flaky(js: Any, config: Any, group: str) -> Any:
        if left.get(group, 0) > 0:
            left[group] -= 1
            raise TimeoutError("consumer info timed out")
        return await real(js, config, group)

    monkeypatch.setattr(qnats, "group_pull_subscription", flaky)
    await nc.publish(
        subjects.control("w0"), Control(action="assign_group", group="realtime").to_bytes()
    )
    serves = "realtime" if failures == 1 else "short"
    await eventually(lambda: service.group == serves and service.state == "serving", 10)
    ids, _, final = await client.collect(
        group=serves, prompt_token_ids=[3], params=RequestParams(max_tokens=2)
    )
    assert ids == expected_tokens(1, 2) and final.worker == "w0"


async def test_a_move_that_can_bind_neither_group_exits_1_instead_of_serving_nothing(
    start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither the new group nor the old one binds (NATS unreachable for seconds): it used
    to stay drained and bound to nothing for good, and a later move naming its group made
    it report serving while nothing fetched. It exits 1 for its supervisor instead."""
    service = await start_worker()

    async def unreachable(group: str, wait_s: float | None = None) -> None:
        raise nats.errors.TimeoutError

    monkeypatch.setattr(service, "_bind", unreachable)
    await service.assign_group("long")
    assert service.exit_code == 1
    await service.assign_group(service.group)  # its own group: nothing to bind, "resume"
    assert service.state != "serving"


async def test_a_redelivery_whose_live_gateway_misses_the_resume_query_is_not_dropped(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """Attempt 2 asks its caller what was delivered; nobody answers (its gateway is
    reconnecting) though the gateway is not silent: the request is handed back and served
    once the caller answers, instead of acked away while its client waits."""
    # Attempt 1 goes to a replica that hands it back at once (as one that died would, late).
    rid, chunks = await _redelivered(nc, subjects, worker_config, "gw-reconnecting")
    # The caller's subscription is there but does not answer (its loop is late): the
    # query for attempt 2 times out.
    silent = await nc.subscribe(subjects.resume(rid))
    await start_worker()
    query = ResumeQuery.from_bytes((await silent.next_msg(timeout=5)).data)
    assert query.attempt == 2
    await asyncio.sleep(1.3)  # past the worker's 1 s wait: it has decided by now
    await silent.unsubscribe()

    async def answer(msg: Any) -> None:  # the caller is back: nothing was delivered yet
        await msg.respond(ResumeReply(id=rid).to_bytes())

    await nc.subscribe(subjects.resume(rid), cb=answer)
    tokens: list[int] = []
    while True:
        chunk = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
        tokens += chunk.token_ids
        if chunk.finish_reason is not None:
            break
    assert (chunk.finish_reason, chunk.attempt) == ("length", 3)
    assert tokens == expected_tokens(2, 3)


async def test_a_redelivery_whose_heartbeatless_caller_is_slow_to_answer_gets_an_error_chunk(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """A NATS caller without heartbeats (no origin) whose resume answer came late: the
    request was acked away with nothing said, the caller waiting to its deadline."""
    rid, chunks = await _redelivered(nc, subjects, worker_config, "")
    silent = await nc.subscribe(subjects.resume(rid))  # there, but too slow to answer
    await start_worker()
    await silent.next_msg(timeout=5)
    chunk = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
    assert chunk.error is not None and chunk.error.code == "request_given_up", chunk


async def test_a_redelivered_request_counts_as_done_but_gives_no_latency_sample(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """Its clock ran from the first publish, through the wait for the redelivery
    (ack_wait after a replica died): one crash opened the breaker of a group whose other
    replicas served fast. A first delivery's sample is taken as before."""
    rid, chunks = await _redelivered(nc, subjects, worker_config, "gw-live")

    async def answer(msg: Any) -> None:  # nothing was delivered before
        await msg.respond(ResumeReply(id=rid).to_bytes())

    await nc.subscribe(subjects.resume(rid), cb=answer)
    service = await start_worker()
    assert (await read_until_final(chunks))[-1]["attempt"] == 2
    await eventually(lambda: service.telemetry.requests_done == 1)
    assert service.telemetry.e2e.percentiles_ms()[2] == 0
    assert service.telemetry.ttft.percentiles_ms()[2] == 0
    _, first = await _queued(nc, subjects, worker_config, prompt_token_ids=[3],
                             params=RequestParams(max_tokens=2))  # fmt: skip
    await read_until_final(first)
    await eventually(lambda: service.telemetry.requests_done == 2)
    assert service.telemetry.e2e.percentiles_ms()[2] == 1
    assert service.telemetry.ttft.percentiles_ms()[2] == 1


async def _queued(
    nc: Client, subjects: Subjects, worker_config: Config, **fields: Any
) -> tuple[str, Any]:
    """A ``short`` request (``fields``: the rest of its GenerateRequest) published straight
    to the stream, no gateway: its id and a subscription to its chunks, made first."""
    rid = new_id()
    req = GenerateRequest(id=rid, group="short", reply=subjects.out(rid), **fields)
    chunks = await nc.subscribe(subjects.out(rid))
    js = nc.jetstream()
    await qnats.ensure_jetstream(js, worker_config.nats, worker_config.groups)
    await js.publish(subjects.request("short"), req.to_bytes(), headers={"Nats-Msg-Id": rid})
    return rid, chunks


async def _redelivered(
    nc: Client, subjects: Subjects, worker_config: Config, origin: str
) -> tuple[str, Any]:
    """A request whose first delivery was handed back (as one whose ack was lost): the next
    fetch is attempt 2. Returns its id and a subscription to its chunks."""
    rid, chunks = await _queued(
        nc, subjects, worker_config, prompt_token_ids=[1, 2],
        params=RequestParams(max_tokens=3), origin=origin,
    )  # fmt: skip
    js = nc.jetstream()
    first = await qnats.group_pull_subscription(js, worker_config.nats, "short")
    (msg,) = await first.fetch(1, timeout=5)
    await msg.nak()
    await first.unsubscribe()
    return rid, chunks


async def test_a_request_handed_back_as_its_resume_answer_came_is_not_run(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A drain's grace ran out while a redelivery awaited its resume answer: its admission
    was cancelled and its message handed back, but Python 3.11's wait_for returns a reply
    that arrives with the cancel instead of raising, and the request ran for nobody."""
    rid, _chunks = await _redelivered(nc, subjects, worker_config, "gw-live")
    asking = asyncio.Event()

    async def answer_despite_the_cancel(*args: Any, **kwargs: Any) -> ResumeReply:
        asking.set()
        with contextlib.suppress(asyncio.CancelledError):  # 3.11's wait_for, the reply in
            await asyncio.sleep(30)
        return ResumeReply(id=rid)

    monkeypatch.setattr(worker_service, "ask_resume", answer_despite_the_cancel)
    service = await start_worker()
    await asyncio.wait_for(asking.wait(), 5)
    added: list[str] = []
    real_add = service.bridge.add
    monkeypatch.setattr(
        service.bridge, "add", lambda req: added.append(req.request_id) or real_add(req)
    )
    await service.stop(grace_s=0)
    assert rid not in service.inflight_ids and added == []


def _resumed_count(service: Any) -> float:
    return sum(
        sample.value
        for family in service.observer.registry.collect()
        for sample in family.samples
        if sample.name == "qos_request_resumed_total"
    )


async def test_a_redelivery_aborted_while_it_asked_where_to_resume_is_no_resume(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """qos_request_resumed_total counted a delivery as soon as its resume query was answered,
    also one dropped right after (aborted meanwhile, a duplicate, handed back): the
    redeliveries line ran high exactly during aborts and drains."""
    rid, _chunks = await _redelivered(nc, subjects, worker_config, "gw-live")
    service_box: list[Any] = []

    async def aborted_meanwhile(*args: Any, **kwargs: Any) -> ResumeReply:
        while not service_box:  # asked before start_worker returned
            await asyncio.sleep(0.01)
        service_box[0]._aborted.add(rid)  # the caller's abort lands while we ask
        return ResumeReply(id=rid)

    monkeypatch.setattr(worker_service, "ask_resume", aborted_meanwhile)
    service = await start_worker()
    service_box.append(service)
    js = nc.jetstream()
    deadline = time.monotonic() + 5
    while (await js.stream_info(worker_config.nats.stream)).state.messages:
        assert time.monotonic() < deadline, "the aborted redelivery was never acked"
        await asyncio.sleep(0.02)
    assert _resumed_count(service) == 0 and rid not in service.inflight_ids


async def test_a_redelivery_of_a_request_its_gateway_finished_is_acked_not_served(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """Its ack was lost after the final chunk: the gateway, still alive, used to stay silent
    on the resume query, and the worker handed the copy back until JetStream gave up on it
    and kept it in the work queue for good. The gateway now says it is closed."""
    rid, chunks = await _redelivered(nc, subjects, worker_config, "gw-live")

    async def closed(msg: Any) -> None:
        await msg.respond(ResumeReply(id=rid, closed=True).to_bytes())

    await nc.subscribe(subjects.resume(rid), cb=closed)
    await start_worker()
    with pytest.raises(nats.errors.TimeoutError):  # nothing generated for nobody
        await chunks.next_msg(timeout=1.5)
    js = nc.jetstream()
    info = await js.consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
    assert info.num_pending == 0 and info.num_ack_pending == 0  # acked: gone from the queue


async def test_two_messages_with_one_id_admitted_together_get_one_answer(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """Both redelivered, both waiting for their resume answer: the in-flight check ran
    before that wait, so both passed it, the second's engine add failed (an invalid_request
    chunk to the caller) and the first ran for nobody, its message never acked."""
    rid = new_id()
    req = GenerateRequest(id=rid, group="short", reply=subjects.out(rid), origin="gw-live",
                          prompt_token_ids=[1, 2], params=RequestParams(max_tokens=30))  # fmt: skip
    chunks = await nc.subscribe(subjects.out(rid))
    js = nc.jetstream()
    await qnats.ensure_jetstream(js, worker_config.nats, worker_config.groups)
    for _ in range(2):  # no Nats-Msg-Id: JetStream keeps both
        await js.publish(subjects.request("short"), req.to_bytes())
    first = await qnats.group_pull_subscription(js, worker_config.nats, "short")
    for msg in await first.fetch(2, timeout=5):
        await msg.nak()  # both come back as delivery 2: each asks where to resume
    await first.unsubscribe()

    answering: list[asyncio.Task[None]] = []

    async def answer(msg: Any) -> None:
        await asyncio.sleep(0.3)  # both admissions wait here together
        await msg.respond(ResumeReply(id=rid).to_bytes())

    async def slow_answers(msg: Any) -> None:  # each on its own: a callback runs one at a time
        answering.append(asyncio.create_task(answer(msg)))

    await nc.subscribe(subjects.resume(rid), cb=slow_answers)
    # 30 steps of 50 ms: the first still runs when the second's answer comes, however late
    # a loaded machine fetches it (the test is about the two overlapping).
    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.05))
    )
    got: list[Chunk] = []
    while not got or got[-1].finish_reason is None:
        got.append(Chunk.from_bytes((await chunks.next_msg(timeout=10)).data))
    assert [c.error for c in got if c.error] == [] and got[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in got) == 30
    with pytest.raises(nats.errors.TimeoutError):  # no second answer
        await chunks.next_msg(timeout=0.5)
    for _ in range(100):  # both settled: one answered, the other terminated
        info = await js.consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
        if info.num_pending == 0 and info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.05)
    assert (info.num_pending, info.num_ack_pending) == (0, 0), info
    assert _resumed_count(service) == 1  # the terminated twin is no resume


async def test_in_progress_follows_the_consumers_ack_wait_as_the_server_has_it(
    start_worker: Any,
    client: QosClient,
    nc: Client,
    worker_config: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another component (a gateway configured otherwise) rewrote the consumer with a
    shorter ack_wait (0.4 s): paced by its own (2 s here: in_progress every 0.5 s), the worker
    let the request be redelivered until JetStream gave it up. It now reads the server's."""
    monkeypatch.setattr(worker_service, "CONSUMER_CHECK_S", 0.2)
    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.05))
    )
    js = nc.jetstream()
    info = await js.consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
    await js.add_consumer(worker_config.nats.stream, info.config.evolve(ack_wait=0.4))
    await eventually(lambda: abs(service._ack_wait_s - 0.4) < 1e-6)  # the worker read it
    ids, _, final = await client.collect(  # 40 steps of 50 ms: five times the ack_wait
        group="short", prompt_token_ids=[1], params=RequestParams(max_tokens=40)
    )
    assert len(ids) == 40 and final.attempt == 1
    info = await js.consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
    assert info.num_redelivered == 0  # never redelivered


async def test_a_stalled_consumer_info_call_does_not_hold_up_the_ticks(
    start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack_wait check awaited JetStream's consumer_info inside the tick: a stalled
    JetStream API (5 s timeout) held up the tick's deadline and health checks and the next
    in_progress signals, which a short ack_wait does not survive."""
    service = await start_worker()
    stalled = asyncio.Event()

    async def stall(*args: Any, **kwargs: Any) -> Any:
        stalled.set()
        await asyncio.sleep(30)

    monkeypatch.setattr(service.js, "consumer_info", stall)
    service._ack_wait_checked = 0.0  # due now
    await asyncio.wait_for(service._tick_checks(), 1)  # returned while the call stalls
    await asyncio.wait_for(stalled.wait(), 1)


class HungSim(SimEngine):
    """A device that hangs: once a request has 2 tokens, ``step`` blocks until released."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()

    def step(self) -> list[Any]:
        if any(len(r.output_token_ids) >= 2 for r in self.running):
            self.release.wait(30)
        return super().step()


async def test_a_hung_engine_does_not_hold_a_request_past_its_deadline(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects,
    worker_config: Config, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The engine thread hangs mid-request: the abort at the deadline is never acted on, so
    the worker answers the request itself (deadline_exceeded) and settles its message,
    instead of holding both until the thread comes back. Mid-step, the engine is the step
    watchdog's to judge (engine_stuck_s): a step longer than ENGINE_STUCK_S past a deadline
    (a CPU prefill chunk) made a healthy replica exit 1 and hand back all it held."""
    monkeypatch.setattr(worker_service, "ENGINE_STUCK_S", 0.3)
    engine = HungSim(max_batch_size=4, cost=SimCost(0, 0, 0))
    service = await start_worker(engine=engine)
    try:
        rid = new_id()
        chunks = await nc.subscribe(subjects.out(rid))
        request = GenerateRequest(
            id=rid, group="short", reply=subjects.out(rid), prompt_token_ids=[1, 2],
            params=RequestParams(max_tokens=50), deadline_ms=int(time.time() * 1000) + 400,
        )  # fmt: skip
        js = nc.jetstream()
        await js.publish(
            subjects.request("short"), request.to_bytes(), headers={"Nats-Msg-Id": rid}
        )
        final = None
        while final is None:
            chunk = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
            final = chunk if chunk.error is not None or chunk.finish_reason else None
        assert final.error is not None and final.error.code == "deadline_exceeded"
        assert rid not in service.inflight_ids
        # Acked, not redelivered to hang another replica (the ack follows the answer).
        deadline = time.monotonic() + 3
        while (await js.stream_info(worker_config.nats.stream)).state.messages:
            assert time.monotonic() < deadline, "the request's message was never acked"
            await asyncio.sleep(0.02)
        engine.release.set()  # the long step ends
        assert service.exit_code == 0 and service.state == "serving"
        ids, _, _ = await client.collect(group="short", prompt_token_ids=[5, 6],
                                         params=RequestParams(max_tokens=1), timeout_s=10)  # fmt: skip
        assert len(ids) == 1
    finally:
        engine.release.set()


async def test_a_stop_leaves_the_kv_tier_open_while_the_engine_thread_still_steps(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A stop whose engine thread did not end in time (a hung device) closed the KV tier
    under it: its pending write-through copies became errors."""
    monkeypatch.setattr(bridge_module, "STOP_JOIN_S", 0.3)
    closed: list[bool] = []

    class Tier:  # what the stop touches of a tier: close()
        def close(self) -> None:
            closed.append(True)

    engine = HungSim(max_batch_size=4, cost=SimCost(0, 0, 0))
    engine.kv_tier = Tier()  # type: ignore[attr-defined]
    service = await start_worker(engine=engine)
    try:
        _, chunks = await _queued(nc, subjects, worker_config, prompt_token_ids=[1, 2],
                                  params=RequestParams(max_tokens=50))  # fmt: skip
        await chunks.next_msg(timeout=5)  # generating: the next steps hang
        await eventually(lambda: service.bridge.step_running_s() > 0)
        await service.stop(grace_s=0)
        assert service.bridge.alive and closed == []
    finally:
        engine.release.set()


async def test_an_abort_the_engine_took_but_whose_output_is_late_fails_no_engine(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The engine acted on the deadline's abort, but its output sat behind a late pump (a
    NATS stall): the tick read that as an engine ignoring aborts, and the healthy replica
    exited 1, handing back every request it held."""
    monkeypatch.setattr(worker_service, "ENGINE_STUCK_S", 0.3)
    service = await start_worker(engine=SimEngine(max_batch_size=4, cost=SimCost(0.01, 0, 0)))
    gate, real = asyncio.Event(), service._on_event

    async def late(event: Any) -> None:
        await gate.wait()
        await real(event)

    monkeypatch.setattr(service, "_on_event", late)  # no output reaches the loop now
    try:
        _, chunks = await _queued(
            nc, subjects, worker_config, prompt_token_ids=[1, 2],
            params=RequestParams(max_tokens=200), deadline_ms=int(time.time() * 1000) + 300,
        )  # fmt: skip
        final = (await read_until_final(chunks))[-1]
        assert final["error"]["code"] == "deadline_exceeded"
        assert service.exit_code == 0 and service.state == "serving"
    finally:
        gate.set()


class DyingSim(SimEngine):
    """An engine whose thread ends (a BaseException no handler catches) at its first step."""

    def step(self) -> list[Any]:
        if self.running:
            raise SystemExit("the engine thread ends")
        return super().step()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the point
async def test_a_replica_whose_engine_thread_ended_stops_serving(
    start_worker: Any, client: QosClient
) -> None:
    service = await start_worker(engine=DyingSim(max_batch_size=4, cost=SimCost(0, 0, 0)))
    pending = asyncio.ensure_future(
        client.collect(group="short", prompt_token_ids=[1], params=RequestParams(max_tokens=2),
                       timeout_s=2)
    )  # fmt: skip
    await eventually(lambda: not service.bridge.alive and service.state == "draining", 5)
    pending.cancel()


async def test_telemetry_arrives_every_interval_with_sane_values(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    sub = await nc.subscribe(subjects.telemetry("short", "w0"))
    began = time.time()  # the clock the worker stamps reports and latencies with
    service = await start_worker()
    for _ in range(3):
        await client.collect(
            group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=8)
        )
    # Counted, not timed (a deadline read fewer reports on a loaded machine): every report
    # from the start, until six and one sent after the last request ended.
    reports: list[Telemetry] = []
    while len(reports) < 6 or reports[-1].requests_done < 3:
        assert len(reports) < 50, reports[-1]  # never counted them all
        reports.append(Telemetry.from_bytes((await sub.next_msg(timeout=5)).data))
    read_by = time.time()
    # By the sender's clock: reports queued here while the requests ran are read back to
    # back, and their arrival gaps said nothing about the interval.
    gaps = [(b.ts_ms - a.ts_ms) / 1000 for a, b in itertools.pairwise(reports)]
    interval = worker_config.worker.telemetry_interval_s
    # Never more often than the interval (ts_ms is whole ms); at it, not at the 1 s default:
    # the median gap, which a loop stalled now and then on a loaded machine does not move.
    assert min(gaps) >= interval - 0.002
    assert statistics.median(gaps) < 1.0
    last = reports[-1]
    assert (last.worker, last.group, last.state, last.batch_cap) == ("w0", "short", "serving", 4)
    assert last.requests_done == 3 and last.errors == 0 and last.samples == 3
    # Latencies in ms: none longer than the whole run, which holds all three requests (a
    # unit off by 1000 would not fit; a fixed bound in seconds only tested the machine).
    run_ms = (read_by - began) * 1000 + 1  # + created_ms's truncation to whole ms
    assert 0 < last.ttft_p50_ms <= last.ttft_p99_ms < run_ms
    assert 0 < last.e2e_p50_ms <= last.e2e_p99_ms < run_ms
    assert last.ttft_p50_ms <= last.e2e_p99_ms
    assert (last.running, last.waiting, last.kv_usage) == (0, 0, 0.0)
    assert last.prefix_queried_tokens == 6
    # Clamped to [0, 1] by the sender: what says it is measured is a report during the work.
    assert max(r.busy_ratio for r in reports) > 0.0
    kv = await nc.jetstream().key_value(worker_config.nats.kv_bucket)

    async def heartbeat() -> dict[str, Any]:
        return json.loads((await kv.get("workers.w0")).value)

    # Rewritten with the reports (each writes it in a task of its own): it catches up with
    # the last one read.
    deadline = time.monotonic() + 5
    while (beat := await heartbeat())["ts_ms"] < last.ts_ms:
        assert time.monotonic() < deadline, (beat, last.ts_ms)
        await asyncio.sleep(0.02)
    assert (beat["group"], beat["state"]) == ("short", "serving")
    # A replica that stops takes its key with it: ids are host-pid, never reused, and the
    # bucket kept one per replica ever started (each scrape-target pass read them all).
    await service.stop(grace_s=0)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("workers.w0")


async def test_the_client_says_service_unavailable_when_no_stream_takes_the_request(
    client: QosClient,
) -> None:
    with pytest.raises(ServiceUnavailableError):
        await client.collect(group="short", prompt="anyone?")


def test_a_callers_created_ms_counts_only_where_jetstream_agrees() -> None:
    """One request claiming it was created in 1970 would report a latency of decades and
    open its group's breaker; a gateway's own stamp (ms before JetStream stored it) counts."""
    import datetime
    from types import SimpleNamespace

    now = time.time()
    stored = SimpleNamespace(
        metadata=SimpleNamespace(timestamp=datetime.datetime.fromtimestamp(now - 0.2, datetime.UTC))
    )

    def request(created_ms: int) -> GenerateRequest:
        return GenerateRequest(id="r", group="short", reply="qos.out.r", prompt_token_ids=[1],
                               created_ms=created_ms)  # fmt: skip

    gateway_stamp = int((now - 0.25) * 1000)
    assert worker_service._started_at(request(gateway_stamp), stored) == gateway_stamp / 1000
    for claim in (1, int((now + 3600) * 1000), 0):  # 1970, the future, none
        assert abs(worker_service._started_at(request(claim), stored) - (now - 0.2)) < 1e-3


async def test_a_direct_client_reusing_a_request_id_is_told_and_an_abort_unqueues(
    start_worker: Any, client: QosClient, nc: Client, worker_config: Config
) -> None:
    """JetStream dedupes a reused id: the second caller must hear so rather than wait on an
    answer that is not its own; and a request the client gives up on while still queued
    leaves the stream, so a replica that joins later does not run it for nobody."""
    js = nc.jetstream()
    await qnats.ensure_jetstream(js, worker_config.nats, worker_config.groups)
    # Nobody serves `long` here: the request stays queued until the client gives up.
    with pytest.raises(DeadlineExceededError):
        await client.collect(group="long", prompt_token_ids=[1, 2], request_id="queued-1",
                             params=RequestParams(max_tokens=2), timeout_s=0.5)  # fmt: skip
    info = await js.stream_info(worker_config.nats.stream)
    assert info.state.messages == 0
    await start_worker()
    ids, _, _ = await client.collect(
        group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=2),
        request_id="same-id",
    )  # fmt: skip
    assert len(ids) == 2
    with pytest.raises(InvalidRequestError, match="in use"):
        await client.collect(group="short", prompt_token_ids=[3], request_id="same-id")


async def test_a_long_text_prompt_is_tokenized_off_the_engine_thread(
    start_worker: Any, client: QosClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct caller may send a text prompt of megabytes; the engine thread, which every
    running request waits on, must not spend its time tokenizing it."""
    threads: list[str] = []
    encode = worker_service.encode_prompt

    def spy(engine: Any, prompt: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(engine, prompt)

    monkeypatch.setattr(worker_service, "encode_prompt", spy)
    service = await start_worker()
    short = await client.collect(group="short", prompt="hi", params=RequestParams(max_tokens=2))
    assert threads == []  # short prompts stay as they were
    text = "x" * (worker_service.OFFLOAD_TOKENIZE_CHARS + 1)
    with pytest.raises(ContextLengthExceededError):  # 16k bytes exceed short's 256 tokens
        await client.collect(group="short", prompt=text, params=RequestParams(max_tokens=2))
    assert len(threads) == 1 and threads[0] != service.bridge._thread.name
    assert threads[0] != threading.main_thread().name
    assert len(short[0]) == 2


async def test_a_direct_client_hears_when_jetstream_gives_its_request_up(
    client: QosClient, nc: Client, worker_config: Config
) -> None:
    """Every delivery killed a worker, so JetStream stops redelivering and says so in a
    MAX_DELIVERIES advisory: the client fails then, not at its deadline minutes later."""
    js = nc.jetstream()
    await qnats.ensure_jetstream(js, worker_config.nats, worker_config.groups)
    pending = asyncio.ensure_future(
        client.collect(group="long", prompt_token_ids=[1], timeout_s=30)  # nobody serves long
    )
    stream = worker_config.nats.stream
    for _ in range(100):
        if (await js.stream_info(stream)).state.messages:
            break
        await asyncio.sleep(0.02)
    seq = (await js.stream_info(stream)).state.last_seq
    advisory = {"stream_seq": seq, "deliveries": 5, "consumer": Subjects.consumer("long")}
    subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{Subjects.consumer('long')}"
    # The client subscribes to the advisory once its publish is acked, on its own
    # connection: sent until it is heard (the client ends the request once).
    for _ in range(50):
        await nc.publish(subject, json.dumps(advisory).encode())
        await asyncio.wait([pending], timeout=0.1)
        if pending.done():
            break
    with pytest.raises(InternalError, match="given up") as info:
        await asyncio.wait_for(pending, 5)
    assert info.value.code == "request_given_up"  # the README's "do not retry"
    # A work queue keeps a message past max_deliver for good: the client deletes it.
    for _ in range(50):
        if not (await js.stream_info(stream)).state.messages:
            break
        await asyncio.sleep(0.02)
    assert (await js.stream_info(stream)).state.messages == 0


async def test_a_request_given_up_on_its_last_delivery_counts_as_an_error(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Its caller heard request_given_up, and qos_request_errors_total never moved: the
    failures that answer before a request becomes a flight were not counted."""
    _rid, chunks = await _queued(nc, subjects, worker_config, prompt_token_ids=[1, 2])
    js = nc.jetstream()
    earlier = await qnats.group_pull_subscription(js, worker_config.nats, "short")
    for _ in range(worker_config.nats.max_deliver - 1):  # deliveries that went elsewhere
        (msg,) = await earlier.fetch(1, timeout=5)
        await msg.nak()
    await earlier.unsubscribe()

    async def poisoned(self: Any, msg: Any) -> None:
        raise RuntimeError("a bug admitting this request")

    monkeypatch.setattr(worker_service.WorkerService, "_admit", poisoned)
    service = await start_worker()
    chunk = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
    assert chunk.error is not None and chunk.error.code == "request_given_up"
    registry = service.observer.registry
    errors = registry.get_sample_value(
        "qos_request_errors_total",
        {"group": "short", "model": service.observer.metrics.model, "code": "request_given_up"},
    )
    assert errors == 1


async def _moving_to_long(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects, grace_s: float,
    max_tokens: int,
) -> tuple[Any, asyncio.Future[Any]]:  # fmt: skip
    """A short replica with a request in flight, told to move to long: draining for it."""
    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.02)),
        grace_s=grace_s,
    )
    params = RequestParams(max_tokens=max_tokens)
    running = asyncio.ensure_future(
        client.collect(group="short", prompt_token_ids=[1], params=params)
    )
    await eventually(lambda: len(service.inflight_ids) == 1)
    await nc.publish(subjects.control(service.worker_id),
                     Control(action="assign_group", group="long").to_bytes())  # fmt: skip
    await eventually(lambda: service.state == "draining")
    return service, running


async def test_a_stop_during_a_group_move_stays_stopped(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """KEDA's SIGTERM can land while the replica drains for a move: the move must not bind
    the new group and report serving after the stop (a dying replica fetching, its new
    requests left unacked)."""
    service, running = await _moving_to_long(start_worker, client, nc, subjects, 0.6, 200)
    # A request waits in long already: a move that bound long during the stop, and served,
    # would fetch it. (Published after the stop, as it was, nothing could: the stop closes
    # the replica's connection, so a wait for a fetch proved nothing.)
    js = nc.jetstream()
    await js.publish(subjects.request("long"), GenerateRequest(
        id="during-stop", group="long", reply=subjects.out("during-stop"),
        prompt_token_ids=[1], params=RequestParams(max_tokens=2)).to_bytes())  # fmt: skip
    await service.stop(grace_s=2.0)  # outlasts the move's own 0.6 s grace
    assert service.state == "stopped" and not service._accepting
    running.cancel()  # handed back at the stop: nobody serves it here
    # The replica is gone (its connection closed): what it fetched, the server counted.
    assert service.nc is not None and service.nc.is_closed
    try:
        info = await js.consumer_info(worker_config.nats.stream, Subjects.consumer("long"))
    except nats.js.errors.NotFoundError:
        return  # the move never bound long: nothing can have fetched it
    # Never delivered: not even fetched and handed back.
    assert (info.num_pending, info.num_ack_pending, info.delivered.stream_seq) == (1, 0, 0)


async def test_a_worker_stops_even_when_its_engine_thread_hangs(
    start_worker: Any, client: QosClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wedged device holds the engine thread: stop must still close the connections (the
    pod would otherwise sit until SIGKILL), leaving the daemon thread behind."""
    from workers import bridge as bridge_module

    monkeypatch.setattr(bridge_module, "STOP_JOIN_S", 0.3)
    engine = HungSim(max_batch_size=4, cost=SimCost(0, 0, 0))
    service = await start_worker(engine=engine)
    try:
        running = asyncio.ensure_future(
            client.collect(
                group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=50)
            )
        )
        await eventually(lambda: any(len(r.output_token_ids) >= 2 for r in engine.running))
        t0 = time.monotonic()
        await asyncio.wait_for(service.stop(grace_s=0.2), 10)
        assert time.monotonic() - t0 < 5
        assert service.nc is not None and service.nc.is_closed
        running.cancel()
    finally:
        engine.release.set()


async def test_a_resume_during_a_group_move_does_not_claim_serving(
    start_worker: Any, client: QosClient, nc: Client, subjects: Subjects
) -> None:
    """Mid-move the old group's intake is halted: a resume then would report serving while
    nothing fetches (gateways count the replica live). The move itself resumes it."""
    service, running = await _moving_to_long(start_worker, client, nc, subjects, 5.0, 40)
    ctl = subjects.control(service.worker_id)
    await nc.publish(ctl, Control(action="resume").to_bytes())
    # Handled in order on its control subject: once the cap sent next took effect, the
    # resume was handled.
    await nc.publish(ctl, Control(action="set_batch_cap", batch_cap=3).to_bytes())
    await eventually(lambda: service.bridge.batch_cap == 3)
    assert service.state == "draining" and service.group == "short"
    await running  # the old group's request finishes; then the move completes
    await eventually(lambda: service.group == "long" and service.state == "serving")


async def test_a_delivery_back_from_another_replica_stops_ours_to_resume_it(
    start_worker: Any, client: QosClient
) -> None:
    """This replica held the request; a stall longer than ack_wait gave the next delivery
    to another replica (the caller then follows that attempt), which handed it back: the
    one after came here, where our copy went on stamping its first attempt, ignored by the
    caller until its deadline. Now ours stops and the delivery is handed back, to resume
    as the newest attempt."""
    import types

    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.05))
    )
    asking = asyncio.ensure_future(
        client.collect(group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=60))
    )
    await eventually(lambda: len(service.inflight_ids) == 1)
    (rid,) = service.inflight_ids
    held = service._inflight[rid].msg
    naks: list[float | None] = []

    class Delivery:  # the message as JetStream delivers it again: same stream sequence
        data = held.data

        def __init__(self, count: int) -> None:
            stream_seq = held.metadata.sequence.stream
            self.metadata = types.SimpleNamespace(
                num_delivered=count, sequence=types.SimpleNamespace(stream=stream_seq)
            )

        async def nak(self, delay: float | None = None) -> None:
            naks.append(delay)

    # Delivery 2 here (our in_progress came late): still our own request.
    await service._admit(Delivery(2))  # type: ignore[arg-type]
    assert rid in service.inflight_ids and naks == []
    # Delivery 4: the 3rd went elsewhere.
    await service._admit(Delivery(4))  # type: ignore[arg-type]
    assert rid not in service.inflight_ids and naks == [worker_service.RESUME_RETRY_S]
    asking.cancel()


async def test_an_aborted_flights_last_output_never_ends_the_next_flight_of_its_id(
    start_worker: Any, client: QosClient
) -> None:
    """Handed back, a flight's engine request is aborted; its "abort" comes out of the
    engine a step later. A delivery of the same id admitted in between got it (flights were
    found by request id): it ended with an abort nobody asked for, while its own engine
    request generated on for nobody, holding its blocks."""
    import types

    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.3))
    )
    params = RequestParams(max_tokens=8, seed=4)
    asking = asyncio.ensure_future(
        client.collect(group="short", prompt_token_ids=[1, 2], params=params, timeout_s=30)
    )
    await eventually(lambda: len(service.inflight_ids) == 1)
    (rid,) = service.inflight_ids
    held = service._inflight[rid].msg

    class Delivery:  # the message as JetStream delivers it again: same stream sequence
        data = held.data
        headers = None

        def __init__(self, count: int) -> None:
            stream_seq = held.metadata.sequence.stream
            self.metadata = types.SimpleNamespace(
                num_delivered=count, sequence=types.SimpleNamespace(stream=stream_seq)
            )

        async def nak(self, delay: float | None = None) -> None: ...

        async def ack(self) -> None: ...

        async def term(self) -> None: ...

        async def in_progress(self) -> None: ...

    await service._admit(Delivery(3))  # type: ignore[arg-type]  # ours stops, handed back
    assert rid not in service.inflight_ids
    await service._admit(Delivery(4))  # type: ignore[arg-type]  # resumed here, at once
    assert rid in service.inflight_ids
    ids, _, final = await asyncio.wait_for(asking, 20)
    assert final.finish_reason == "length" and final.attempt == 4, final
    assert ids == expected_tokens(2, 8, seed=4)
    await eventually(lambda: not service.engine.has_unfinished())  # nothing runs for nobody


@pytest.mark.parametrize("limit", ["max_tokens", "context"])
@pytest.mark.parametrize(
    ("stop", "delivered", "ending", "reason"),
    [
        ([], "hello wor", "\ufffd", "length"),  # an unfinished character: released as is
        (["world"], "hello ", "wor\ufffd", "length"),  # a stop string's start, never completed
        (["wor\ufffd"], "hello ", "", "stop"),  # ... completed by the released character
    ],
)
async def test_a_resumed_request_with_nothing_left_to_generate_still_sends_the_held_back_text(
    start_worker: Any,
    nc: Client,
    subjects: Subjects,
    worker_config: Config,
    limit: str,
    stop: list[str],
    delivered: str,
    ending: str,
    reason: str,
) -> None:
    """Its caller has every token (max_tokens reached) or every token the context holds,
    but not all their text: the first attempt was holding back the start of a stop string
    or a character whose bytes had not all come. The final chunk used to end it with no
    text, losing that tail; it now ends it as the first attempt would have."""
    tokens = [*b"hello wor", 0xC3]  # "é" cut after its first byte
    prompt = [ByteTokenizer.BOS, *b"say hi"]
    max_tokens = len(tokens) if limit == "max_tokens" else 64
    engine = SimEngine(
        max_batch_size=4, max_seq_len=len(prompt) + len(tokens), cost=SimCost(0, 0, 0),
        tokenizer=ByteTokenizer(),
    )  # fmt: skip
    rid, chunks = await _queued(
        nc, subjects, worker_config, prompt_token_ids=prompt, origin="gw",
        params=RequestParams(max_tokens=max_tokens, stop=stop, want_stop_reason=True),
    )  # fmt: skip
    js = nc.jetstream()
    first = await qnats.group_pull_subscription(js, worker_config.nats, "short")
    (msg,) = await first.fetch(1, timeout=5)
    await msg.nak()  # the first attempt's replica is gone
    await first.unsubscribe()

    async def answer(msg: Any) -> None:
        reply = ResumeReply(id=rid, token_ids=tokens, text_len=len(delivered))
        await msg.respond(reply.to_bytes())

    await nc.subscribe(subjects.resume(rid), cb=answer)
    await start_worker(engine=engine)
    final = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
    assert (final.text, final.finish_reason, final.seq) == (ending, reason, len(tokens))
    assert final.stop_reason == (stop[0] if reason == "stop" else None)
    assert final.token_ids == [] and final.usage is not None
    assert final.usage.completion_tokens == len(tokens)


async def test_a_copy_superseded_by_a_later_delivery_stops_without_acking_the_message(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """Its in_progress came late, JetStream redelivered the request to another replica,
    which resumed it. Ours went on generating for nobody, and finishing first it acked the
    message under the replica serving it (whose death then lost the request). Told by the
    gateway, it now stops, and leaves the message to the delivery the caller follows."""
    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.02))
    )
    rid, chunks = await _queued(
        nc, subjects, worker_config, prompt_token_ids=[1, 2], params=RequestParams(max_tokens=200)
    )
    await chunks.next_msg(timeout=5)  # serving delivery 1
    own = Control(action="supersede", request_id=rid, attempt=1)  # its own delivery: kept
    await nc.publish(subjects.abort("short"), own.to_bytes())
    # The abort subject's messages are handled in order: once an abort sent after it is
    # marked, the supersede was handled.
    await nc.publish(
        subjects.abort("short"), Control(action="abort", request_id="mark-1").to_bytes()
    )
    await eventually(lambda: "mark-1" in service._aborted)
    assert rid in service._inflight
    later = Control(action="supersede", request_id=rid, attempt=2, group="short")
    await nc.publish(subjects.abort("short"), later.to_bytes())
    await eventually(lambda: rid not in service._inflight)
    # The engine takes commands in order, and events and chunks keep theirs: once a request
    # queued after the abort was answered, anything the superseded one still had to say
    # (a final chunk from its engine abort, say) was sent before that answer.
    _, after = await _queued(nc, subjects, worker_config, prompt_token_ids=[3],
                             params=RequestParams(max_tokens=1))  # fmt: skip
    await read_until_final(after)
    # Its chunks came on this connection before that answer: all here now.
    while chunks.pending_msgs:  # what was on its way; no final chunk
        assert Chunk.from_bytes((await chunks.next_msg()).data).finish_reason is None
    # That answer's ack (sent after it, counted once sent) has reached the server too.
    await eventually(lambda: service.telemetry.requests_done == 1)
    await qnats.barrier(service.nc)
    info = await nc.jetstream().consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
    assert info.num_ack_pending == 1  # not acked: the message is the later delivery's
    assert rid not in service._aborted  # not cancelled either: the request lives on


async def test_a_supersede_that_comes_while_the_delivery_is_admitted_still_stops_it(
    start_worker: Any,
    nc: Client,
    subjects: Subjects,
    worker_config: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supersede looked only at requests in flight: one still being admitted (its resume
    query or its long prompt's tokenizing under way) missed it, then ran for nobody and,
    finishing first, acked the message under the replica its caller follows."""
    service = await start_worker()
    entered, release = threading.Event(), threading.Event()

    def held(engine: Any, prompt: str) -> list[int]:
        entered.set()
        release.wait(10)
        return [1, 2]  # what it stands for: a prompt that fits

    monkeypatch.setattr(worker_service, "encode_prompt", held)
    long_text = "w" * (worker_service.OFFLOAD_TOKENIZE_CHARS + 1)
    rid, chunks = await _queued(nc, subjects, worker_config, prompt=long_text,
                                params=RequestParams(max_tokens=2))  # fmt: skip
    await asyncio.to_thread(entered.wait, 5)  # delivery 1 is being admitted
    later = Control(action="supersede", request_id=rid, attempt=2, group="short")
    await nc.publish(subjects.abort("short"), later.to_bytes())
    await nc.publish(
        subjects.abort("short"), Control(action="abort", request_id="mark-2").to_bytes()
    )
    await eventually(lambda: "mark-2" in service._aborted)  # the supersede was handled
    release.set()
    await eventually(lambda: not service._starting)  # admission ended
    assert rid not in service._inflight
    assert not await service.bridge.call(lambda e: e.has_unfinished())
    await qnats.barrier(nc)
    assert chunks.pending_msgs == 0  # not a word: the caller follows delivery 2


async def test_the_final_chunk_names_the_stop_token_id_that_ended_the_output(
    start_worker: Any, client: QosClient
) -> None:
    await start_worker()
    third = expected_tokens(2, 3, seed=9)[2]
    for asked in (True, None):
        ids, _, final = await client.collect(
            group="short", prompt_token_ids=[1, 2],
            params=RequestParams(max_tokens=20, seed=9, stop_token_ids=[third],
                                 want_stop_reason=asked),
        )  # fmt: skip
        assert ids == expected_tokens(2, 3, seed=9)
        # Only to a caller that asked: one of an earlier release cannot decode the field.
        assert (final.finish_reason, final.stop_reason) == ("stop", third if asked else None)


async def test_a_request_its_caller_closed_while_we_were_cut_off_is_aborted(
    start_worker: Any, nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """The resync after a reconnect hears "closed" for a request still running here (its
    abort was sent while this replica was cut off): the engine stops it and frees its slot."""
    service = await start_worker(
        engine=SimEngine(max_batch_size=4, max_seq_len=256, cost=SimCost(base_s=0.02))
    )
    rid, chunks = await _queued(
        nc, subjects, worker_config, prompt_token_ids=[1, 2], params=RequestParams(max_tokens=200)
    )
    await chunks.next_msg(timeout=5)
    st = service._inflight[rid]
    service._caller_closed(st)
    while True:
        chunk = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
        if chunk.finish_reason is not None:
            break
    assert chunk.finish_reason == "abort" and chunk.seq < 200
    await eventually(lambda: rid not in service._inflight)


async def test_a_request_handed_back_on_its_last_delivery_gets_a_retryable_503_not_given_up(
    nc: Client, subjects: Subjects, worker_config: Config
) -> None:
    """Hand-backs that are no failure (a drain mid-poll, a stop's grace over, a stale
    delivery) used deliveries too: naked on the last, JetStream gave the request up, and its
    caller heard "failed on every delivery", not retryable. It now hears a 503."""
    from workers.intake import hand_back

    _, chunks = await _queued(
        nc, subjects, worker_config, prompt_token_ids=[1, 2], params=RequestParams(max_tokens=3)
    )
    js = nc.jetstream()
    psub = await qnats.group_pull_subscription(js, worker_config.nats, "short")
    max_deliver = worker_config.nats.max_deliver
    for attempt in range(1, max_deliver + 1):
        (msg,) = await psub.fetch(1, timeout=5)
        assert msg.metadata.num_delivered == attempt
        await hand_back(nc, msg, "w0", max_deliver, subjects)  # a nak, until the last
    chunk = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
    assert chunk.error is not None and chunk.error.code == "service_unavailable"
    assert (chunk.finish_reason, chunk.attempt) == ("error", max_deliver)
    info = await js.consumer_info(worker_config.nats.stream, Subjects.consumer("short"))
    assert info.num_pending == 0 and info.num_ack_pending == 0  # ended, not kept for good
    await psub.unsubscribe()


async def test_a_scheduler_control_issued_long_ago_is_a_replay_and_ignored(
    start_worker: Any, nc: Client, subjects: Subjects
) -> None:
    """A deposed scheduler's publishes, queued by nats-py while it was cut off, go out when
    it reconnects: a move the leader of today never decided. Stamped, they are told apart."""
    service = await start_worker()
    old = int((time.time() - 120) * 1000)
    replay = Control(action="assign_group", group="long", issued_ms=old, reason="replayed")
    await nc.publish(subjects.control("w0"), replay.to_bytes())
    cap = Control(action="set_batch_cap", group="short", batch_cap=1, issued_ms=old)
    await nc.publish(subjects.control_group("short"), cap.to_bytes())
    abort_ok = Control(action="abort", request_id="r-old", issued_ms=old)  # not a decision
    await nc.publish(subjects.abort("short"), abort_ok.to_bytes())
    # Each subject's messages are handled in order: once an abort sent after the replay on
    # each subject is marked, the replays were handled.
    for subject, mark in ((subjects.control("w0"), "mark-own"),
                          (subjects.control_group("short"), "mark-group")):  # fmt: skip
        await nc.publish(subject, Control(action="abort", request_id=mark).to_bytes())
    await eventually(lambda: "mark-own" in service._aborted and "mark-group" in service._aborted)
    await eventually(lambda: "r-old" in service._aborted)  # its own subject: taken, though old
    # No move was even begun (its group changes only once it binds): no task for one.
    assert [t for t in service._tasks if t.get_name() == "assign-group"] == []
    assert service.group == "short" and service.state == "serving"
    assert service.bridge.batch_cap > 1
    fresh = Control(action="set_batch_cap", group="short", batch_cap=1,
                    issued_ms=int(time.time() * 1000))  # fmt: skip
    await nc.publish(subjects.control_group("short"), fresh.to_bytes())
    await eventually(lambda: service.bridge.batch_cap == 1)
