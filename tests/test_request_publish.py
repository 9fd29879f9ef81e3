"""publish_request's retries: what a caller is told when JetStream fails mid-retry."""

from __future__ import annotations

import time
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from common.request_publish import publish_request


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
