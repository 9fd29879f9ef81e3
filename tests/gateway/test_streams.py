"""Every token exactly once, in order: reordering, overlap trimming, resume after redelivery."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import nats.errors
import pytest

from common import nats as qnats
from common.config import NatsConfig
from common.errors import DeadlineExceededError, RateLimitError
from common.heartbeat import idle_request_ids
from common.protocol import (
    Chunk,
    Control,
    ErrorInfo,
    ResumeQuery,
    ResumeReply,
    Usage,
    heartbeat_reconnects,
)
from common.subjects import Subjects
from gateway import generate, streams
from gateway.streams import Delivery, Dispatcher, ResponseStream, SseResponse
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import Job, alphabet_tokens, running_worker


def _stream() -> ResponseStream:
    # Token ids are bytes here: the tail's text is just those bytes.
    return ResponseStream("cmpl-x", "short", lambda _done, new: bytes(new).decode())


def _chunk(seq: int, text: str, attempt: int = 1, **kwargs: object) -> Chunk:
    return Chunk(
        id="cmpl-x", seq=seq, attempt=attempt, token_ids=list(text.encode()), text=text, **kwargs
    )  # type: ignore[arg-type]


def _drain(stream: ResponseStream) -> list[Delivery]:
    out = []
    while stream._ready:
        out.append(stream._ready.popleft())
    return out


def test_a_stream_the_gateway_ends_itself_says_why_in_its_log(caplog: pytest.LogCaptureFixture):
    """Ending a stream on its own verdict (two runs disagreeing, a gap that never fills),
    the gateway aborted the worker and told only the client: no line said why."""
    stream = _stream()
    stream.feed(_chunk(0, "abc"))
    with caplog.at_level(logging.WARNING, logger="gateway.streams"):
        stream.feed(_chunk(1, "xd"))  # position 1 was "b"
    (delivery,) = [d for d in _drain(stream) if d.error is not None]
    assert "two runs" in delivery.error.message and not stream.worker_done
    assert [r.getMessage() for r in caplog.records] == [
        f"request cmpl-x: ending it: {delivery.error.message}"
    ]


def test_a_stream_the_gateway_failed_answers_resume_queries_closed():
    """Failed by the gateway's own verdict (a gap given up, an undecodable chunk), it still
    told a redelivered attempt where to resume, which then generated for nobody until the
    error had reached the reader (the NATS client answered closed)."""
    stream = _stream()
    stream.feed(_chunk(0, "abc"))
    stream.fail(RateLimitError("given up"))
    assert stream.resume(ResumeQuery(id="cmpl-x", attempt=2)).closed


def test_out_of_order_chunks_are_held_until_the_gap_fills():
    stream = _stream()
    stream.feed(_chunk(3, "def"))
    stream.feed(_chunk(6, "g", finish_reason="stop"))
    assert _drain(stream) == []
    stream.feed(_chunk(0, "abc"))
    out = _drain(stream)
    assert "".join(d.text for d in out) == "abcdefg" and out[-1].finish_reason == "stop"
    assert stream.token_ids == list(b"abcdefg")


def test_overlapping_chunk_is_trimmed_to_the_new_tokens():
    stream = _stream()
    stream.feed(_chunk(0, "abcd"))
    stream.feed(_chunk(2, "cdef"))
    stream.feed(_chunk(1, "bc"))  # nothing new: dropped
    assert [d.text for d in _drain(stream)] == ["abcd", "ef"]


def test_text_without_tokens_is_delivered_when_it_is_new():
    stream = _stream()
    stream.feed(Chunk(id="cmpl-x", seq=0, token_ids=[0xC3], text=""))  # half a character
    stream.feed(Chunk(id="cmpl-x", seq=1, token_ids=[0xA9], text=""))
    stream.feed(Chunk(id="cmpl-x", seq=2, text="é"))  # the detokenizer lets it go
    stream.feed(Chunk(id="cmpl-x", seq=1, text="stale"))  # behind what was delivered
    assert "".join(d.text for d in _drain(stream)) == "é"
    assert stream.token_ids == [0xC3, 0xA9] and stream.text_len == 1


def test_resume_reports_what_was_delivered_and_silences_older_attempts():
    stream = _stream()
    stream.feed(_chunk(0, "abc"))
    stream.feed(_chunk(5, "fg"))  # past a gap: a newer attempt will resend it
    reply = stream.resume(ResumeQuery(id="cmpl-x", attempt=2))
    assert reply.token_ids == list(b"abc") and reply.text_len == 3
    stream.feed(_chunk(3, "de"))  # attempt 1, stale
    stream.feed(_chunk(3, "xy", attempt=2))
    stream.feed(_chunk(5, "z", attempt=2, finish_reason="length"))
    assert "".join(d.text for d in _drain(stream)) == "abcxyz"


def test_error_chunk_ends_the_stream_with_the_matching_error():
    stream = _stream()
    stream.feed(_chunk(0, "ab"))
    stream.feed(
        Chunk(id="cmpl-x", seq=2, error=ErrorInfo(code="deadline_exceeded", message="late"))
    )
    stream.feed(_chunk(2, "cd"))  # after the end: ignored
    out = _drain(stream)
    assert len(out) == 2 and isinstance(out[1].error, DeadlineExceededError)


def test_abort_finish_reason_is_an_error_not_a_finish():
    stream = _stream()
    stream.feed(_chunk(0, "", finish_reason="abort"))
    (delivery,) = _drain(stream)
    assert delivery.error is not None and delivery.error.http_status == 503


async def test_next_times_out_without_chunks_and_wakes_on_one():
    stream = _stream()
    assert await stream.next(0.01) is None
    asyncio.get_running_loop().call_later(0.01, stream.feed, _chunk(0, "a"))
    delivery = await stream.next(1.0)
    assert delivery is not None and delivery.text == "a"


def test_error_codes_map_to_their_types():
    stream = _stream()
    stream.feed(Chunk(id="cmpl-x", error=ErrorInfo(code="rate_limit_exceeded", message="busy")))
    assert isinstance(_drain(stream)[0].error, RateLimitError)


# -- over a real nats-server ----------------------------------------------------------------


def _sse_payloads(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]


async def test_redelivered_request_resumes_and_the_client_sees_every_token_once(
    nats_config: NatsConfig,
):
    subjects = Subjects(nats_config.subject_prefix)
    replies: list[ResumeReply] = []
    supersedes: list[Control] = []
    ids = alphabet_tokens(10)

    async def crash_and_resume(job: Job) -> None:
        request_id = job.request.id
        await job.send(0, ids[0:5])  # attempt 1 delivers tokens 0..4, then "dies"
        aborts = await job.worker.nc.subscribe(subjects.abort("short"))
        # The replica that gets the redelivery asks what the client already has.
        query = ResumeQuery(id=request_id, attempt=2, worker="w2")
        answer = await job.worker.nc.request(
            subjects.resume(request_id), query.to_bytes(), timeout=2
        )
        replies.append(ResumeReply.from_bytes(answer.data))
        # ... and a replica still serving attempt 1 (not dead, only late) is told to stop.
        supersedes.append(Control.from_bytes((await aborts.next_msg(timeout=2)).data))
        # That replica, cut off meanwhile, resyncs with its own attempt: told to stop too.
        stale = ResumeQuery(id=request_id, attempt=1, worker="w1")
        await job.worker.nc.request(subjects.resume(request_id), stale.to_bytes(), timeout=2)
        supersedes.append(Control.from_bytes((await aborts.next_msg(timeout=2)).data))
        await aborts.unsubscribe()
        await job.send(5, ids[5:7], attempt=2)
        await job.send(3, ids[3:8], attempt=2)  # overlaps 3..6, adds 7
        await job.send(1, ids[1:3])  # the first attempt, late: ignored
        usage = Usage(len(job.request.prompt_token_ids), 10, 0)
        await job.send(8, ids[8:10], attempt=2, finish_reason="length", usage=usage)

    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=crash_and_resume),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        body = {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = _sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "abcdefghij"
    assert events[-1]["usage"]["completion_tokens"] == 10
    assert replies and replies[0].token_ids == ids[0:5] and replies[0].text_len == 5
    for supersede in supersedes:
        assert (supersede.action, supersede.attempt) == ("supersede", 2)
        assert supersede.request_id == replies[0].id
    assert len(supersedes) == 2


async def _send_all_but_the_middle(job: Job, ids: list[int]) -> None:
    """Nine tokens in three chunks, the middle one lost on the way."""
    await job.send(0, ids[0:3])
    usage = Usage(len(job.request.prompt_token_ids), 9, 0)
    await job.send(6, ids[6:9], finish_reason="length", usage=usage)  # 3..5 lost


async def _nine_tokens(
    nats_config: NatsConfig, behaviour: Callable[[Job], Awaitable[None]]
) -> tuple[httpx.Response, float, int]:
    """A nine-token completion through a gateway, its worker played by ``behaviour``: the
    answer, the seconds it took, and the streams the gateway still held after it."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=behaviour),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        started = time.monotonic()
        reply = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 9}
        )
        waited = time.monotonic() - started
        return reply, waited, gw.app.state.gateway.dispatch.dispatcher.open_streams


