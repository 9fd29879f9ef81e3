"""The NATS-native client (``common/client.py``) against a real nats-server, its worker
played by the test on the ``long`` group (no service serves it here): what the client
does with each kind of chunk, resume query and publish failure, as the gateway does."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

import common.client as client_module
import common.nats as qnats
from common.client import QosClient
from common.config import Config
from common.errors import (
    InvalidRequestError,
    ProtocolError,
    ServiceUnavailableError,
)
from common.protocol import (
    Chunk,
    Control,
    ErrorInfo,
    GenerateRequest,
    RequestParams,
    ResumeQuery,
    ResumeReply,
    Usage,
    heartbeat_reconnects,
)
from common.services import NatsServer
from common.subjects import Subjects


@pytest.fixture
async def played(nc: Client, worker_config: Config, subjects: Subjects) -> dict[str, Any]:
    """What reaches the ``long`` group: requests (with their headers) and controls."""
    await qnats.ensure_jetstream(nc.jetstream(), worker_config.nats, worker_config.groups)
    seen: dict[str, Any] = {"requests": asyncio.Queue(), "controls": []}

    async def on_request(msg: Msg) -> None:
        seen["requests"].put_nowait(msg)

    async def on_control(msg: Msg) -> None:
        seen["controls"].append(Control.from_bytes(msg.data))

    await nc.subscribe(subjects.request("long"), cb=on_request)  # a copy of each publish
    await nc.subscribe(subjects.abort("long"), cb=on_control)
    await qnats.barrier(nc)
    return seen


async def _run(
    client: QosClient, played: dict[str, Any], worker: Callable[[str], Awaitable[None]], **kw: Any
) -> tuple[list[Chunk], BaseException | None]:
    """Run one request; ``worker(request id)`` plays the worker once it is published."""
    got: list[Chunk] = []
    slow_s = kw.pop("slow_s", 0.0)  # the reader's time per chunk

    async def read() -> None:
        async for chunk in client.generate(group="long", prompt_token_ids=[1, 2], **kw):
            got.append(chunk)
            await asyncio.sleep(slow_s)

    reader = asyncio.ensure_future(read())
    msg = await asyncio.wait_for(played["requests"].get(), 5)
    await worker(GenerateRequest.from_bytes(msg.data).id)
    try:
        await asyncio.wait_for(reader, 10)
    except Exception as exc:
        return got, exc
    return got, None


async def _wait_for(predicate: Callable[[], bool]) -> None:
    for _ in range(100):
        if predicate():
            return
        await asyncio.sleep(0.02)


async def test_a_workers_protocol_error_reaches_the_caller_as_its_own(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """An older worker refusing a field during a rolling upgrade answers protocol_error:
    the client's own catch for undecodable chunks took it for an internal error (a server
    fault, retryable) and aborted a worker that had already finished."""

    async def refuse(rid: str) -> None:
        error = ErrorInfo("protocol_error", "request: unknown key 'want_stop_reason'")
        chunk = Chunk(id=rid, finish_reason="error", error=error)
        await nc.publish(subjects.out(rid), chunk.to_bytes())

    _, exc = await _run(client, played, refuse)
    assert isinstance(exc, ProtocolError) and exc.code == "protocol_error"
    await qnats.barrier(client.nc)  # an abort it sent has reached the server ...
    await qnats.barrier(nc)  # ... and this connection
    assert not [c for c in played["controls"] if c.action == "abort"]


async def test_a_gap_that_never_fills_aborts_the_worker(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """The client gave up on the stream but left its worker generating for nobody. Chunks
    past the gap beyond those held are dropped (the resync would resend them), and the gap
    ends the answer, retryable, once no resync filled it."""

    async def gap(rid: str) -> None:
        for seq in range(1, 300):  # seq 0 never comes
            await nc.publish(subjects.out(rid), Chunk(id=rid, seq=seq, token_ids=[5]).to_bytes())

    _, exc = await _run(client, played, gap)
    assert isinstance(exc, ServiceUnavailableError) and "lost" in exc.message
    await _wait_for(lambda: any(c.action == "abort" for c in played["controls"]))
    assert any(c.action == "abort" for c in played["controls"])


async def _send_all_but_the_middle(nc: Client, subjects: Subjects, rid: str) -> str:
    """Three one-token chunks, the middle one lost on the way; the chunks' subject."""
    out = subjects.out(rid)
    await nc.publish(out, Chunk(id=rid, seq=0, token_ids=[7], text="a").to_bytes())
    final = Chunk(id=rid, seq=2, token_ids=[9], text="c", finish_reason="length",
                  usage=Usage(2, 3, 0))  # fmt: skip
    await nc.publish(out, final.to_bytes())  # seq 1 lost
    return out


