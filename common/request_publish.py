"""Putting one request on the JetStream request stream: the gateway's and the NATS-native
client's publish, with the same retry and the same errors.

A publish that times out may hide a message JetStream stored (its ack was late). Answered
with an error then, it would run for nobody on a replica that never heard an abort; asked
again under the same ``Nats-Msg-Id``, JetStream acks the stored copy (``duplicate``) with
its sequence, and the request is served or cleaned up as any other.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from common.errors import PayloadTooLargeError, QosError, ServiceUnavailableError

PUBLISH_TIMEOUT_S = 5.0


class CancelledAfterAck(asyncio.CancelledError):
    """The publish's cancel, raised with the ack JetStream gave it (and the attempt it
    came on): the request is in the stream, and the caller's abort must delete it."""

    def __init__(self, ack: PubAck, attempt: int) -> None:
        super().__init__()
        self.ack, self.attempt = ack, attempt


# Publishes of one request (same Nats-Msg-Id) before a timeout is a 503.
PUBLISH_ATTEMPTS = 3

log = logging.getLogger(__name__)


async def publish_request(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    headers: dict[str, str],
    deadline: float,
    stream: str | None = None,
) -> tuple[PubAck, int]:
    """JetStream's ack and the attempt it came on (0: the first; on a later one a
    ``duplicate`` ack is this request's own copy). ``deadline`` is on ``time.monotonic``.
    Raises nats-py's errors: :func:`publish_error` says what each means to a caller."""
    # nats-py measures the body alone against the server's max_payload; the server counts
    # the headers too, and past it closes the connection (every stream on it lost) where
    # a request just under the limit should have been refused alone.
    limit = getattr(getattr(js, "_nc", None), "max_payload", None)
    if limit and len(payload) + header_bytes(headers, stream) > limit:
        raise nats.errors.MaxPayloadError
    for attempt in range(PUBLISH_ATTEMPTS):
        timeout = max(0.1, min(PUBLISH_TIMEOUT_S, deadline - time.monotonic()))
        try:
            ack = await js.publish(
                subject, payload, timeout=timeout, stream=stream, headers=headers
            )
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # nats-py waits for the ack with asyncio.wait_for, which on 3.11 returns a
                # result that came with a cancel and drops the cancel: the caller's cancel
                # (or timeout) was lost and the call ran on. Said again here, with the ack:
                # its sequence is what the caller's abort deletes from the stream.
                raise CancelledAfterAck(ack, attempt)
            return ack, attempt
        except nats.errors.TimeoutError:
            if attempt + 1 == PUBLISH_ATTEMPTS or deadline - time.monotonic() < 0.2:
                raise
            log.info("publishing request %s timed out; asking again (same id)",
                     headers.get("Nats-Msg-Id"))  # fmt: skip
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
            if attempt == 0:
                raise
            # JetStream went away after an earlier attempt timed out, which it may have
            # stored: as a timeout, the caller treats the request as maybe queued (and
            # aborts it), not as one that never was.
            raise nats.errors.TimeoutError from None
    raise AssertionError("unreachable")


def header_bytes(headers: dict[str, str], stream: str | None) -> int:
    """The size of a message's header block as nats-py writes it, JetStream's
    ``Nats-Expected-Stream`` included (a slight overcount: values are sent stripped)."""
    lines = {**headers, "Nats-Expected-Stream": stream} if stream else headers
    return len(b"NATS/1.0\r\n\r\n") + sum(
        len(k.encode()) + len(v.encode()) + 4 for k, v in lines.items()
    )


def publish_error(exc: Exception, payload_bytes: int, who: str) -> QosError | None:
    """The caller's error for a failed :func:`publish_request` (None: not a publish
    failure); ``who`` names the NATS connection's owner ("the gateway", "this client")."""
    if isinstance(
        exc,
        nats.errors.NoRespondersError
        | nats.js.errors.NoStreamResponseError  # no stream (yet): JetStream restarting
        | nats.errors.TimeoutError,
    ):
        return ServiceUnavailableError(
            f"the request queue did not accept the request ({type(exc).__name__})",
            retry_after_s=1,
        )
    if isinstance(exc, nats.js.errors.APIError):
        log.warning("JetStream refused a request: %s", exc.description)
        return ServiceUnavailableError("the request queue refused the request", retry_after_s=1)
    if isinstance(
        exc,
        nats.errors.ConnectionClosedError
        # The link is down and nats-py's send buffer (2 MiB) is full, or the connection is
        # draining or stale: an outage, not a bug (it answered 500 with a traceback).
        | nats.errors.OutboundBufferLimitError
        | nats.errors.ConnectionDrainingError
        | nats.errors.ConnectionReconnectingError
        | nats.errors.StaleConnectionError,
    ):
        return ServiceUnavailableError(
            f"{who} lost its NATS connection ({type(exc).__name__})", retry_after_s=2
        )
    if isinstance(exc, nats.errors.MaxPayloadError):
        # The server's max_payload is below nats.max_payload_bytes (its default is 1 MiB):
        # the request itself is fine, the message plane cannot carry it.
        return PayloadTooLargeError(
            f"the request takes {payload_bytes} bytes on the message plane, over the NATS "
            "server's max_payload; shorten the prompt, or raise the server's max_payload",
            param="prompt",
        )
    return None