async def test_a_gap_that_stays_open_asks_the_workers_to_resync_and_is_filled(
    nats_config: NatsConfig,
):
    """A chunk lost without a reconnect (nats-py dropping a slow consumer's messages, a
    cluster route flapping): the worker had acked, nothing resent it, and the stream waited
    for its deadline. A gap held past GAP_RESYNC_S bumps the count the gateway's heartbeat
    carries, which workers answer by resending what the gateway lacks."""
    subjects = Subjects(nats_config.subject_prefix)
    ids = alphabet_tokens(9)
    counts: list[int | None] = []

    async def lose_one_resend_on_resync(job: Job) -> None:
        beats = await job.worker.nc.subscribe(subjects.gateway_heartbeat_wildcard)
        await _send_all_but_the_middle(job, ids)
        while not counts or not counts[-1]:  # the gateway asks for a resync
            counts.append(heartbeat_reconnects((await beats.next_msg(timeout=5)).data))
        await job.send(3, ids[3:6])  # what a worker's resync resends

    reply, waited, _ = await _nine_tokens(nats_config, lose_one_resend_on_resync)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "abcdefghi"
    assert counts[-1] == 1 and waited < 5  # not the 120 s deadline


async def test_a_final_chunk_lost_with_nothing_after_it_is_asked_for_by_name(
    nats_config: NatsConfig,
):
    """The last chunk lost without a reconnect leaves no gap to see: nothing comes after
    it, and the stream waited for its deadline (two minutes) though its worker had
    finished. The gateway lists its streams silent for a while after its heartbeat, and a
    worker that finished one re-sends what the gateway lacks."""
    subjects = Subjects(nats_config.subject_prefix)
    ids = alphabet_tokens(9)
    listed: list[list[str]] = []

    async def lose_the_last_resend_when_listed(job: Job) -> None:
        beats = await job.worker.nc.subscribe(subjects.gateway_heartbeat_wildcard)
        await job.send(0, ids[0:6])  # the final chunk, ids[6:9], lost on the way
        while not listed or job.request.id not in listed[-1]:
            idle = idle_request_ids((await beats.next_msg(timeout=5)).data)
            if idle is not None:
                listed.append(idle)
        usage = Usage(len(job.request.prompt_token_ids), 9, 0)
        await job.send(6, ids[6:9], finish_reason="length", usage=usage)

    reply, waited, left_open = await _nine_tokens(nats_config, lose_the_last_resend_when_listed)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "abcdefghi"
    assert waited < 6 and left_open == 0  # about IDLE_ASK_S, not the 120 s deadline


