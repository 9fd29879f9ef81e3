"""The NATS-native client, and the wire contract any NATS client can implement.

Python: ``async with await QosClient.connect(config) as client`` (or ``QosClient(nc)``), then
``async for chunk in client.generate(prompt=..., group="short", params=RequestParams(...))``.
Each yielded :class:`~common.protocol.Chunk` holds only tokens not yielded before; the last
one has ``finish_reason`` and ``usage``; a worker error raises the matching
:class:`~common.errors.QosError`; the deadline raises ``DeadlineExceededError``.
:class:`~common.sequencer.ChunkSequencer` is the transport-free core (dedupe, reorder, resume).

Contract (wire version 1)
=========================

Names. ``P`` is the subject prefix (default ``qos``); ``<id>`` a request id and ``<group>``
an instance group (``realtime``, ``short``, ``long`` by default), both matching
``[A-Za-z0-9_-]{1,128}``. Requests go to the JetStream stream ``QOS_REQ`` (subjects
``P.req.*``, work-queue retention, 2-minute duplicate window on ``Nats-Msg-Id``).

Encoding. Every payload is one msgpack map (str keys, msgpack "bin" for bytes). Top-level
maps carry ``"v": 1``; nested maps do not. Decoding is strict: an unknown key, a wrong
type (an int where a float is expected is accepted; a float for an int is not), or an
unknown ``v`` is rejected. Optional keys may be omitted or nil. ``token_ids`` fields are
*bin*: token ids as little-endian int32, 4 bytes each; ``logprobs`` fields are bin of
little-endian float32.

1. Subscribe (core NATS) to ``P.out.<id>`` (chunks) and ``P.resume.<id>`` (resume
   queries) *before* publishing, so no chunk is missed.
2. Publish the request with JetStream to ``P.req.<group>`` with header
   ``Nats-Msg-Id: <id>`` (a retry within the window is deduplicated) and wait for the
   stream's ack. The request map:

   ====================  ========  =========================================================
   key                   type      meaning
   ====================  ========  =========================================================
   ``v``                 int       1
   ``id``                str       request id (unique; also the dedupe id)
   ``group``             str       the group of the subject (another: refused)
   ``reply``             str       where chunks go: exactly ``P.out.<id>`` (else refused)
   ``prompt``            str       text prompt (the worker tokenizes it) — or:
   ``prompt_token_ids``  bin i32   token ids; exactly one of the two
   ``model``             str       optional, informational
   ``params``            map       optional, see below
   ``priority``          int       optional, lower is served first (default 0)
   ``deadline_ms``       int       optional, absolute unix epoch milliseconds
   ``created_ms``        int       optional, epoch ms the caller made it (within 1 s of
                                   JetStream's storing time, else that time counts)
   ``origin``            str       optional, the gateway id whose heartbeat workers watch
   ``cache_salt``        str       optional (<= 512 chars): only requests with the same
                                   salt share cached prompt prefixes (default "": shared)
   ====================  ========  =========================================================

   ``params`` (every key optional): ``max_tokens`` int (256, >= 1), ``temperature`` float
   (1.0; 0 = greedy), ``top_p`` float (1.0), ``top_k`` int (0 = off), ``min_p`` float,
   ``repetition_penalty`` float (1.0), ``presence_penalty`` / ``frequency_penalty`` float
   (0.0), ``seed`` int, ``stop`` [str], ``stop_token_ids`` [int], ``ignore_eos`` bool,
   ``logprobs`` int (top-k alternatives to return, 0..20).
3. Read chunks on ``P.out.<id>``:

   =================  ========  ==========================================================
   key                type      meaning
   =================  ========  ==========================================================
   ``v``              int       1
   ``id``             str       request id
   ``seq``            int       index (in the output) of this chunk's first token
   ``attempt``        int       JetStream delivery count of the request that produced it
   ``token_ids``      bin i32   new tokens (may be empty, e.g. in a final chunk)
   ``text``           str       their text ("" when the model has no tokenizer)
   ``finish_reason``  str       only on the last chunk: stop | length | abort | error
   ``usage``          map       last chunk: prompt_tokens, completion_tokens, cached_tokens
   ``error``          map       {code, message} on a failed request (finish_reason error)
   ``logprobs``       bin f32   one per token, when asked
   ``top_logprobs``   [map]     one {token_ids: bin i32, logprobs: bin f32} per token
   ``worker``         str       the worker that sent it
   =================  ========  ==========================================================

   Keep ``delivered`` = tokens delivered so far and ``min_attempt`` = 1. Drop a chunk whose
   ``attempt < min_attempt`` (a worker that lost the request still talking). If
   ``seq > delivered``, hold it until the gap fills. Otherwise deliver
   ``token_ids[delivered - seq:]`` (nothing if already delivered) and advance. The chunk
   with ``finish_reason`` ends the stream; ``completion_tokens`` counts every output token,
   resumed ones too. ``error.code`` is one of ``invalid_request``,
   ``context_length_exceeded``, ``protocol_error``, ``deadline_exceeded``,
   ``rate_limit_exceeded``, ``service_unavailable``, ``internal_error`` (OpenAI-style).
4. Answer resume queries. When a worker dies, JetStream redelivers the request (after the
   consumer's ``ack_wait``) and the new worker sends a request/reply on
   ``P.resume.<id>`` with ``{v, id, attempt: int, worker: str}``. Reply to the message's
   reply subject with ``{v: 1, id, token_ids: bin i32 (every token delivered so far, in
   order), text_len: int (characters of text delivered)}`` and set ``min_attempt =
   max(min_attempt, attempt)``; drop any held chunk of an older attempt. The worker continues from prompt + those tokens, sending ``seq`` from
   ``len(token_ids)``. Once finished with a request, a caller may answer
   ``{v: 1, id, closed: true}`` (the copy is acked and dropped); not answering makes the
   worker drop the request (this client sends no ``origin``, so at once). After a NATS
   reconnect a worker asks the same
   question with its *current* attempt (nothing changes on your side) and re-sends every
   chunk past your answer, so chunks lost in the outage arrive again (drop them by ``seq``).
5. To cancel, publish (core NATS) on ``P.abort.<group>`` the map
   ``{v: 1, action: "abort", request_id: <id>, group: <group>, issued_ms: int, reason:
   str}`` and unsubscribe; the worker frees the request's KV cache at once.
6. Deadlines. The worker answers a request whose ``deadline_ms`` passed (before or while
   generating) with a ``deadline_exceeded`` error chunk. Chunks travel on core NATS (at
   most once), so the caller also enforces the deadline itself rather than wait for a gap
   that may never fill.

A final ``finish_reason`` of ``abort`` means the request was cancelled (by the caller or
an operator); ``error`` always comes with ``error``. Optional request headers:
``traceparent`` / ``tracestate`` (W3C trace context).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Self

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from common.config import Config, NatsConfig
from common.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    ProtocolError,
    QosError,
    ServiceUnavailableError,
)
from common.protocol import (
    DEFAULT_MAX_PAYLOAD,
    Chunk,
    Control,
    GenerateRequest,
    RequestParams,
    ResumeQuery,
)
from common.sequencer import ChunkSequencer, DecodeTail
from common.subjects import Subjects

DEFAULT_TIMEOUT_S = 120.0


class QosClient:
    """Publishes requests onto NATS and streams their answers (see the module docstring)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects | None = None,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
        owns_connection: bool = False,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects or Subjects()
        self._max_payload = max_payload_bytes
        self._owns = owns_connection

    @classmethod
    async def connect(
        cls, config: Config | NatsConfig, name: str = "qos-client", service: str | None = None
    ) -> Self:
        """Connect with :func:`common.nats.connect`; :meth:`close` closes the connection.

        Replies (JetStream's publish acks) come back on ``nats.inbox_prefix``, else on
        ``_INBOX_<service>``, else on ``_INBOX``: under ``deploy/nats/permissions.conf``,
        whose users may each read their own inbox only, run as a user allowed to publish
        requests with the inbox it may read (``service="gateway"`` as the gateway's user).
        """
        from common.nats import connect

        cfg = config.nats if isinstance(config, Config) else config
        nc = await connect(cfg, name, service=service)
        return cls(
            nc,
            Subjects(cfg.subject_prefix),
            max_payload_bytes=cfg.max_payload_bytes,
            owns_connection=True,
        )

    async def close(self) -> None:
        if self._owns:
            await self.nc.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def generate(
        self,
        *,
        group: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: RequestParams | None = None,
        deadline_ms: int | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        priority: int = 0,
        model: str = "",
        decode_tail: DecodeTail | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[Chunk]:
        """Yield the answer's chunks, each with only new tokens; the last one is final.

        ``deadline_ms`` is absolute (epoch ms) and travels with the request; ``timeout_s``
        is relative; the earlier wins (default: :data:`DEFAULT_TIMEOUT_S`). Leaving the
        loop early, a timeout or cancellation aborts the request on the worker.
        """
        now_ms = int(time.time() * 1000)
        if timeout_s is not None or deadline_ms is None:
            relative = now_ms + int(1000 * (DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s))
            deadline_ms = relative if deadline_ms is None else min(deadline_ms, relative)
        rid = request_id or uuid.uuid4().hex
        request = GenerateRequest(
            id=rid,
            group=group,
            reply=self.subjects.out(rid),
            model=model,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids or []),
            params=params or RequestParams(),
            priority=priority,
            deadline_ms=deadline_ms,
            created_ms=now_ms,
            cache_salt=cache_salt,
        )
        request.validate()
        stream = ChunkSequencer(rid, decode_tail)
        ready: asyncio.Queue[Chunk | QosError] = asyncio.Queue()
        worker_may_run = [False]  # an undecodable chunk ends our stream, not the worker's

        async def on_chunk(msg: Msg) -> None:
            try:
                chunks: list[Chunk | QosError] = list(
                    stream.feed(Chunk.from_bytes(msg.data, self._max_payload))
                )
            except ProtocolError as exc:
                chunks = [InternalError(f"undecodable chunk from the worker: {exc.message}")]
                stream.finished = True
                worker_may_run[0] = True
            except QosError as exc:
                chunks = [exc]
            for item in chunks:
                ready.put_nowait(item)

        async def on_resume(msg: Msg) -> None:
            if stream.finished or not msg.reply:
                return  # silence: the worker drops the request
            try:
                query = ResumeQuery.from_bytes(msg.data, self._max_payload)
            except ProtocolError:
                return
            await self.nc.publish(msg.reply, stream.resume(query).to_bytes())

        subs = [
            await self.nc.subscribe(self.subjects.out(rid), cb=on_chunk),
            await self.nc.subscribe(self.subjects.resume(rid), cb=on_resume),
        ]
        done = False
        queued: tuple[str, int] | None = None  # (stream, sequence) of the request message
        try:
            try:
                ack = await self.js.publish(
                    self.subjects.request(group), request.to_bytes(), headers={"Nats-Msg-Id": rid}
                )
            except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError) as exc:
                done = True  # nothing was queued: nothing to abort
                raise ServiceUnavailableError(
                    f"no JetStream stream takes {self.subjects.request(group)}: is a worker "
                    "or gateway running against this NATS?",
                    retry_after_s=1,
                ) from exc
            if ack.duplicate:
                # JetStream kept the earlier message with this id: nothing new is queued, and
                # its answer (running, or long finished) is not this caller's to wait for.
                done = True
                raise InvalidRequestError(
                    f"request id {rid!r} is in use (JetStream deduplicated this request "
                    "within its window); use a new id",
                    param="request_id",
                )
            queued = (ack.stream, ack.seq)

            async def on_given_up(msg: Msg) -> None:
                # JetStream stopped redelivering it (every delivery crashed or failed a
                # worker): no answer will come, so fail now rather than at the deadline.
                try:
                    advisory = json.loads(msg.data)
                    seq, deliveries = int(advisory["stream_seq"]), int(advisory["deliveries"])
                except (ValueError, KeyError, TypeError):
                    return
                if seq == ack.seq and not stream.finished:
                    stream.finished = True
                    ready.put_nowait(InternalError(
                        f"request {rid} failed on every one of its {deliveries} deliveries "
                        "to workers and was given up"
                    ))  # fmt: skip

            with contextlib.suppress(Exception):  # not permitted: the deadline still ends it
                subs.append(
                    await self.nc.subscribe(
                        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{ack.stream}."
                        f"{Subjects.consumer(group)}",
                        cb=on_given_up,
                    )
                )
            while not done:
                left = deadline_ms / 1000 - time.time()
                try:
                    # wait_for costs a task per call: only when nothing is waiting already.
                    item = (
                        ready.get_nowait()
                        if not ready.empty() and left > 0
                        else await asyncio.wait_for(ready.get(), max(left, 0.0))
                    )
                except TimeoutError:
                    raise DeadlineExceededError(
                        f"request {rid} passed its deadline", param="deadline_ms"
                    ) from None
                if isinstance(item, QosError):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            stream.finished = True
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            if not done or worker_may_run[0]:
                await self._abort(group, rid, "client stopped reading", queued)

    async def _abort(
        self, group: str, request_id: str, reason: str, queued: tuple[str, int] | None = None
    ) -> None:
        """Abort on the group's control subject; and take the request out of the stream if it
        is still queued (a replica that joins later never heard the abort)."""
        control = Control(
            action="abort",
            issued_ms=int(time.time() * 1000),
            group=group,
            request_id=request_id,
            reason=reason,
        )
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.abort(group), control.to_bytes())
        if queued is not None:
            with contextlib.suppress(Exception):  # gone already (a worker acked it): fine
                await self.js.delete_msg(*queued)

    async def collect(self, **kwargs: Any) -> tuple[list[int], str, Chunk]:
        """Run :meth:`generate` to the end: (token ids, text, final chunk)."""
        ids: list[int] = []
        text = ""
        final: Chunk | None = None
        async for chunk in self.generate(**kwargs):
            ids += chunk.token_ids
            text += chunk.text
            final = chunk
        assert final is not None
        return ids, text, final
