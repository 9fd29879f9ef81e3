"""WorkerService: one worker replica, between its group's JetStream consumer and the engine.

Requests are pulled from ``grp-<group>``, the durable consumer all replicas of the group
share, one at a time and only while the engine has a free slot (batch cap − requests held
here), so a replica never hoards work another could start. Each request is checked
(decodable, deadline, redelivery → resume query), handed to the engine thread
(:mod:`workers.bridge`) and answered with chunks on its ``reply`` subject; its message is
``in_progress()``-ed every ``ack_wait/3`` while it runs and ``ack()``-ed after the final
chunk. Delivery and failure semantics are DESIGN §2's; the wire contract is in
:mod:`common.client`.

Chunks are coalesced: the first token goes out at once (TTFT), later ones at most every
``worker.coalesce_ms``, and the final chunk carries ``finish_reason`` and ``usage``.

Stopping (SIGTERM, :meth:`WorkerService.stop`) stops fetching, lets requests in flight
finish within a grace period, then ``nak()``s the rest so another replica resumes them
where the caller's stream stands, publishes a last ``stopped`` telemetry and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import msgpack
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

import common.nats as qnats
from common.config import Config
from common.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    InvalidRequestError,
    ProtocolError,
    QosError,
)
from common.protocol import (
    Chunk,
    Control,
    ErrorInfo,
    GenerateRequest,
    ResumeQuery,
    ResumeReply,
    TopLogprobs,
    Usage,
)
from common.subjects import Subjects
from workers import telemetry
from workers.bridge import AddRequest, BridgeEvent, EngineBridge, RequestFailed, StepEngine
from workers.engine.outputs import RequestDelta
from workers.engine.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

# Aborts remembered for requests not fetched yet, so a late fetch drops them.
ABORT_MEMORY_S = 600.0
ABORT_MEMORY_MAX = 10_000


@dataclass
class WorkerOptions:
    """Per-replica settings that are not in :class:`Config` (they come from flags)."""

    group: str
    worker_id: str
    model: str = ""
    grace_s: float = 30.0
    fetch_timeout_s: float = 0.5  # long-poll length; also bounds how fast fetching stops
    resume_timeout_s: float = 1.0


@dataclass(eq=False)
class _Flight:
    """One request this replica holds, from its fetch to its ack."""

    request: GenerateRequest
    msg: Msg
    attempt: int
    base: int  # tokens the caller already had when this attempt began (resume)
    start: float  # time.time() the latency clock starts (created_ms when known)
    sent: int = 0  # absolute index of the next token to publish = the next chunk's seq
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    flush_at: float | None = None
    first_sent: bool = False
    error: QosError | None = None  # why it was aborted here (deadline), if it was


class WorkerService:
    """Serves one group from ``engine``; :meth:`start`, then :meth:`run` or :meth:`stop`."""

    def __init__(self, config: Config, engine: StepEngine, options: WorkerOptions) -> None:
        if options.group not in config.groups:
            raise ValueError(
                f"unknown group {options.group!r} (configured: {sorted(config.groups)})"
            )
        self.config = config
        self.options = options
        self.group = options.group
        self.worker_id = options.worker_id
        self.subjects = Subjects(config.nats.subject_prefix)
        self.engine = engine
        self.state: telemetry.State = "starting"
        self.telemetry = telemetry.WorkerTelemetry(options.worker_id, options.model)
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.kv: KeyValue | None = None
        self.bridge: EngineBridge | None = None
        self._psub: JetStreamContext.PullSubscription | None = None
        self._ctl_subs: list[Subscription] = []
        self._group_ctl: Subscription | None = None
        self._inflight: dict[str, _Flight] = {}
        self._starting: dict[asyncio.Task[None], Msg] = {}
        self._aborted: dict[str, float] = {}
        self._accepting = False
        self._fetch_stop = False
        self._fetch_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()  # a slot freed, or the fetch state changed
        self._pump_wake = asyncio.Event()
        self._events: list[BridgeEvent] = []
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self._switch_lock = asyncio.Lock()
        self._coalesce_s = config.worker.coalesce_ms / 1000.0
        self._max_payload = config.nats.max_payload_bytes

    # --- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, make sure the stream/consumer/bucket exist, start serving."""
        cfg = self.config.nats
        loop = asyncio.get_running_loop()
        self.bridge = EngineBridge(
            self.engine, self._on_engine_events, loop, name=f"engine-{self.worker_id}"
        )
        cap = min(self.config.groups[self.group].max_batch, self.bridge.batch_cap)
        self.bridge.set_batch_cap(cap)
        self.bridge.start()
        self.nc = await qnats.connect(cfg, f"worker-{self.worker_id}")
        self.js = self.nc.jetstream()
        await qnats.ensure_stream(self.js, cfg, [self.group])
        self.kv = await qnats.ensure_kv(self.js, cfg)
        self._ctl_subs.append(
            await self.nc.subscribe(self.subjects.control(self.worker_id), cb=self._on_control)
        )
        await self._bind(self.group)
        self._tasks = [
            asyncio.create_task(self._pump(), name="worker-pump"),
            asyncio.create_task(self._ticker(), name="worker-ticker"),
            asyncio.create_task(self._telemetry_loop(), name="worker-telemetry"),
        ]
        self._set_serving(True)
        log.info("worker %s serving group %s (batch cap %d)", self.worker_id, self.group, cap)

    async def run(self) -> None:
        """Serve until :meth:`request_stop` (a signal), then stop gracefully."""
        await self._stop_requested.wait()
        await self.stop()

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop; safe from a signal handler."""
        self._stop_requested.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop fetching, let in-flight requests finish within ``grace_s``, nak the rest."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        grace = self.options.grace_s if grace_s is None else grace_s
        self._set_serving(False)
        await self._halt_fetching()
        await self._wait_idle(grace)
        await self._publish_telemetry("stopped")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.bridge is not None:
            await self.bridge.stop()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)  # acks, naks and the last telemetry go out
            with contextlib.suppress(Exception):
                await self.nc.close()
        log.info("worker %s stopped", self.worker_id)

    async def _bind(self, group: str) -> None:
        """Join ``group``: its consumer (created if missing) and its control subject."""
        assert self.nc is not None and self.js is not None
        await qnats.ensure_group_consumer(self.js, self.config.nats, group)
        self._psub = await qnats.group_pull_subscription(self.js, self.config.nats, group)
        self._group_ctl = await self.nc.subscribe(
            self.subjects.control_group(group), cb=self._on_control
        )
        self._fetch_stop = False
        self._fetch_task = asyncio.create_task(self._fetch_loop(self._psub), name="worker-fetch")

    async def _unbind(self) -> None:
        """Leave the current group (fetching must have been halted)."""
        if self._group_ctl is not None:
            with contextlib.suppress(Exception):
                await self._group_ctl.unsubscribe()
            self._group_ctl = None
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
            self._psub = None

    def _set_serving(self, on: bool) -> None:
        self._accepting = on
        self.state = "serving" if on else "draining"
        self._wake.set()

    async def _halt_fetching(self) -> None:
        """End the fetch loop (at most one long-poll away) and nak what it left behind."""
        self._fetch_stop = True
        self._wake.set()
        if self._fetch_task is not None:
            with contextlib.suppress(Exception):
                await self._fetch_task
            self._fetch_task = None
        psub = self._psub
        # A long-poll answered right at its expiry lands in the local queue: hand it back.
        while psub is not None and psub.pending_msgs > 0:
            try:
                for msg in await psub.fetch(1, timeout=0.05):
                    await _settle(msg.nak)
            except Exception:
                break

    async def _wait_idle(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self._inflight or self._starting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(left, 0.5))
        if not self._inflight and not self._starting:
            return
        log.warning(
            "grace period over: handing %d requests back", len(self._inflight) + len(self._starting)
        )
        for task, msg in list(self._starting.items()):
            task.cancel()
            await _settle(msg.nak)
        for st in list(self._inflight.values()):
            await self._flush(st)  # what was generated reaches the caller; the next replica resumes
            self._inflight.pop(st.request.id, None)
            if self.bridge is not None:
                self.bridge.abort(st.request.id)
            await _settle(st.msg.nak)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)

    # --- fetching ------------------------------------------------------------------------

    def _free_slots(self) -> int:
        cap = self.bridge.batch_cap if self.bridge is not None else 0
        return cap - len(self._inflight) - len(self._starting)

    async def _fetch_loop(self, psub: JetStreamContext.PullSubscription) -> None:
        while not self._fetch_stop:
            if not self._accepting or self._free_slots() <= 0:
                self._wake.clear()
                if not self._fetch_stop and (not self._accepting or self._free_slots() <= 0):
                    await self._wake.wait()
                continue
            try:
                # One at a time: a batch fetch lingers for the rest of its batch.
                msgs = await psub.fetch(1, timeout=self.options.fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:
                if self._fetch_stop:
                    break
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                if self._fetch_stop or not self._accepting:
                    await _settle(msg.nak)
                    continue
                task = asyncio.create_task(self._serve(msg))
                self._starting[task] = msg

    # --- one request ---------------------------------------------------------------------

    async def _serve(self, msg: Msg) -> None:
        task = asyncio.current_task()
        try:
            await self._admit(msg)
        except Exception:
            log.exception("request handling failed")
            await _settle(msg.term)
        finally:
            if task is not None:
                self._starting.pop(task, None)
            self._wake.set()

    async def _admit(self, msg: Msg) -> None:
        try:
            attempt = msg.metadata.num_delivered
        except Exception:
            attempt = 1
        try:
            req = GenerateRequest.from_bytes(msg.data, self._max_payload)
        except ProtocolError as exc:
            await self._reject_raw(msg, exc)
            return
        if self._was_aborted(req.id):
            await _settle(msg.ack)
            return
        existing = self._inflight.get(req.id)
        if existing is not None:  # our own request, redelivered after a late in_progress
            existing.msg = msg
            return
        start = req.created_ms / 1000.0 if req.created_ms > 0 else time.time()
        st = _Flight(req, msg, attempt, base=0, start=start)
        if req.deadline_ms is not None and time.time() * 1000 >= req.deadline_ms:
            await self._send_error(
                st, DeadlineExceededError("the request's deadline passed before it started")
            )
            return
        resume: list[int] = []
        if attempt > 1:
            reply = await self._ask_resume(req, attempt)
            if reply is None:
                log.info("request %s: no caller answers the resume query; dropping it", req.id)
                await _settle(msg.ack)
                return
            resume = reply.token_ids
            st.base = st.sent = len(resume)
        remaining = req.params.max_tokens - st.base
        if remaining <= 0:  # everything was delivered but the final chunk
            await self._send_final(st, "length", prompt_tokens=0, cached=0)
            return
        try:
            params = _sampling_params(req, remaining)
        except SamplingParamsError as exc:
            await self._send_error(st, InvalidRequestError(str(exc), param=exc.param))
            return
        self._inflight[req.id] = st
        assert self.bridge is not None
        self.bridge.add(
            AddRequest(
                request_id=req.id,
                params=params,
                prompt=req.prompt,
                prompt_token_ids=None if req.prompt is not None else list(req.prompt_token_ids),
                resume_token_ids=tuple(resume),
                priority=req.priority,
                arrival_time=start,
            )
        )

    async def _ask_resume(self, req: GenerateRequest, attempt: int) -> ResumeReply | None:
        """The caller's answer to ``resume.<id>``; None when nobody answers (caller gone)."""
        assert self.nc is not None
        query = ResumeQuery(id=req.id, attempt=attempt, worker=self.worker_id)
        try:
            answer = await self.nc.request(
                self.subjects.resume(req.id),
                query.to_bytes(),
                timeout=self.options.resume_timeout_s,
            )
            return ResumeReply.from_bytes(answer.data, self._max_payload)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            return None
        except ProtocolError as exc:
            log.warning("request %s: bad resume reply (%s); dropping it", req.id, exc.message)
            return None

    async def _reject_raw(self, msg: Msg, exc: ProtocolError) -> None:
        """An undecodable request: an error chunk to its reply when one can be read, then term."""
        reply, rid = _raw_reply(msg.data)
        log.warning("undecodable request (reply %r): %s", reply, exc.message)
        if reply is not None and self.nc is not None:
            chunk = Chunk(
                id=rid, finish_reason="error", worker=self.worker_id,
                error=ErrorInfo(exc.code, exc.message),
            )  # fmt: skip
            with contextlib.suppress(Exception):
                await self.nc.publish(reply, chunk.to_bytes())
        self.telemetry.finished(0.0, error=True)
        await _settle(msg.term)

    # --- engine output -------------------------------------------------------------------

    def _on_engine_events(self, events: list[BridgeEvent]) -> None:
        """Called on the loop by the engine thread; the pump publishes in order."""
        self._events.extend(events)
        self._pump_wake.set()

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None
        while True:
            await self._pump_wake.wait()
            self._pump_wake.clear()
            events, self._events = self._events, []
            for event in events:
                try:
                    await self._on_event(event)
                except Exception:
                    log.exception("handling engine output for %s failed", event.request_id)
            now = loop.time()
            due = [st for st in self._inflight.values() if st.flush_at is not None]
            for st in due:
                if st.flush_at is not None and st.flush_at <= now:
                    await self._flush(st)
            nxt = min((st.flush_at for st in self._inflight.values() if st.flush_at), default=None)
            if timer is not None:
                timer.cancel()
            timer = loop.call_at(nxt, self._pump_wake.set) if nxt is not None else None

    async def _on_event(self, event: BridgeEvent) -> None:
        st = self._inflight.get(event.request_id)
        if st is None:
            return  # handed back or already answered
        if isinstance(event, RequestFailed):
            error = event.error
            if st.base > 0 and isinstance(error, ContextLengthExceededError):
                # Resumed right at the context limit: the first attempt would have ended here.
                await self._send_final(st, "length", prompt_tokens=0, cached=0)
            else:
                await self._send_error(st, error)
            return
        self._absorb(st, event)
        if event.finished:
            if st.error is not None and event.finish_reason == "abort":
                await self._send_error(st, st.error)
                return
            output = event.output
            prompt = len(output.prompt_token_ids) - st.base if output is not None else 0
            cached = min(output.num_cached_tokens, prompt) if output is not None else 0
            await self._send_final(
                st, event.finish_reason or "stop", prompt_tokens=prompt, cached=cached
            )
        elif not st.first_sent or self._coalesce_s <= 0:
            await self._flush(st)
        elif st.flush_at is None:
            st.flush_at = asyncio.get_running_loop().time() + self._coalesce_s

    @staticmethod
    def _absorb(st: _Flight, delta: RequestDelta) -> None:
        st.ids.extend(delta.token_ids)
        st.text += delta.text
        if delta.logprobs:
            st.logprobs.extend(delta.logprobs)
        if delta.top_logprobs:
            st.tops.extend(
                TopLogprobs([t for t, _ in top], [lp for _, lp in top])
                for top in delta.top_logprobs
            )

    def _take_chunk(self, st: _Flight) -> Chunk:
        chunk = Chunk(
            id=st.request.id, seq=st.sent, attempt=st.attempt, token_ids=st.ids, text=st.text,
            logprobs=st.logprobs if len(st.logprobs) == len(st.ids) else [],
            top_logprobs=st.tops if len(st.tops) == len(st.ids) else [], worker=self.worker_id,
        )  # fmt: skip
        if st.ids and not st.first_sent and st.base == 0:
            self.telemetry.first_token(time.time() - st.start)
        if st.ids:
            st.first_sent = True
        st.sent += len(st.ids)
        self.telemetry.tokens(len(st.ids))
        st.ids, st.text, st.logprobs, st.tops, st.flush_at = [], "", [], [], None
        return chunk

    async def _flush(self, st: _Flight) -> None:
        if st.ids or st.text:
            await self._publish(st, self._take_chunk(st))
        st.flush_at = None

    async def _send_final(
        self, st: _Flight, reason: str, *, prompt_tokens: int, cached: int
    ) -> None:
        chunk = self._take_chunk(st)
        chunk.finish_reason = reason  # type: ignore[assignment]  # engine reasons are wire reasons
        chunk.usage = Usage(
            prompt_tokens=prompt_tokens, completion_tokens=st.sent, cached_tokens=cached
        )
        await self._complete(st, chunk, error=False)

    async def _send_error(self, st: _Flight, error: QosError) -> None:
        chunk = Chunk(
            id=st.request.id, seq=st.sent, attempt=st.attempt, finish_reason="error",
            error=ErrorInfo(error.code, error.message), worker=self.worker_id,
        )  # fmt: skip
        await self._complete(st, chunk, error=True)

    async def _complete(self, st: _Flight, chunk: Chunk, *, error: bool) -> None:
        """Publish the last chunk, then ack: the request is answered (no redelivery)."""
        self._inflight.pop(st.request.id, None)
        await self._publish(st, chunk)
        await _settle(st.msg.ack)
        self.telemetry.finished(time.time() - st.start, error=error)
        self._wake.set()

    async def _publish(self, st: _Flight, chunk: Chunk) -> None:
        assert self.nc is not None
        try:
            await self.nc.publish(st.request.reply, chunk.to_bytes())
        except Exception as exc:
            log.warning("request %s: publishing a chunk failed: %s", st.request.id, exc)

    # --- periodic work -------------------------------------------------------------------

    async def _ticker(self) -> None:
        """Keep held messages from redelivering; abort requests whose deadline passed."""
        progress_every = self.config.nats.ack_wait_s / 3
        tick = min(progress_every, 0.5)
        last_progress = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now_ms = time.time() * 1000
            for st in list(self._inflight.values()):
                deadline = st.request.deadline_ms
                if deadline is not None and now_ms >= deadline and st.error is None and self.bridge:
                    st.error = DeadlineExceededError(
                        "the request's deadline passed while generating"
                    )
                    self.bridge.abort(st.request.id)
            if time.monotonic() - last_progress >= progress_every - tick / 2:
                last_progress = time.monotonic()
                for st in list(self._inflight.values()):
                    await _settle(st.msg.in_progress)
                for msg in list(self._starting.values()):
                    await _settle(msg.in_progress)

    async def _telemetry_loop(self) -> None:
        while True:
            await self._publish_telemetry(self.state)
            await asyncio.sleep(self.config.worker.telemetry_interval_s)

    async def _publish_telemetry(self, state: telemetry.State) -> None:
        if self.nc is None or self.bridge is None:
            return
        message = self.telemetry.build(
            self.group, state, self.bridge.stats, self.bridge.batch_cap, self.bridge.busy_s
        )
        await telemetry.publish(self.nc, self.kv, self.subjects, message)

    # --- control -------------------------------------------------------------------------

    async def _on_control(self, msg: Msg) -> None:
        try:
            control = Control.from_bytes(msg.data, self._max_payload)
        except ProtocolError as exc:
            log.warning("bad control message on %s: %s", msg.subject, exc.message)
            return
        action = control.action
        if action == "abort" and control.request_id:
            self._remember_abort(control.request_id)
            if control.request_id in self._inflight and self.bridge is not None:
                self.bridge.abort(control.request_id)
        elif action == "set_batch_cap" and self.bridge is not None:
            group_max = self.config.groups[self.group].max_batch
            cap = self.bridge.set_batch_cap(min(control.batch_cap or group_max, group_max))
            log.info("batch cap set to %d (%s)", cap, control.reason or "control")
            self._wake.set()
        elif action == "drain":
            log.info("draining (%s)", control.reason or "control")
            self._set_serving(False)
        elif action == "resume" and not self._stopped:
            self._set_serving(True)
        elif action == "assign_group" and control.group:
            self._tasks.append(asyncio.create_task(self.assign_group(control.group)))

    async def assign_group(self, group: str) -> None:
        """Drain, then move this replica to ``group``'s consumer (its batch limit too)."""
        if group not in self.config.groups:
            log.warning("assign_group: unknown group %r ignored", group)
            return
        async with self._switch_lock:
            if self._stopped:
                return
            if group != self.group:
                self._set_serving(False)
                await self._halt_fetching()
                # Still subscribed to the old group's control: aborts keep reaching us.
                await self._wait_idle(self.options.grace_s)
                await self._unbind()
                old, self.group = self.group, group
                await self._bind(group)
                assert self.bridge is not None
                self.bridge.set_batch_cap(self.config.groups[group].max_batch)
                log.info("moved from group %s to %s", old, group)
            self._set_serving(True)

    def _remember_abort(self, request_id: str) -> None:
        now = time.monotonic()
        if len(self._aborted) >= ABORT_MEMORY_MAX:
            self._aborted = {k: t for k, t in self._aborted.items() if now - t < ABORT_MEMORY_S}
            while len(self._aborted) >= ABORT_MEMORY_MAX:
                self._aborted.pop(next(iter(self._aborted)))
        self._aborted[request_id] = now

    def _was_aborted(self, request_id: str) -> bool:
        at = self._aborted.get(request_id)
        return at is not None and time.monotonic() - at < ABORT_MEMORY_S

    # --- for tests and the CLI ------------------------------------------------------------

    @property
    def inflight_ids(self) -> list[str]:
        return list(self._inflight)


def _sampling_params(req: GenerateRequest, max_tokens: int) -> SamplingParams:
    p = req.params
    return SamplingParams(
        max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, logprobs=p.logprobs,
    )  # fmt: skip


def _raw_reply(data: bytes) -> tuple[str | None, str]:
    """(reply, id) read leniently from a payload that failed strict decoding."""
    try:
        obj = msgpack.unpackb(bytes(data), raw=False)
    except Exception:
        return None, ""
    if not isinstance(obj, dict):
        return None, ""
    reply, rid = obj.get("reply"), obj.get("id")
    rid = rid if isinstance(rid, str) and len(rid) <= 128 else ""
    if not isinstance(reply, str) or not reply or any(c in reply for c in " \t\r\n*>"):
        return None, rid
    return reply, rid


async def _settle(action: object) -> None:
    """Run an ack/nak/term/in_progress; a message already settled or a closed link is fine."""
    try:
        await action()  # type: ignore[operator]
    except Exception as exc:
        log.debug("message settle failed: %s", exc)