@pytest.mark.parametrize("ack_late", [False, True])
async def test_a_second_run_of_one_delivery_is_stopped_and_the_first_answers(
    nats_config: NatsConfig, monkeypatch: pytest.MonkeyPatch, ack_late: bool
):
    """A group consumer deleted and made again delivers an unacked request afresh, as the
    same attempt, to another worker while the first still streams: with sampling the runs
    disagree and the answer failed; the second run also held a batch slot to its end. The
    gateway follows the first run, drops the other's chunks and tells that worker to stop,
    naming the message it follows even when the runs began before its publish was acked
    (the stop went out naming none, and a duplicate message was not terminated)."""
    if ack_late:
        publish = generate.publish_request

        async def acked_late(*args: Any, **kwargs: Any) -> Any:
            ack = await publish(*args, **kwargs)
            await asyncio.sleep(0.3)
            return ack

        monkeypatch.setattr(generate, "publish_request", acked_late)
    subjects = Subjects(nats_config.subject_prefix)
    ids = alphabet_tokens(9)
    stops: list[Control] = []

    async def a_second_run_joins(job: Job) -> None:
        controls = await job.worker.nc.subscribe(subjects.abort("short"))
        await job.send(0, ids[0:3])
        intruder = Chunk(id=job.request.id, seq=0, token_ids=[90, 91, 92, 93], worker="w-2nd")
        await job.worker.nc.publish(job.request.reply, intruder.to_bytes())
        while not stops:
            control = Control.from_bytes((await controls.next_msg(timeout=5)).data)
            if control.action == "supersede":
                stops.append(control)
        usage = Usage(len(job.request.prompt_token_ids), 9, 0)
        await job.send(3, ids[3:9], finish_reason="length", usage=usage)

    reply, _, _ = await _nine_tokens(nats_config, a_second_run_joins)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "abcdefghi"
    (stop,) = stops
    assert (stop.worker, stop.attempt, stop.request_id) == ("w-2nd", 1, reply.json()["id"])
    assert stop.stream_seq is not None  # the message followed: another one is terminated


