"""The request stream or a group consumer deleted under a running deployment (an operator's
``nats consumer rm`` / ``nats stream rm``): the gateway puts them back and requests are
served again, with no service restarted."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import nats
import nats.js.errors
import pytest

from common.services import NatsServer
from common.subjects import Subjects
from tests.reliability.conftest import StackFactory
from tests.reliability.harness import body, completion, group

DEADLINE = {"X-QoS-Deadline-Ms": "5000"}  # without the keeper: an error after 5 s


async def _recreated(js: Any, stream: str) -> Any:
    """The stream's info once the keeper has put it back (5 s at most)."""
    for _ in range(100):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            return await js.stream_info(stream)
        await asyncio.sleep(0.05)
    raise AssertionError(f"stream {stream} was not recreated")


async def _deleted(js: Any, stream: str, seq: int | None) -> None:
    """Return once message ``seq`` is gone from ``stream`` (5 s at most)."""
    for _ in range(100):
        try:
            await js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"message {seq} of {stream} was not deleted")


async def test_a_deleted_consumer_or_stream_is_recreated_and_serving_resumes(
    nats_server: NatsServer, make_stack: StackFactory
) -> None:
    stack = make_stack(nats_server.url, {"short": group(4)}, {"short": 1}, jetstream_check_s=0.2)
    cfg = stack.config.nats
    url = f"{stack.base_url}/completions"
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            first = await completion(http, url, body(stack.model, 1, max_tokens=8), DEADLINE)
            assert first.kind == "complete", first.detail

            await js.delete_consumer(cfg.stream, Subjects.consumer("short"))
            # Queued in the stream until the keeper (every 0.2 s) puts the consumer back.
            again = await completion(http, url, body(stack.model, 2, max_tokens=8), DEADLINE)
            assert again.kind == "complete", again.detail

            await js.delete_stream(cfg.stream)  # its consumers go with it
            info = await _recreated(js, cfg.stream)
            # Numbered on from the old one (past what the keeper saw of it), not from 1:
            # requests held by their sequence (to delete one aborted, to match an
            # advisory) must not name a new request.
            assert info.state.first_seq > 1
            last = await completion(http, url, body(stack.model, 3, max_tokens=8), DEADLINE)
            assert last.kind == "complete", last.detail
        await js.stream_info(cfg.stream)
        await js.consumer_info(cfg.stream, Subjects.consumer("short"))
    finally:
        await nc.close()


async def test_a_stream_made_again_by_another_service_keeps_its_new_requests_from_old_aborts(
    nats_server: NatsServer,
) -> None:
    """Deleted, the stream was made again from 1 by another service (a starting gateway, a
    worker) before this gateway's keeper looked: an abort of a request held from the old
    stream deleted the new request its sequence now named, lost without a word."""
    import uuid

    from common.config import NatsConfig
    from common.nats import ensure_jetstream, ensure_stream
    from gateway.stream_keeper import StreamKeeper
    from gateway.streams import Dispatcher

    tag = uuid.uuid4().hex[:8]
    cfg = NatsConfig(url=nats_server.url, subject_prefix=f"k{tag}", stream=f"K_{tag}",
                     kv_bucket=f"k_{tag}")  # fmt: skip
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    subjects = Subjects(cfg.subject_prefix)
    await ensure_jetstream(js, cfg, ["short"])
    dispatcher = Dispatcher(nc, subjects, cfg.max_payload_bytes, cfg.stream)
    await dispatcher.start()
    keeper = StreamKeeper(nc, js, cfg, ["short"], 60.0, held_seq=dispatcher.highest_seq,
                          on_replaced=dispatcher.forget_sequences)  # fmt: skip
    try:
        await keeper.check()  # it has seen the stream
        held = dispatcher.open("old-request", "short", lambda *args, **kwargs: "")
        held.stream_seq = (await js.publish(subjects.request("short"), b"old")).seq
        await js.delete_stream(cfg.stream)
        await ensure_stream(js, cfg, ["short"])  # another service's, numbering from 1
        fresh = await js.publish(subjects.request("short"), b"new")
        assert fresh.seq == held.stream_seq  # the held number names a new request now
        await keeper.check()  # the keeper's next look
        dispatcher.close(held, abort=True, reason="client gone")  # its client leaves
        # A request of today's stream aborted after it: once its message is deleted, the
        # held one's abort (queued first, handled in order) has had its turn.
        marker = dispatcher.open("marker", "short", lambda *args, **kwargs: "")
        marker.stream_seq = (await js.publish(subjects.request("short"), b"marker")).seq
        dispatcher.close(marker, abort=True, reason="client gone")
        await _deleted(js, cfg.stream, marker.stream_seq)
        assert (await js.get_msg(cfg.stream, fresh.seq)).data == b"new"
    finally:
        await dispatcher.stop()
        with contextlib.suppress(Exception):
            await js.delete_stream(cfg.stream)
            await js.delete_stream(f"KV_{cfg.kv_bucket}")
        await nc.close()


async def test_a_gateway_that_may_not_recreate_the_stream_forgets_its_sequences_at_once(
    nats_server: NatsServer, monkeypatch: Any
) -> None:
    """Under the secure permissions the gateway may not make the stream again, and the
    sequences its open requests held were forgotten only once it saw the new stream: if
    `qosserve provision` made it (numbering from 1) in between, an abort deleted a new
    request under an old number."""
    import uuid

    from common.config import NatsConfig
    from common.errors import ConfigError
    from common.nats import ensure_jetstream
    from gateway import stream_keeper
    from gateway.streams import Dispatcher

    tag = uuid.uuid4().hex[:8]
    cfg = NatsConfig(url=nats_server.url, subject_prefix=f"f{tag}", stream=f"F_{tag}",
                     kv_bucket=f"f_{tag}")  # fmt: skip
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    subjects = Subjects(cfg.subject_prefix)
    await ensure_jetstream(js, cfg, ["short"])
    dispatcher = Dispatcher(nc, subjects, cfg.max_payload_bytes, cfg.stream)
    keeper = stream_keeper.StreamKeeper(nc, js, cfg, ["short"], 60.0,
                                        held_seq=dispatcher.highest_seq,
                                        on_replaced=dispatcher.forget_sequences)  # fmt: skip

    async def not_allowed(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("stream does not exist and this NATS user could not create it")

    try:
        await keeper.check()
        held = dispatcher.open("held", "short", lambda *args, **kwargs: "")
        held.stream_seq = (await js.publish(subjects.request("short"), b"old")).seq
        await js.delete_stream(cfg.stream)
        monkeypatch.setattr(stream_keeper, "ensure_stream", not_allowed)
        with pytest.raises(ConfigError):  # said in the log at each look, until provision runs
            await keeper.check()
        assert held.stream_seq is None and dispatcher.highest_seq() == 0
    finally:
        with contextlib.suppress(Exception):
            await js.delete_stream(f"KV_{cfg.kv_bucket}")
        await nc.close()
