"""Errors map once to OpenAI's error shape and survive the trip through a NATS chunk."""

from __future__ import annotations

import pytest

from common.errors import (
    ContextLengthExceededError,
    InternalError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
    error_from_code,
)


def test_openai_error_shape_has_exactly_the_four_fields() -> None:
    err = InvalidRequestError("temperature must be >= 0", param="temperature")
    assert err.http_status == 400
    assert err.to_openai() == {
        "error": {
            "message": "temperature must be >= 0",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_request",
        }
    }


@pytest.mark.parametrize(
    ("err", "status", "retry"),
    [
        (RateLimitError("full", retry_after_s=2.4), 429, "3"),  # rounded up: not back too early
        (ServiceUnavailableError("no worker", retry_after_s=0.2), 503, "1"),
        (InvalidRequestError("bad"), 400, None),
    ],
)
def test_status_and_retry_after(err, status: int, retry: str | None) -> None:
    assert err.http_status == status
    assert err.headers().get("Retry-After") == retry


def test_error_chunk_round_trip_keeps_the_type() -> None:
    original = ContextLengthExceededError("prompt of 9000 tokens exceeds 4096")
    wire = original.to_wire()
    rebuilt = error_from_code(wire["code"], wire["message"])
    assert type(rebuilt) is ContextLengthExceededError
    assert rebuilt.http_status == 400 and rebuilt.code == "context_length_exceeded"


def test_unknown_code_from_a_worker_is_a_500() -> None:
    assert type(error_from_code("gpu_on_fire", "x")) is InternalError
    assert error_from_code("gpu_on_fire", "x").http_status == 500


def test_a_retryable_refusal_from_a_worker_says_when_to_come_back() -> None:
    """A worker's 503 (handed back on its last delivery: "send it again") reached the
    client without Retry-After, unlike every 503 and 429 the gateway makes itself."""
    for error in (ServiceUnavailableError("send it again"), RateLimitError("busy")):
        wire = error.to_wire()
        assert error_from_code(wire["code"], wire["message"]).headers()["Retry-After"] == "1"
    assert "Retry-After" not in error_from_code("invalid_request", "bad").headers()


@pytest.mark.parametrize(
    "failure",
    [
        "OutboundBufferLimitError",
        "ConnectionDrainingError",
        "ConnectionReconnectingError",
        "StaleConnectionError",
        "ConnectionClosedError",
    ],
)
def test_a_publish_that_fails_for_the_nats_link_is_a_503(failure: str) -> None:
    """With the link down nats-py's 2 MiB send buffer fills in seconds at load, and its
    OutboundBufferLimitError (or a draining, stale link) answered 500 with a traceback."""
    import nats.errors

    from common.request_publish import publish_error

    error = publish_error(getattr(nats.errors, failure)(), 100, "the gateway")
    assert isinstance(error, ServiceUnavailableError) and error.headers()["Retry-After"] == "2"