async def test_a_gap_no_resync_fills_ends_the_request_with_a_retryable_503(
    nats_config: NatsConfig, monkeypatch: pytest.MonkeyPatch
):
    """The worker acked and forgot the request (or stopped) before the resync asked: the
    finish chunk held behind the gap waited out the request's deadline (two minutes by
    default) for chunks nobody would send again."""
    monkeypatch.setattr(streams, "GAP_GIVE_UP_S", 1.5)
    ids = alphabet_tokens(9)

    async def lose_one_and_forget(job: Job) -> None:
        await _send_all_but_the_middle(job, ids)  # and never resend it

    reply, waited, left_open = await _nine_tokens(nats_config, lose_one_and_forget)
    assert left_open == 0
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert "lost on the way" in reply.json()["error"]["message"]
    assert waited < 20  # the give-up, not the request's deadline


async def test_a_slow_consumer_on_the_out_subjects_is_taken_as_chunks_lost(
    nats_config: NatsConfig,
) -> None:
    """nats-py drops what overflows a subscription's queue and only tells the error
    callback: the connection's hooks hear of it, and the dispatcher asks for a resync only
    for its chunks' subjects."""
    nc = await qnats.connect(nats_config, "slow-consumer-test")
    try:
        dropped: list[nats.errors.SlowConsumerError] = []
        qnats.on_slow_consumer(nc, dropped.append)
        release = asyncio.Event()

        async def stuck(msg: Any) -> None:
            await release.wait()

        await nc.subscribe("slow.test", cb=stuck, pending_msgs_limit=1)
        for _ in range(5):
            await nc.publish("slow.test", b"x")
        deadline = time.monotonic() + 5
        while not dropped and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        release.set()
        assert dropped and dropped[0].subject == "slow.test"
    finally:
        await nc.close()
    subjects = Subjects(nats_config.subject_prefix)
    dispatcher = Dispatcher(None, subjects, 1 << 20)  # type: ignore[arg-type]
    lost: list[bool] = []
    dispatcher.on_lost_chunks = lambda: lost.append(True)
    other = nats.errors.SlowConsumerError("other.subject", "", 1, None)  # type: ignore[arg-type]
    ours = nats.errors.SlowConsumerError(subjects.out("r1"), "", 1, None)  # type: ignore[arg-type]
    dispatcher._on_slow_consumer(other)
    assert lost == []
    dispatcher._on_slow_consumer(ours)
    assert lost == [True]