async def test_a_chunk_lost_without_a_reconnect_is_asked_for_again_and_the_answer_ends(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """The client had no gap watch: a chunk lost with no reconnect (a slow consumer's
    overflow, a route flap) left it waiting to its timeout while a gateway's stream, in
    the same case, asked the workers to resync within a second."""
    beats = await nc.subscribe(subjects.gateway_heartbeat(client.client_id))

    async def lose_one_then_resend_on_resync(rid: str) -> None:
        out = await _send_all_but_the_middle(nc, subjects, rid)
        with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
            async with asyncio.timeout(5):
                while not heartbeat_reconnects((await beats.next_msg(timeout=5)).data):
                    pass  # the client's beat carries its resync request
                await nc.publish(out, Chunk(id=rid, seq=1, token_ids=[8], text="b").to_bytes())

    got, exc = await _run(client, played, lose_one_then_resend_on_resync)
    assert exc is None and [c.token_ids for c in got] == [[7], [8], [9]]


async def test_a_gap_nobody_fills_ends_with_a_retryable_error_not_at_the_timeout(
    client: QosClient,
    nc: Client,
    played: dict[str, Any],
    subjects: Subjects,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_module, "GAP_GIVE_UP_S", 1.0)

    async def lose_one_and_forget(rid: str) -> None:
        await _send_all_but_the_middle(nc, subjects, rid)  # and never resend it

    got, exc = await _run(client, played, lose_one_and_forget, timeout_s=60.0)
    assert [c.token_ids for c in got] == [[7]]
    assert isinstance(exc, ServiceUnavailableError) and exc.retry_after_s == 1
    assert "lost on the way" in exc.message


async def test_what_arrived_before_the_deadline_is_delivered_to_a_slow_reader(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """Past the deadline the client raised at once, though the final chunk (usage and all)
    was waiting in its queue: a reader slower than its worker lost a finished answer."""

    async def answer(rid: str) -> None:
        out = subjects.out(rid)
        await nc.publish(out, Chunk(id=rid, seq=0, token_ids=[7], text="a").to_bytes())
        final = Chunk(id=rid, seq=1, token_ids=[8], text="b", finish_reason="length",
                      usage=Usage(2, 2, 0))  # fmt: skip
        await nc.publish(out, final.to_bytes())

    got, exc = await _run(client, played, answer, timeout_s=2.0, slow_s=2.5)
    assert exc is None and [c.token_ids for c in got] == [[7], [8]]
    assert got[-1].usage == Usage(2, 2, 0)


async def test_an_answered_resume_query_supersedes_the_earlier_attempt(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """The gateway tells a replica still on an earlier delivery to stop; the client did
    not, and that replica could ack the message under the one the stream follows."""

    async def resumed(rid: str) -> None:
        out = subjects.out(rid)
        await nc.publish(out, Chunk(id=rid, seq=0, token_ids=[7]).to_bytes())
        await asyncio.sleep(0.1)
        query = ResumeQuery(id=rid, attempt=2, worker="w2")
        answer = await nc.request(subjects.resume(rid), query.to_bytes(), timeout=2)
        assert ResumeReply.from_bytes(answer.data).token_ids == [7]
        # A query naming another request on this one's subject steers nothing.
        other = ResumeQuery(id="someone-else", attempt=5, worker="w3")
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(subjects.resume(rid), other.to_bytes(), timeout=0.3)
        final = Chunk(id=rid, seq=1, attempt=2, token_ids=[8], finish_reason="length")
        await nc.publish(out, final.to_bytes())

    got, exc = await _run(client, played, resumed)
    assert exc is None and [t for c in got for t in c.token_ids] == [7, 8]
    supersedes = [c for c in played["controls"] if c.action == "supersede"]
    assert len(supersedes) == 1 and supersedes[0].attempt == 2


async def test_requests_carry_the_clients_heartbeat_id_and_the_callers_headers(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """Without an origin, workers neither aborted a dead client's requests nor re-sent
    what a reconnect of the client's own link swallowed (it hung to its deadline); and a
    caller could not pass its trace context."""
    beats: list[bytes] = []

    async def on_beat(msg: Msg) -> None:
        beats.append(msg.data)

    await nc.subscribe(subjects.gateway_heartbeat(client.client_id), cb=on_beat)
    await qnats.barrier(nc)
    traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    reader = asyncio.ensure_future(
        client.collect(group="long", prompt_token_ids=[1], headers={"traceparent": traceparent})
    )
    msg = await asyncio.wait_for(played["requests"].get(), 5)
    request = GenerateRequest.from_bytes(msg.data)
    assert request.origin == client.client_id
    assert msg.headers is not None and msg.headers["traceparent"] == traceparent
    await _wait_for(lambda: bool(beats))
    assert beats  # workers hear the client as they hear a gateway
    final = Chunk(id=request.id, seq=0, token_ids=[3], finish_reason="length")
    await nc.publish(subjects.out(request.id), final.to_bytes())
    ids, _, _ = await asyncio.wait_for(reader, 5)
    assert ids == [3]


async def test_a_publish_whose_ack_timed_out_is_asked_again_under_the_same_id(
    client: QosClient, start_worker: Any, worker_config: Config, nc: Client
) -> None:
    """A timed-out publish raised at once: the stored message ran for nobody, and a retry
    with the same request id was refused as "in use"."""
    await start_worker()
    publish = client.js.publish
    calls = []

    async def late_ack(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("headers"))
        ack = await publish(*args, **kwargs)
        if len(calls) == 1:
            raise nats.errors.TimeoutError  # stored, but the ack came too late
        return ack

    client.js.publish = late_ack  # type: ignore[method-assign]
    ids, _, final = await client.collect(
        group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=3)
    )
    assert len(calls) == 2 and calls[0]["Nats-Msg-Id"] == calls[1]["Nats-Msg-Id"]
    assert final.finish_reason is not None and len(ids) == 3
    stream = worker_config.nats.stream
    for _ in range(100):  # the worker acks after its final chunk
        if not (await nc.jetstream().stream_info(stream)).state.messages:
            break
        await asyncio.sleep(0.02)
    assert (await nc.jetstream().stream_info(stream)).state.messages == 0  # served, acked


async def test_a_request_whose_publish_outcome_is_unknown_is_aborted(
    client: QosClient, played: dict[str, Any]
) -> None:
    """Every publish timed out, though JetStream may have stored the message (a late ack):
    the client answered 503 and sent no abort, so the stored request ran for nobody."""
    publish = client.js.publish

    async def stored_but_late(*args: Any, **kwargs: Any) -> Any:
        await publish(*args, **kwargs)
        raise nats.errors.TimeoutError

    client.js.publish = stored_but_late  # type: ignore[method-assign]
    with pytest.raises(ServiceUnavailableError):
        await client.collect(group="long", prompt_token_ids=[1], timeout_s=1.0)
    await _wait_for(lambda: any(c.action == "abort" for c in played["controls"]))
    assert any(c.action == "abort" for c in played["controls"])


async def test_a_finished_requests_redelivered_copy_is_answered_closed(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """After the final chunk the client stopped answering: a copy redelivered after a lost
    ack got silence and, its origin still beating, was handed back delivery after delivery."""
    ids: list[str] = []

    async def finish(rid: str) -> None:
        ids.append(rid)
        final = Chunk(id=rid, seq=0, token_ids=[4], finish_reason="length")
        await nc.publish(subjects.out(rid), final.to_bytes())

    _, exc = await _run(client, played, finish)
    assert exc is None and len(ids) == 1
    query = ResumeQuery(id=ids[0], attempt=2, worker="w2")
    answer = await nc.request(subjects.resume(ids[0]), query.to_bytes(), timeout=2)
    assert ResumeReply.from_bytes(answer.data).closed
    # Another caller's request is not this client's to answer.
    with pytest.raises(nats.errors.TimeoutError):
        other = ResumeQuery(id="not-ours", attempt=2, worker="w2")
        await nc.request(subjects.resume("not-ours"), other.to_bytes(), timeout=0.3)


async def test_a_user_that_may_not_heartbeat_sends_no_origin_rather_than_be_reaped(
    fresh_nats_server: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Beats refused by the server (asynchronously: publish does not raise) left requests
    with an origin no worker ever heard: reaped as orphans within orphan_after_s. The
    check's own barrier refused too (nats-py keeps only the last error) must not hide it."""
    from common.config import NatsConfig

    server = fresh_nats_server(
        extra_config="""
authorization {
  users = [ { user: "cl", password: "pw-1",
              permissions: { publish: { deny: ["qos.gw.>", "$JS.API.INFO"] } } } ]
}
"""
    )
    cfg = NatsConfig(url=server.url, user="cl", password="pw-1")
    async with await QosClient.connect(cfg, "no-beats") as client:
        with caplog.at_level("WARNING"):
            await client._start()
        assert client.origin == "" and "refused this client's heartbeat" in caplog.text
    async with await QosClient.connect(cfg, "no-beats-2", heartbeat=False) as quiet:
        await quiet._start()  # asked not to: no beat, no origin
        assert quiet.origin == "" and quiet._heartbeat._task is None


async def test_a_duplicate_id_is_not_answered_closed_while_its_request_runs(
    client: QosClient, played: dict[str, Any]
) -> None:
    """A request id refused as a duplicate went into the finished set: the client then
    answered "closed" for the live request with that id, and its worker dropped it."""
    running = asyncio.ensure_future(
        client.collect(group="long", prompt_token_ids=[1], request_id="dup-1", timeout_s=5)
    )
    await asyncio.wait_for(played["requests"].get(), 5)
    with pytest.raises(InvalidRequestError, match="in use"):
        await client.collect(group="long", prompt_token_ids=[1], request_id="dup-1")
    assert "dup-1" not in client._closed and "dup-1" in client._live
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert "dup-1" in client._closed and "dup-1" not in client._live  # ours, finished


async def test_a_workers_abort_is_a_retryable_error_not_a_short_answer(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """A worker that gave the request up (its origin fell silent, an operator) ends it with
    finish_reason "abort": collect() returned the tokens so far as if complete."""

    async def give_up(rid: str) -> None:
        out = subjects.out(rid)
        await nc.publish(out, Chunk(id=rid, seq=0, token_ids=[7], text="a").to_bytes())
        await nc.publish(out, Chunk(id=rid, seq=1, finish_reason="abort").to_bytes())

    got, exc = await _run(client, played, give_up)
    assert isinstance(exc, ServiceUnavailableError) and exc.retry_after_s == 1
    assert [c.token_ids for c in got] == [[7]]
    await qnats.barrier(client.nc)
    await qnats.barrier(nc)
    assert not [c for c in played["controls"] if c.action == "abort"]  # nothing left to abort


async def test_closing_the_client_ends_its_calls_in_flight_and_aborts_them(
    worker_config: Config, nc: Client, played: dict[str, Any]
) -> None:
    """A shutdown handler's close() left each running generate() waiting for its deadline
    (120 s by default), then raising a misleading DeadlineExceededError."""
    client = await QosClient.connect(worker_config, "test-client")
    errors: list[BaseException] = []

    async def read() -> None:
        try:
            async for _ in client.generate(group="long", prompt_token_ids=[1, 2]):
                pass
        except BaseException as exc:
            errors.append(exc)

    reader = asyncio.ensure_future(read())
    await asyncio.wait_for(played["requests"].get(), 5)  # published, no answer coming
    await asyncio.wait_for(client.close(), 5)
    await asyncio.wait_for(reader, 5)
    assert len(errors) == 1 and isinstance(errors[0], ServiceUnavailableError), errors
    assert "closed" in errors[0].message
    await _wait_for(lambda: any(c.action == "abort" for c in played["controls"]))
    assert any(c.action == "abort" for c in played["controls"])


async def _call_waiting_for_chunks(
    client: QosClient, next_request: Callable[[], Awaitable[Msg]], worker_nc: Client
) -> asyncio.Future[BaseException]:
    """One call (60 s deadline) past its publish, waiting for chunks (the worker played by
    ``worker_nc`` sent it one): its error once it ends."""
    first = asyncio.Event()

    async def read() -> BaseException:
        try:
            async for _ in client.generate(group="long", prompt_token_ids=[1, 2], timeout_s=60):
                first.set()
        except BaseException as exc:
            return exc
        raise AssertionError("the call ended without an error")

    call = asyncio.ensure_future(read())
    rid = GenerateRequest.from_bytes((await asyncio.wait_for(next_request(), 5)).data).id
    await worker_nc.publish(client.subjects.out(rid), Chunk(id=rid, token_ids=[7]).to_bytes())
    await asyncio.wait_for(first.wait(), 5)  # read: the publish is acked, the call waits
    return call


async def _refused_at_once(client: QosClient) -> None:
    with pytest.raises(ServiceUnavailableError, match="connection is closed"):
        async for _ in client.generate(group="long", prompt_token_ids=[1, 2], timeout_s=60):
            pass


async def test_a_connection_closed_for_good_ends_the_calls_in_flight_at_once(
    worker_config: Config, nc: Client, played: dict[str, Any]
) -> None:
    """nats-py closing the connection for good (credentials refused after a rotation,
    reconnect attempts spent) left each call waiting out its deadline (120 s by default),
    and a later generate() raised nats-py's raw ConnectionClosedError."""
    client = await QosClient.connect(worker_config, "test-client")
    try:
        call = await _call_waiting_for_chunks(client, played["requests"].get, nc)
        t0 = time.monotonic()
        await client.nc.close()  # what nats-py does when it gives up: its closed callback
        error = await asyncio.wait_for(call, 5)
        assert isinstance(error, ServiceUnavailableError), error
        assert error.retry_after_s and time.monotonic() - t0 < 0.5  # not a 1 s look either
        await _refused_at_once(client)
        assert not client._failers and not client._live
    finally:
        await client.close()


async def test_a_nats_server_gone_for_good_ends_the_calls_in_flight(
    worker_config: Config, fresh_nats_server: Callable[..., NatsServer]
) -> None:
    """The same when the reconnect attempts run out on a server that stays down."""
    server = fresh_nats_server()
    cfg = worker_config.nats.model_copy(
        update={"url": server.url, "max_reconnect_attempts": 1, "reconnect_wait_s": 0.1}
    )
    config = worker_config.model_copy(update={"nats": cfg})
    setup = await qnats.connect(cfg, "setup")
    await qnats.ensure_jetstream(setup.jetstream(), cfg, config.groups)
    requests = await setup.subscribe(Subjects(cfg.subject_prefix).request("long"))
    await qnats.barrier(setup)
    client = await QosClient.connect(config, "test-client")
    try:
        call = await _call_waiting_for_chunks(client, requests.next_msg, setup)
        t0 = time.monotonic()
        server.stop()
        error = await asyncio.wait_for(call, 15)
        assert isinstance(error, ServiceUnavailableError), error
        assert client.nc.is_closed and time.monotonic() - t0 < 10  # not the 60 s deadline
        await _refused_at_once(client)
    finally:
        await client.close()
        await setup.close()


async def test_a_connection_the_caller_owns_closing_ends_the_calls_in_flight_too(
    worker_config: Config, nc: Client, played: dict[str, Any]
) -> None:
    """QosClient(nc) cannot hear nc's closed callback: its calls look once a second."""
    own = await qnats.connect(worker_config.nats, "callers-own")
    client = QosClient(own, Subjects(worker_config.nats.subject_prefix),
                       stream=worker_config.nats.stream)  # fmt: skip
    try:
        call = await _call_waiting_for_chunks(client, played["requests"].get, nc)
        t0 = time.monotonic()
        await own.close()
        error = await asyncio.wait_for(call, 5)
        assert isinstance(error, ServiceUnavailableError), error
        assert time.monotonic() - t0 < client_module.CLOSED_CHECK_S + 0.5
        await _refused_at_once(client)
    finally:
        await client.close()


async def test_a_group_the_configuration_lacks_is_refused_before_it_is_published(
    client: QosClient, played: dict[str, Any]
) -> None:
    """JetStream's stream takes P.req.* and stored a request for a misspelt group, whose
    caller then waited out its whole deadline."""
    with pytest.raises(InvalidRequestError) as info:
        async for _ in client.generate(group="shrot", prompt_token_ids=[1, 2], timeout_s=30):
            pass
    assert info.value.param == "group" and "shrot" in info.value.message
    assert played["requests"].empty()

    async def finish(rid: str) -> None:  # a configured group goes through
        final = Chunk(id=rid, seq=0, token_ids=[7], finish_reason="length", usage=Usage(2, 1, 0))
        await client.nc.publish(client.subjects.out(rid), final.to_bytes())

    got, exc = await _run(client, played, finish)
    assert exc is None and got[-1].finish_reason == "length"


async def test_a_call_cancelled_again_while_it_aborts_leaves_no_state_behind(
    client: QosClient, played: dict[str, Any]
) -> None:
    """The abort after a cancel is a round trip (the message's delete); anyio's scopes
    cancel again at every await, and that second cancel skipped the call's cleanup: its
    sequencer and queue stayed in the client for good, and close() waited on them."""
    gate, aborting = asyncio.Event(), asyncio.Event()
    abort = client._abort

    async def slow_abort(*args: Any, **kwargs: Any) -> None:
        aborting.set()
        await gate.wait()  # the delete's round trip, long enough to be cancelled in
        await abort(*args, **kwargs)

    client._abort = slow_abort  # type: ignore[method-assign]
    reader = asyncio.ensure_future(client.collect(group="long", prompt_token_ids=[1]))
    await asyncio.wait_for(played["requests"].get(), 5)
    assert client._failers
    # The caller stops: the call aborts. A cancel can be lost inside nats-py's publish
    # (its wait_for on 3.11 swallows one that comes with the ack), so until the abort
    # has begun it is said again.
    for _ in range(250):
        reader.cancel()
        await asyncio.sleep(0.02)
        if aborting.is_set():
            break
    assert aborting.is_set()
    reader.cancel()  # and again, mid-abort
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(reader, 5)
    assert not client._failers


async def test_a_calls_timeout_runs_on_the_monotonic_clock(
    client: QosClient, played: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait was measured on the wall clock: an NTP step forward mid-call ended a healthy
    request at once, with a DeadlineExceededError and an abort to its worker."""
    reader = asyncio.ensure_future(client.collect(group="long", prompt_token_ids=[1], timeout_s=30))
    msg = await asyncio.wait_for(played["requests"].get(), 5)
    rid = GenerateRequest.from_bytes(msg.data).id
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 120)  # the clock stepped 2 min on
    await asyncio.sleep(client_module.CLOSED_CHECK_S + 0.2)  # a wait has timed out since
    assert not reader.done()
    chunk = Chunk(id=rid, seq=0, token_ids=[5], text="f", finish_reason="stop",
                  usage=Usage(1, 1))  # fmt: skip
    await client.nc.publish(client.subjects.out(rid), chunk.to_bytes())
    ids, _, final = await asyncio.wait_for(reader, 5)
    assert ids == [5] and final.finish_reason == "stop"


async def test_a_redelivery_refused_as_undecodable_ends_the_call_that_followed_its_first_worker(
    client: QosClient, nc: Client, played: dict[str, Any], subjects: Subjects
) -> None:
    """A worker that cannot read a redelivered request (an older version, a field it does
    not know) answered with an error chunk stamped attempt 1: the caller, following the
    first delivery's worker, took it for a second run of that delivery, dropped it, and
    waited to its deadline."""
    from workers.intake import reject_undecodable

    async def dies_then_refused(rid: str) -> None:
        first = Chunk(id=rid, seq=0, attempt=1, token_ids=[5], text="f", worker="w-a")
        await nc.publish(subjects.out(rid), first.to_bytes())
        await asyncio.sleep(0.05)  # w-a died; the request's second delivery reaches w-b
        redelivered = SimpleNamespace(data=GenerateRequest(id=rid, group="long",
                                                           reply=subjects.out(rid)).to_bytes(),
                                      term=lambda: asyncio.sleep(0))  # fmt: skip
        refused = ProtocolError("request: unknown field(s) 'newer'")
        await reject_undecodable(nc, redelivered, refused, "w-b", subjects, attempt=2)  # type: ignore[arg-type]

    started = time.monotonic()
    got, exc = await _run(client, played, dies_then_refused, timeout_s=8)
    assert isinstance(exc, ProtocolError) and "newer" in exc.message, exc
    assert [c.token_ids for c in got] == [[5]] and time.monotonic() - started < 4


async def test_a_call_cancelled_as_its_ack_came_deletes_its_queued_request(
    client: QosClient, played: dict[str, Any], worker_config: Config
) -> None:
    """The cancel that came with JetStream's ack (dropped by nats-py's wait_for on 3.11) is
    raised again after the publish; raised bare, it lost the ack's sequence, and the abort
    left the request in the stream for a later replica to run for nobody."""
    publish = client.js.publish

    async def ack_with_the_cancel(*args: Any, **kwargs: Any) -> Any:
        ack = await publish(*args, **kwargs)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)  # the caller's cancel lands here, as the ack does
        return ack

    client.js.publish = ack_with_the_cancel  # type: ignore[method-assign]
    reader = asyncio.ensure_future(client.collect(group="long", prompt_token_ids=[1]))
    await asyncio.wait_for(played["requests"].get(), 5)
    await asyncio.sleep(0.1)  # inside the publish, its ack in hand
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(reader, 5)
    for _ in range(50):  # the delete goes out after the abort
        info = await client.js.stream_info(worker_config.nats.stream)
        if info.state.messages == 0:
            break
        await asyncio.sleep(0.05)
    assert info.state.messages == 0, info.state
