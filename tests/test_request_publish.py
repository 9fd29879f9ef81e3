"""publish_request's retries: what a caller is told when JetStream fails mid-retry."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest

from common.request_publish import CancelledAfterAck, header_bytes, publish_request
from common.services import NatsServer


class FailingPublishes:
    """A JetStream context whose publishes raise the given errors in turn (the retry logic
    under test; the real server's side is tested in tests/reliability)."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise self.errors.pop(0)


async def test_no_responders_after_a_timed_out_attempt_is_a_timeout() -> None:
    """The first attempt may have been stored (its ack was late); JetStream then went away
    for the retry. Told "no stream", the caller treated the request as never queued: no
    abort, a misleading 503, and the stored request was served to nobody."""
    js = FailingPublishes(nats.errors.TimeoutError(), nats.errors.NoRespondersError())
    with pytest.raises(nats.errors.TimeoutError):
        await publish_request(js, "s", b"x", {"Nats-Msg-Id": "r"}, time.monotonic() + 10)  # type: ignore[arg-type]
    assert js.calls == 2
    # At the first attempt, no stream means the request was never queued: said so.
    js = FailingPublishes(nats.js.errors.NoStreamResponseError())
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await publish_request(js, "s", b"x", {"Nats-Msg-Id": "r"}, time.monotonic() + 10)  # type: ignore[arg-type]


async def test_a_request_whose_headers_take_it_past_max_payload_is_refused_alone(
    tmp_path: Path,
) -> None:
    """nats-py checks the body only; the server counts the headers too, answers a message
    over its max_payload with an error and closes the connection, which nats-py does not
    reopen: one request just under the limit took the gateway's connection down."""
    with NatsServer(store_dir=tmp_path / "nats", max_payload=4096) as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await js.add_stream(name="REQS", subjects=["reqs"])
            headers = {"Nats-Msg-Id": "r" * 40, "Qos-Deadline-Ms": "1" * 13}
            fits = 4096 - header_bytes(headers, "REQS")
            deadline = time.monotonic() + 10
            with pytest.raises(nats.errors.MaxPayloadError):
                await publish_request(js, "reqs", b"x" * (fits + 1), headers, deadline, "REQS")
            ack, _ = await publish_request(js, "reqs", b"x" * fits, headers, deadline, "REQS")
            assert ack.seq == 1 and nc.is_connected
        finally:
            await nc.close()


async def test_a_cancel_that_came_with_the_ack_is_not_lost() -> None:
    """nats-py waits for JetStream's ack with asyncio.wait_for, which on Python 3.11 returns
    a result that arrives with a cancel and drops the cancel: a caller's cancel or timeout
    during the publish was lost and the call ran on."""
    import asyncio
    import contextlib

    inside = asyncio.Event()

    class SwallowingPublish:
        async def publish(self, *args: Any, **kwargs: Any) -> Any:
            inside.set()
            with contextlib.suppress(asyncio.CancelledError):  # the ack came with it
                await asyncio.sleep(10)
            return SimpleNamespace(seq=1, duplicate=False)

    js: Any = SwallowingPublish()
    call = asyncio.ensure_future(
        publish_request(js, "s", b"x", {"Nats-Msg-Id": "r"}, time.monotonic() + 10)
    )
    await inside.wait()
    call.cancel()
    with pytest.raises(CancelledAfterAck) as raised:  # a CancelledError, with the ack
        await call
    assert raised.value.ack.seq == 1 and raised.value.attempt == 0
