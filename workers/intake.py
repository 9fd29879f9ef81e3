"""Intake: pull a group's requests from its shared JetStream consumer, only when there is room.

Also what a fetched message may need before the engine sees it: the resume query of a
redelivered request, and the error chunk of an undecodable one.

Fetches are one message at a time: nats-py's batch fetch keeps a pull request open on
the server for the rest of its batch, which would hoard messages another replica could
start now, and strand them in this one's inbox when it drains. A single-message long-poll
is answered the moment a request arrives and expires with the call.

Halting waits for the current long-poll (at most ``fetch_timeout_s``) instead of
cancelling it, because a cancelled pull can still be answered: the message would sit in
the local queue until ``ack_wait`` expires. Whatever arrived anyway is ``nak()``-ed, so
another replica gets it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from common.errors import ProtocolError, RequestGivenUpError, ServiceUnavailableError
from common.protocol import Chunk, ErrorInfo, ResumeQuery, ResumeReply
from common.subjects import Subjects
from common.tasks import watch
from workers.outbox import raw_reply

log = logging.getLogger(__name__)

_RECONNECT_POLL_S = 0.1  # how often a disconnected intake looks again


class Intake:
    """The fetch loop of one pull subscription; ``ready()`` gates it, ``accept`` takes messages."""

    def __init__(
        self,
        psub: JetStreamContext.PullSubscription,
        *,
        ready: Callable[[], bool],
        accept: Callable[[Msg], None],
        fetch_timeout_s: float = 0.5,
        connected: Callable[[], bool] = lambda: True,
        on_failure: Callable[[str], None] | None = None,
        hand_back: Callable[[Msg], Awaitable[None]] | None = None,
        draining: Callable[[], bool] = lambda: True,
    ) -> None:
        self.psub = psub
        # How a fetched message this replica will not serve goes back (default: nak).
        self._hand_back = hand_back or (lambda msg: settle(msg.nak))
        self._ready = ready
        # Not ready because it serves no more (drained, stopping), not merely full: a late
        # message is then handed back while paused (merely full, it is taken).
        self._draining = draining
        self._connected = connected
        self._on_failure = on_failure
        self._accept = accept
        self._timeout = fetch_timeout_s
        self._wake = asyncio.Event()
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="worker-intake")
        if self._on_failure is not None:
            watch(self._task, self._on_failure)

    def wake(self) -> None:
        """Look at ``ready()`` again (a slot freed, the cap or the state changed)."""
        self._wake.set()

    async def halt(self) -> None:
        """Stop fetching and hand back (``nak``) anything fetched after that."""
        self._stop = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
            self._task = None
        await self._empty_local_queue()

    async def _empty_local_queue(self, take: bool = False) -> None:
        """Hand back what waits in the local queue (``take``: accept it): a long-poll
        answered right at its expiry lands there after fetch() returned. Read that queue
        itself: fetch() would send a new pull and take a fresh request only to hand it
        back."""
        local = getattr(self.psub, "_sub", None)  # nats-py keeps it on the subscription
        while local is not None and self.psub.pending_msgs > 0:
            try:
                msg = await local.next_msg(timeout=0.01)
            except Exception:
                break
            if msg.data or not (msg.headers or {}).get("Status"):  # not a 408/404 status
                if take:
                    self._accept(msg)
                else:
                    await self._hand_back(msg)

    async def close(self) -> None:
        """Halt, then leave the consumer (it stays on the server for the other replicas)."""
        await self.halt()
        with contextlib.suppress(Exception):
            await self.psub.unsubscribe()

    async def _loop(self) -> None:
        while not self._stop:
            if not self._ready():
                self._wake.clear()
                # A message that landed late must not wait out this pause unacknowledged
                # (redelivered elsewhere at ack_wait, then served here too): looked for at
                # once and a fetch timeout later. Draining, it goes back to another replica;
                # merely full, it is taken, one over the cap (the engine queues it).
                await self._empty_local_queue(take=not self._draining())
                if not self._stop and not self._ready():  # re-check: no lost wake-up
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._timeout):
                            await self._wake.wait()
                continue
            if not self._connected():
                # nats-py buffers a pull sent while reconnecting: each would go out at the
                # reconnect, live on the server for a while, and together grab a burst of the
                # backlog (more than this replica has room for, in_progress for none of it).
                await asyncio.sleep(_RECONNECT_POLL_S)
                continue
            try:
                msgs = await self.psub.fetch(1, timeout=self._timeout)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:
                if self._stop:
                    break
                log.warning("fetch failed: %s", exc)  # NATS reconnecting: try again shortly
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                # Drained (or capped) during the long-poll: another replica takes it now.
                if self._stop or not self._ready():
                    await self._hand_back(msg)
                else:
                    self._accept(msg)


class NoAnswer(enum.Enum):
    """Why a resume query got no reply: nobody listens (the caller is gone), or someone
    does and was too slow (a busy caller: ask again later, do not drop its request)."""

    GONE = "gone"
    SLOW = "slow"


async def ask_resume(
    nc: Client, subject: str, query: ResumeQuery, timeout_s: float, max_payload: int
) -> ResumeReply | NoAnswer:
    """The caller's answer to a resume query, or why there is none."""
    try:
        answer = await nc.request(subject, query.to_bytes(), timeout=timeout_s)
        return ResumeReply.from_bytes(answer.data, max_payload)
    except nats.errors.NoRespondersError:
        return NoAnswer.GONE
    except (nats.errors.TimeoutError, TimeoutError):
        return NoAnswer.SLOW
    except ProtocolError as exc:
        log.warning("request %s: bad resume reply (%s); dropping it", query.id, exc.message)
        return NoAnswer.GONE


