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