async def test_a_gap_that_fills_stops_its_give_up_clock(nats_config: NatsConfig):
    """The give-up timed every gap from the first one a stream ever held: gaps that each
    filled within a resync (repeated slow-consumer drops) ended a healthy stream after
    5 s. A filled gap stops the clock; the next one starts its own."""
    subjects = Subjects(nats_config.subject_prefix)
    dispatcher = Dispatcher(None, subjects, 1 << 20)  # type: ignore[arg-type]
    dispatcher.open("cmpl-x", "short", lambda _done, new: bytes(new).decode())

    async def arrives(chunk: Chunk) -> None:
        await dispatcher._on_out(SimpleNamespace(subject=subjects.out("cmpl-x"),
                                                 data=chunk.to_bytes()))  # type: ignore[arg-type]  # fmt: skip

    await arrives(_chunk(0, "abc"))
    await arrives(_chunk(6, "ghi"))  # 3..5 missing
    watch = dispatcher._gaps["cmpl-x"]
    assert watch.open_since is not None
    await arrives(_chunk(3, "def"))  # filled
    assert watch.open_since is None
    await arrives(_chunk(12, "mno"))  # 9..11 missing: a gap of its own
    since = watch.open_since
    assert since is not None and since >= asyncio.get_running_loop().time() - 0.5
    dispatcher.close(dispatcher._streams["cmpl-x"])
    assert watch.open_since is None and "cmpl-x" not in dispatcher._gaps


async def test_a_stopping_dispatcher_aborts_the_streams_still_open(nats_config: NatsConfig):
    """It ended them and forgot them: their handlers then found them closed, so no abort
    went out, and their workers ran them on for nobody, their KV blocks held."""
    nc = await qnats.connect(nats_config, "dispatcher-stop-test")
    try:
        subjects = Subjects(nats_config.subject_prefix)
        aborts = await nc.subscribe(subjects.abort("short"))
        dispatcher = Dispatcher(nc, subjects, 1 << 20)
        await dispatcher.start()
        running = dispatcher.open("r-running", "short", lambda delivered, new: "")
        done = dispatcher.open("r-done", "short", lambda delivered, new: "")
        done.worker_done = True  # its worker ended it: nothing to abort
        await dispatcher.stop()
        control = Control.from_bytes((await aborts.next_msg(timeout=2)).data)
        assert (control.action, control.request_id) == ("abort", "r-running")
        with pytest.raises(nats.errors.TimeoutError):
            await aborts.next_msg(timeout=0.3)
        assert running.finished and dispatcher.open_streams == 0
    finally:
        await nc.close()