async def reject_undecodable(
    nc: Client, msg: Msg, exc: ProtocolError, worker_id: str, subjects: Subjects, attempt: int
) -> None:
    """An error chunk to the request's reply when one can be read from it, then ``term()``:
    a payload that cannot be decoded never will be, so it must not be redelivered. The
    chunk carries the delivery's ``attempt``: stamped 1 on a redelivery, its caller (who
    follows the first attempt's worker, or a later one) took it for a second run's and
    dropped it, and waited to its deadline."""
    reply, rid = raw_reply(msg.data, subjects.out)
    log.warning("undecodable request (reply %r): %s", reply, exc.message)
    if reply is not None:
        chunk = Chunk(
            id=rid, attempt=attempt, finish_reason="error", worker=worker_id,
            error=ErrorInfo(exc.code, exc.message),
        )  # fmt: skip
        with contextlib.suppress(Exception):
            await nc.publish(reply, chunk.to_bytes())
    await settle(msg.term)


async def retry_or_fail(
    nc: Client, msg: Msg, exc: BaseException, worker_id: str, max_deliver: int, subjects: Subjects
) -> str | None:
    """A message whose handling raised: hand it back (another replica, or this one after a
    pause, may not hit the same fault) until its last delivery; then answer its caller
    with ``request_given_up`` (a 500 its client must not retry) and ``term()`` it. A poison
    message costs ``max_deliver`` attempts and one error answer, never a loop. Returns the
    error code answered, if it was."""
    try:
        attempt = int(msg.metadata.num_delivered)
    except Exception:
        attempt = max_deliver
    if attempt < max_deliver:
        log.error(
            "request handling failed on delivery %d of %d; handing it back: %r",
            attempt, max_deliver, exc, exc_info=exc,
        )  # fmt: skip
        await settle(lambda: msg.nak(delay=min(0.2 * 2**attempt, 5.0)))
        return None
    reply, rid = raw_reply(msg.data, subjects.out)
    log.error(
        "request %s failed on its last delivery (%d of %d): terminated as poison: %r",
        rid or "?", attempt, max_deliver, exc, exc_info=exc,
    )  # fmt: skip
    if reply is not None:
        chunk = Chunk(
            id=rid, attempt=attempt, finish_reason="error", worker=worker_id,
            error=ErrorInfo(RequestGivenUpError.default_code, f"the worker failed this request on every one of its {attempt} deliveries"),
        )  # fmt: skip
        with contextlib.suppress(Exception):
            await nc.publish(reply, chunk.to_bytes())
    await settle(msg.term)
    return RequestGivenUpError.default_code


async def hand_back(
    nc: Client,
    msg: Msg,
    worker_id: str,
    max_deliver: int,
    subjects: Subjects,
    delay: float | None = None,
) -> str | None:
    """Return a message this replica will not serve (draining, stopping, superseded) to
    the queue with ``nak``, for another replica -- but on its last delivery a nak made
    JetStream give it up, and its caller heard "failed on every delivery" (not retryable)
    though nothing failed: it gets a retryable 503 instead, and the message is ended.
    Returns the error code answered, if it was."""
    try:
        attempt = int(msg.metadata.num_delivered)
    except Exception:
        attempt = 1
    if attempt < max_deliver:
        await settle(lambda: msg.nak(delay=delay))
        return None
    reply, rid = raw_reply(msg.data, subjects.out)
    log.warning("request %s handed back on its last delivery (%d): answered 503, ended",
                rid or "?", attempt)  # fmt: skip
    if reply is not None:
        error = ServiceUnavailableError("the request was handed back on its last delivery; "
                                        "send it again")  # fmt: skip
        chunk = Chunk(id=rid, attempt=attempt, finish_reason="error", worker=worker_id,
                      error=ErrorInfo(error.code, error.message))  # fmt: skip
        with contextlib.suppress(Exception):
            await nc.publish(reply, chunk.to_bytes())
    await settle(msg.term)
    return ServiceUnavailableError.default_code


async def settle(action: Callable[[], object]) -> None:
    """Run an ack/nak/term/in_progress; a message settled already or a closed link is fine."""
    try:
        await action()  # type: ignore[misc]
    except Exception as exc:
        log.debug("message settle failed: %s", exc)