async def test_worker_error_before_output_is_an_http_status(nats_config: NatsConfig):
    async def too_long(job: Job) -> None:
        await job.send(0, [], error=ErrorInfo(code="context_length_exceeded", message="too long"))

    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=too_long),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_worker_error_mid_stream_is_an_error_event_then_done(nats_config: NatsConfig):
    async def fails_late(job: Job) -> None:
        await job.send(0, alphabet_tokens(2))
        await job.send(2, [], error=ErrorInfo(code="internal_error", message="GPU fell off"))

    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=fails_late),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        response = await http.post("/v1/chat/completions", json=body)
    payloads = _sse_payloads(response.text)
    assert response.status_code == 200 and payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "internal_error" and error["message"] == "GPU fell off"
    deltas = [json.loads(p)["choices"][0]["delta"] for p in payloads[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "ab"


async def _one_event_then_hang_up(url: str, body: dict) -> None:
    """Stream a completion, read its first event, and hang up."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return


async def _collect_controls(nats_config: NatsConfig, gw_nc, group: str):  # type: ignore[no-untyped-def]
    got: list[bytes] = []

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        got.append(msg.data)

    await gw_nc.subscribe(Subjects(nats_config.subject_prefix).abort(group), cb=on_msg)
    return got


async def _post_and_collect_aborts(
    nats_config: NatsConfig,
    behaviour: Callable[[Job], Awaitable[None]],
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
    wait_s: float = 0.1,
) -> tuple[httpx.Response, list[Control], str]:
    """One completion against a worker that behaves so: the response, the controls its
    group got (after ``wait_s``), and the request's id."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=behaviour) as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        controls = await _collect_controls(nats_config, worker.nc, "short")
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": stream}
        response = await http.post("/v1/completions", json=body, headers=headers)
        await asyncio.sleep(wait_s)
    return response, [Control.from_bytes(c) for c in controls], worker.jobs[0].request.id


@pytest.mark.parametrize("stream", [True, False])
async def test_deadline_passing_is_504_or_an_error_event_and_aborts_the_worker(
    nats_config: NatsConfig, stream: bool
):
    async def one_token_then_silence(job: Job) -> None:
        await job.send(0, alphabet_tokens(1))
        await asyncio.sleep(3600)

    response, aborts, request_id = await _post_and_collect_aborts(
        nats_config, one_token_then_silence, stream=stream, headers={"X-QoS-Deadline-Ms": "400"}
    )
    if stream:
        payloads = _sse_payloads(response.text)
        assert json.loads(payloads[0])["choices"][0]["text"] == "a"
        assert json.loads(payloads[-2])["error"]["code"] == "deadline_exceeded"
    else:
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "deadline_exceeded"
        # The openai client would run it twice more into the same deadline.
        assert response.headers["x-should-retry"] == "false"
        # And the failure carries the request's id (the openai client's error.request_id).
        assert response.headers["x-request-id"] == request_id
    (abort,) = aborts
    assert abort.action == "abort" and abort.request_id == request_id


@pytest.mark.parametrize("ending", ["undecodable chunk", "worker error"])
async def test_a_stream_the_gateway_ends_itself_aborts_the_worker_and_a_worker_error_does_not(
    nats_config: NatsConfig, ending: str
):
    """An undecodable chunk ends the client's stream at the gateway while the worker would
    go on generating (holding KV blocks) unless told to stop; a worker that sent its own
    error has stopped already."""

    async def one_token_then_ending(job: Job) -> None:
        await job.send(0, alphabet_tokens(1))
        if ending == "undecodable chunk":
            await job.worker.nc.publish(job.request.reply, b"\xc1 not msgpack")
        else:
            await job.send(1, [], error=ErrorInfo(code="internal_error", message="boom"))
        await asyncio.sleep(3600)

    response, aborts, request_id = await _post_and_collect_aborts(
        nats_config, one_token_then_ending, stream=True, wait_s=0.2
    )
    payloads = _sse_payloads(response.text)
    assert json.loads(payloads[-2])["error"]["code"] == "internal_error"
    if ending == "undecodable chunk":
        (abort,) = aborts
        assert abort.action == "abort" and abort.request_id == request_id
    else:
        assert aborts == []


async def test_an_aborted_request_leaves_the_request_queue(nats_config: NatsConfig):
    """The client hangs up: besides the abort (for replicas subscribed now), the request is
    deleted from the stream, so no replica that subscribes later fetches it, and a worker
    that dies holding it does not get it redelivered to another."""

    async def one_token_then_hold(job: Job) -> None:  # holds the message unacked
        await job.send(0, alphabet_tokens(1))
        await asyncio.sleep(3600)

    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=one_token_then_hold) as worker,
    ):
        js = worker.nc.jetstream()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}
        await _one_event_then_hang_up(gw.url, body)
        assert worker.jobs  # the worker holds it, unacked
        for _ in range(100):
            if (await js.stream_info(nats_config.stream)).state.messages == 0:
                break
            await asyncio.sleep(0.02)
        assert (await js.stream_info(nats_config.stream)).state.messages == 0


async def test_client_disconnect_mid_stream_aborts_the_worker_and_ends_resume(
    nats_config: NatsConfig,
):
    async def slow(job: Job) -> None:
        for i in range(26):
            await job.send(i, alphabet_tokens(26)[i : i + 1])
            await asyncio.sleep(0.05)

    subjects = Subjects(nats_config.subject_prefix)
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=slow) as worker,
    ):
        controls = await _collect_controls(nats_config, worker.nc, "short")
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 26, "stream": True}
        await _one_event_then_hang_up(gw.url, body)
        for _ in range(100):
            if controls:
                break
            await asyncio.sleep(0.02)
        request_id = worker.jobs[0].request.id
        (abort,) = [Control.from_bytes(c) for c in controls]
        assert (abort.action, abort.request_id, abort.group) == ("abort", request_id, "short")
        # The gateway has finished with it: a redelivered attempt is told so, and drops it.
        query = ResumeQuery(id=request_id, attempt=2)
        answer = await worker.nc.request(subjects.resume(request_id), query.to_bytes(), timeout=2)
        assert ResumeReply.from_bytes(answer.data).closed
        assert gw.app.state.gateway.admission.in_flight("short") == 0


async def test_a_finished_requests_resume_query_is_answered_closed(nats_config: NatsConfig):
    """A copy redelivered after its answer (the ack was lost) must learn the caller is done:
    silence from a live gateway reads as "busy, hand it back" until JetStream gives up."""
    subjects = Subjects(nats_config.subject_prefix)
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                            "max_tokens": 3})  # fmt: skip
        assert response.status_code == 200
        (job,) = worker.jobs
        query = ResumeQuery(id=job.request.id, attempt=2, worker="w2")
        answer = await worker.nc.request(
            subjects.resume(job.request.id), query.to_bytes(), timeout=2
        )
        # A query naming another request on this one's subject is not answered either.
        forged = ResumeQuery(id="someone-else", attempt=99, worker="w2")
        with pytest.raises(nats.errors.TimeoutError):
            await worker.nc.request(subjects.resume(job.request.id), forged.to_bytes(), timeout=0.5)
        other = ResumeQuery(id="never-seen", attempt=2, worker="w2")
        with pytest.raises(nats.errors.TimeoutError):  # not ours: another gateway's, silence
            await worker.nc.request(subjects.resume("never-seen"), other.to_bytes(), timeout=0.5)
    reply = ResumeReply.from_bytes(answer.data)
    assert reply.closed and reply.token_ids == []


async def test_a_publish_whose_ack_times_out_is_asked_again_under_the_same_id(
    nats_config: NatsConfig,
):
    """JetStream stored the request but its ack came late: answered 503, the request ran for
    nobody on a replica that never heard the abort, and the client's retry ran it again."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        js = gw.app.state.gateway.generator._js
        real = js.publish
        calls: list[str] = []

        async def late_ack(subject: str, payload: bytes, **kwargs: object) -> object:
            calls.append(kwargs["headers"]["Nats-Msg-Id"])  # type: ignore[index]
            ack = await real(subject, payload, **kwargs)  # stored ...
            if len(calls) == 1:
                raise nats.errors.TimeoutError  # ... but the ack is "lost"
            return ack

        js.publish = late_ack
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                            "max_tokens": 3})  # fmt: skip
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "abc"
    assert len(calls) == 2 and calls[0] == calls[1]  # the same Nats-Msg-Id: deduplicated
    assert len(worker.jobs) == 1  # served once


async def test_a_stream_whose_client_stopped_reading_lets_go_at_its_deadline():
    """A client that keeps its connection open and reads nothing blocks send() once the
    socket's buffers fill: the events' own deadline check never ran again and the stream
    held its admission slot (and the worker its request) as long as the client liked."""

    async def events() -> AsyncIterator[bytes]:
        for i in range(100):
            yield f"data: {i}\n\n".encode()

    sent: list[Any] = []
    blocked = asyncio.Event()

    async def send(message: Any) -> None:
        sent.append(message)
        if len(sent) >= 3:  # the socket's buffers are full: never drains
            blocked.set()
            await asyncio.Event().wait()

    async def receive() -> Any:
        await asyncio.Event().wait()  # the connection stays open

    closed: list[int] = []
    response = SseResponse(
        events(), headers={}, on_disconnect=lambda: None, on_close=closed.append,
        deadline=time.monotonic() + 0.3,
    )  # fmt: skip
    await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
    assert blocked.is_set() and closed == [504]


def test_an_overlapping_chunks_new_tokens_keep_a_character_split_across_the_overlap():
    """A redelivered attempt's chunk that overlaps what the client has: its new tokens were
    decoded after 8 tokens of context starting anywhere, and a character whose first bytes
    the client's tokens ended with came out as U+FFFD."""
    import types

    from common.tokenizer import ByteTokenizer
    from gateway.generate import Generator

    tok = ByteTokenizer()
    text = " 你好😀".encode()
    for cut in range(1, len(text)):
        delivered, new = list(text[:cut]), list(text[cut:])
        sent = bytes(delivered).decode("utf-8", "ignore")  # complete characters only
        tail = Generator._decode_tail(types.SimpleNamespace(_tok=tok), delivered, new)  # type: ignore[arg-type]
        assert sent + tail == " 你好😀", cut


def test_an_overlapping_chunk_keeps_special_tokens_when_the_request_asked_to():
    """skip_special_tokens false: the worker's text has them, so the gateway's rebuilt tail
    of a redelivered attempt's chunk must too."""
    import types

    from common.tokenizer import ByteTokenizer
    from gateway.generate import Generator

    tok = ByteTokenizer()
    this = types.SimpleNamespace(_tok=tok)
    delivered, new = list(b"ab"), [*b"c", tok.EOS]
    assert Generator._decode_tail(this, delivered, new) == "c"  # type: ignore[arg-type]
    kept = Generator._decode_tail(this, delivered, new, skip_special_tokens=False)  # type: ignore[arg-type]
    assert kept == "c<|eos|>"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_stop_string_or_id_that_ended_the_output_reaches_the_client(
    nats_config: NatsConfig, stream: bool
):
    """vLLM's ``stop_reason``: which stop string (or stop token id) ended the output, so a
    client with several can tell; None when EOS did. It was dropped on the way."""

    async def stops_at_end(job: Job) -> None:
        await job.send(0, alphabet_tokens(3), finish_reason="stop", usage=job.usage(4),
                       stop_reason="END")  # fmt: skip

    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=stops_at_end),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 9, "stop": ["END", "\n\n"]}
        response = await http.post("/v1/completions", json={**body, "stream": stream})
    if stream:
        events = [json.loads(p) for p in _sse_payloads(response.text)[:-1]]
        final = events[-1]["choices"][0]
        assert all("stop_reason" not in e["choices"][0] for e in events[:-1])
    else:
        final = response.json()["choices"][0]
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", "END")
