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

Control messages (``<prefix>.ctl.<worker>`` and ``<prefix>.ctl.group.<group>``):

- ``abort`` ``request_id``: the engine drops it and frees its KV blocks at once; the final
  chunk says ``abort``. An id not fetched yet is remembered (10 min) and dropped on fetch.
- ``set_batch_cap`` ``batch_cap``: cap the running batch (at most the group's
  ``max_batch``; no value = back to it); see :meth:`EngineBridge.set_batch_cap`.
- ``drain`` / ``resume``: stop / restart fetching; requests in flight finish either way.
- ``assign_group`` ``group``: drain, wait for the requests in flight (grace period), then
  move to that group's consumer, control subject and batch limit.

Stopping (SIGTERM, :meth:`WorkerService.stop`) stops fetching, lets requests in flight
finish within a grace period, then ``nak()``s the rest so another replica resumes them
where the caller's stream stands, publishes a last ``stopped`` telemetry and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from opentelemetry.trace import TracerProvider

import common.nats as qnats
from common.config import Config
from common.detokenizer import resumed_ending
from common.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    ProtocolError,
    QosError,
    RequestGivenUpError,
    error_from_code,
)
from common.fence import FenceGuard
from common.heartbeat import idle_request_ids
from common.liveness import LoopBeat
from common.logging import about
from common.models import configured_served_name
from common.protocol import (
    Chunk,
    Control,
    ErrorInfo,
    GenerateRequest,
    ResumeQuery,
    heartbeat_reconnects,
)
from common.recent_ids import RecentIds
from common.subjects import Subjects
from common.tasks import cancel_and_wait, watch
from common.tracing import tracer_for
from workers import telemetry
from workers.bridge import (
    AddRequest,
    BridgeEvent,
    EngineBridge,
    RequestFailed,
    StepEngine,
    encode_prompt,
)
from workers.engine.sampling_params import SamplingParamsError
from workers.intake import (
    Intake,
    NoAnswer,
    ask_resume,
    hand_back,
    reject_undecodable,
    retry_or_fail,
    settle,
)
from workers.metrics import EngineView
from workers.observe import WorkerObserver, about_flight
from workers.orphans import GatewayWatch
from workers.outbox import Flight, sampling_params
from workers.resync import Resync

log = logging.getLogger(__name__)
# A redelivered request whose live gateway did not answer its resume query comes back
# after this long (the gateway reconnecting, or its event loop late).
RESUME_RETRY_S = 1.0
# An abort the engine has not acted on this long after a request's deadline: its thread is
# stuck, and the worker answers the request itself.
ENGINE_STUCK_S = 10.0
# A batch cap below the group's max (a breaker's, from the scheduler) lapses when no order
# renews it for this long: the leading scheduler resends it every 5 s while the breaker stays
# open, and gateways stop diverting from an unrenewed open breaker after the same 30 s.
CAP_LAPSE_S = 30.0
# A caller's created_ms counts only within this of JetStream's time of storing the request.
CREATED_SKEW_S = 1.0
# Text prompts longer than this are tokenized on a thread before they reach the engine.
OFFLOAD_TOKENIZE_CHARS = 16 * 1024


# How often a worker re-reads its group consumer's ack_wait from the server.
CONSUMER_CHECK_S = 30.0
# What a group's control subject may ask of its replicas (see _on_group_control): the
# scheduler's caps, and aborts from gateways of the release before qos.abort.<group>.
GROUP_ACTIONS = frozenset({"abort", "set_batch_cap"})
# What the scheduler decides, each stamped when issued: older than this (clocks of two hosts
# agree to well under it), it is a replay, not a decision.
SCHEDULER_ACTIONS = frozenset({"assign_group", "drain", "resume", "set_batch_cap"})
CONTROL_STALE_S = 30.0
# Supersedes remembered for admissions still under way (the oldest go first).
MAX_SUPERSEDED = 10_000
ABORT_ONLY = frozenset({"abort", "supersede"})


@dataclass
class WorkerOptions:
    """Per-replica settings that are not in :class:`Config` (they come from flags)."""

    group: str
    worker_id: str
    model: str = ""
    grace_s: float = 30.0
    # One engine step running this long is a hung device: the replica hands its requests
    # back and exits (1) for its supervisor to restart it. Steps take milliseconds on a
    # GPU and seconds at most for a long prefill chunk on a CPU.
    engine_stuck_s: float = 60.0
    fetch_timeout_s: float = 0.5  # long-poll length; also bounds how fast fetching stops
    resume_timeout_s: float = 1.0


def _started_at(req: GenerateRequest, msg: Msg) -> float:
    """When the request arrived, for its TTFT, E2E and queue order: the caller's
    ``created_ms`` when it agrees with JetStream's own time of storing the message (within a
    second of clock skew, and not in the future), else that time. A caller's claim alone
    would let one request report a latency of years and open its group's breaker."""
    now = time.time()
    try:
        stored = msg.metadata.timestamp.timestamp()
    except Exception:  # not a JetStream message (tests, a core publish)
        stored = now
    claimed = req.created_ms / 1000.0
    return claimed if stored - CREATED_SKEW_S <= claimed <= now else min(stored, now)


def _stream_seq(msg: Msg) -> int | None:
    """The message's sequence in the stream: the same for every delivery of one message."""
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:
        return None


class WorkerService:
    """Serves one group from ``engine``; :meth:`start`, then :meth:`run` or :meth:`stop`.

    Spans go to ``tracer_provider``, else to the process's (:mod:`common.tracing`); metrics
    to ``self.observer.registry``, served on ``worker.metrics_port``.
    """

    def __init__(
        self,
        config: Config,
        engine: StepEngine,
        options: WorkerOptions,
        *,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
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
        self.telemetry = telemetry.WorkerTelemetry(
            options.worker_id, options.model, window_s=config.worker.latency_window_s
        )
        self._reporter = telemetry.Reporter()
        self._flight_numbers = itertools.count(1)  # engine ids: see Flight.engine_id
        self.observer = WorkerObserver(
            worker_id=options.worker_id,
            model=options.model
            or configured_served_name(config.gateway.served_model_name, config.worker.model),
            view=self._engine_view,
            tracer=tracer_for(tracer_provider, "qosserve.worker"),
        )
        self.beat = LoopBeat()  # /livez: this loop still runs (its engine watchdog too)
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.kv: KeyValue | None = None
        self.bridge: EngineBridge | None = None
        self._intake: Intake | None = None
        self._ctl_subs: list[Subscription] = []
        self._group_ctl: Subscription | None = None
        self._group_abort: Subscription | None = None
        # The consumer's ack_wait as last read from the server, and the pace it sets.
        self._ack_wait_s = config.nats.ack_wait_s
        self._server_ack_wait: float | None = None
        self._ack_wait_checked = 0.0
        self._cap_set_at: float | None = None  # when a cap below the group max was last set
        self._inflight: dict[str, Flight] = {}
        self._starting: dict[asyncio.Task[None], Msg] = {}  # fetched, not in the engine yet
        self._completing: set[Flight] = set()  # answered, the final chunk or ack under way
        # Their flights, once made (by message id): an admission that fails or is cancelled
        # before the flight is in flight still ends its attempt's span.
        self._admitting: dict[int, Flight] = {}
        self._aborted = RecentIds()
        # Request id -> the delivery that superseded earlier ones (see _supersede).
        self._superseded: dict[str, int] = {}
        self._fences = FenceGuard()  # the scheduler's term, from its commands' fences
        self._gateways = GatewayWatch(config.worker.orphan_after_s)
        self._accepting = False
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()  # a request finished, or the state changed
        self._pump_wake = asyncio.Event()
        self._events: list[BridgeEvent] = []
        # Flights holding tokens until their flush_at, in the order they fall due (the
        # coalescing window is one constant): the pump looks at the first one only.
        self._coalescing: dict[str, Flight] = {}
        self._flush_timer: asyncio.TimerHandle | None = None  # armed for the first of them
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self.exit_code = 0  # 1 once the engine failed for good (see _engine_failed)
        self._drained = False  # an operator's drain control, until a resume
        self._switch_lock = asyncio.Lock()
        self._coalesce_s = config.worker.coalesce_ms / 1000.0
        self._max_payload = config.nats.max_payload_bytes
        self._resync = Resync(
            self.subjects,
            options.worker_id,
            self._max_payload,
            timeout_s=options.resume_timeout_s,
            origin_silent_s=self._gateways.silent_s,
            origin_quiet_after_s=2 * config.gateway.heartbeat_interval_s,
            on_closed=self._caller_closed,
            quiet_keep_s=self._gateways.forget_after_s,
        )

    # --- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, make sure the stream/consumer/bucket exist, start serving."""
        cfg = self.config.nats
        loop = asyncio.get_running_loop()
        self.observer.start(
            self.config.worker.metrics_port, self.beat, self.config.worker.metrics_host
        )
        self.bridge = EngineBridge(
            self.engine, self._on_engine_events, loop, name=f"engine-{self.worker_id}"
        )
        self._apply_group_limits(self.group)
        self.bridge.start()
        self.nc = await qnats.connect(
            cfg, f"worker-{self.worker_id}", service="worker", on_closed=self._nats_closed
        )
        self.js = self.nc.jetstream()
        await qnats.ensure_stream(self.js, cfg, [self.group])
        self.kv = await qnats.ensure_kv(self.js, cfg)
        self._ctl_subs.append(
            await self.nc.subscribe(self.subjects.control(self.worker_id), cb=self._on_control)
        )
        # Gateway heartbeats: silence reaps orphans, a new reconnect count starts a resync.
        self._ctl_subs.append(
            await self.nc.subscribe(self.subjects.gateway_heartbeat_wildcard, cb=self._on_heartbeat)
        )
        await self._bind(self.group)
        self._tasks = [
            watch(asyncio.create_task(coro, name=name), self._cannot_serve)
            for coro, name in ((self._pump(), "worker-pump"), (self._ticker(), "worker-ticker"),
                               (self._telemetry_loop(), "worker-telemetry"),
                               (self.beat.run(), "worker-beat"))
        ]  # fmt: skip
        self._set_serving(True)
        log.info("worker %s serving group %s (batch cap %d, up to %d tokens)", self.worker_id,
                 self.group, self.bridge.batch_cap, self.bridge.seq_limit)  # fmt: skip

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
        if self.exit_code:
            grace = 0.0  # the engine is gone: nothing here finishes, hand it all back now
        self._set_serving(False)
        if self._intake is not None:
            await self._intake.halt()
        await self._wait_idle(grace)
        if self._intake is not None:  # a group move may have bound a new one meanwhile
            await self._intake.halt()
        # The periodic report goes first: its last word must not come after "stopped".
        await cancel_and_wait(self._tasks, what=f"worker {self.worker_id} tasks")
        self.state = "stopped"
        await self._publish_telemetry("stopped")
        if self.kv is not None:  # ids are host-pid: a key left behind is never reused
            with contextlib.suppress(Exception):
                await self.kv.purge(telemetry.HEARTBEAT_KEY_PREFIX + self.worker_id)
        await self._resync.close()
        if self.bridge is not None:
            await self.bridge.stop(join_s=1.0 if self.exit_code else None)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)  # acks, naks and the last telemetry go out
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.observer.close()
        tier = getattr(self.engine, "kv_tier", None)
        if tier is not None and self.bridge is not None and self.bridge.alive:
            # Still stepping (a hung device): closing the tier under it turned its pending
            # copies into errors; the process is on its way out, and the tier with it.
            log.warning("worker %s: the engine thread is still running; its KV tier is "
                        "left open", self.worker_id)  # fmt: skip
        elif tier is not None:
            # Off the loop: it flushes queued write-through stores for up to a few seconds.
            await asyncio.to_thread(tier.close)
        log.info("worker %s stopped", self.worker_id)

    async def _bind(self, group: str, wait_s: float | None = None) -> None:
        """Join ``group``: its consumer (created if missing, or waited for ``wait_s``
        where this user may not create it) and its control subject."""
        assert self.nc is not None and self.js is not None
        await qnats.ensure_group_consumer(self.js, self.config.nats, group, wait_s=wait_s)
        self._ack_wait_checked = 0.0  # another consumer now: read its ack_wait at the next tick
        psub = await qnats.group_pull_subscription(self.js, self.config.nats, group)
        self._group_ctl = await self.nc.subscribe(
            self.subjects.control_group(group), cb=self._on_group_control
        )
        self._group_abort = await self.nc.subscribe(self.subjects.abort(group), cb=self._on_abort)
        self._intake = Intake(
            psub,
            ready=self._has_room,
            accept=self._accept,
            fetch_timeout_s=self.options.fetch_timeout_s,
            connected=lambda: self.nc is not None and self.nc.is_connected,
            on_failure=self._cannot_serve,
            hand_back=self._hand_back,
            draining=lambda: not self._accepting,
        )
        self._intake.start()
        await qnats.barrier(self.nc)  # the server has our subscriptions before we say we serve

    async def _unbind(self) -> None:
        """Leave the current group: its consumer and its control subject."""
        if self._intake is not None:
            await self._intake.close()
            self._intake = None
        for sub in (self._group_ctl, self._group_abort):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._group_ctl = self._group_abort = None

    def _set_serving(self, on: bool) -> None:
        on = on and not self._stopped  # stopping is for good: nothing turns serving back on
        self._accepting = on
        self.state = "serving" if on else "draining"
        self._poke()

    def _poke(self) -> None:
        """Something changed that the intake or a waiting drain must look at."""
        self._wake.set()
        if self._intake is not None:
            self._intake.wake()

    async def _wait_idle(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self._inflight or self._starting or self._completing:
            left = deadline - time.monotonic()
            if left <= 0 or self.exit_code:  # an engine that failed meanwhile finishes nothing
                break
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self._wake.wait()
        if not self._inflight and not self._starting:
            return
        log.warning(
            "%s: handing %d requests back",
            "cannot serve" if self.exit_code else "grace period over",
            len(self._inflight) + len(self._starting),
        )
        for task, msg in list(self._starting.items()):
            task.cancel()
            await self._hand_back(msg)
        for st in list(self._inflight.values()):
            await self._flush(st)  # what was generated reaches the caller; the next replica resumes
            if self._inflight.get(st.request.id) is not st:
                continue  # answered while the flush waited on a full buffer: nothing to hand back
            self._forget(st)
            self._abort_in_engine(st)
            await self._hand_back(st.msg)
            self.observer.abandoned(st, "handed_back")
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)

    # --- one request ---------------------------------------------------------------------

    async def _hand_back(self, msg: Msg, delay: float | None = None) -> None:
        """A message not served here goes back to the queue (see :func:`hand_back`)."""
        if self.nc is None:  # no link to answer on: JetStream redelivers it after ack_wait
            return
        code = await hand_back(self.nc, msg, self.worker_id, self.config.nats.max_deliver,
                               self.subjects, delay)  # fmt: skip
        if code is not None:  # answered with an error on its last delivery
            self.observer.failed(self.group, code)

    def _has_room(self) -> bool:
        """Fetch only what the engine can batch now: the cap less what is held here."""
        if not self._accepting or self.bridge is None:
            return False
        return len(self._inflight) + len(self._starting) < self.bridge.batch_cap

    def _accept(self, msg: Msg) -> None:
        task = asyncio.create_task(self._serve(msg))
        self._starting[task] = msg

    async def _serve(self, msg: Msg) -> None:
        task = asyncio.current_task()
        outcome = "failed"
        try:
            await self._admit(msg)
        except asyncio.CancelledError:  # stopping: _wait_idle hands the message back
            outcome = "handed_back"
            raise
        except Exception as exc:
            for rid, st in list(self._inflight.items()):
                if st.msg is msg:  # half-admitted: forget it, the engine never got it
                    del self._inflight[rid]
                    self._abort_in_engine(st)
                    self.observer.abandoned(st, "failed")
            assert self.nc is not None
            code = await retry_or_fail(
                self.nc, msg, exc, self.worker_id, self.config.nats.max_deliver, self.subjects
            )
            if code is not None:  # given up, on its last delivery
                self.observer.failed(self.group, code)
        finally:
            started = self._admitting.pop(id(msg), None)
            if started is not None and self._inflight.get(started.request.id) is not started:
                # Not in flight: its span ends here (a no-op when its answer ended it).
                self.observer.abandoned(started, outcome)
            if task is not None:
                self._starting.pop(task, None)
            self._poke()

    def _misdirected(self, req: GenerateRequest) -> str | None:
        """Why a request a caller published on NATS must not be served, or None. Its chunks
        go to its own ``P.out.<id>``, nowhere else (another request's stream, an API
        subject), and its ``group`` is the one whose subject it came on."""
        if req.reply != self.subjects.out(req.id):
            return f"reply must be {self.subjects.out(req.id)!r} (the request's own out subject)"
        if req.group != self.group:
            return f"group {req.group!r} does not match the subject it came on ({self.group!r})"
        return None

    async def _admit(self, msg: Msg) -> None:
        try:
            attempt = msg.metadata.num_delivered
        except Exception:
            attempt = 1
        try:
            req = GenerateRequest.from_bytes(msg.data, self._max_payload)
        except ProtocolError as exc:
            assert self.nc is not None
            await reject_undecodable(self.nc, msg, exc, self.worker_id, self.subjects, attempt)
            return  # the caller's mistake: nothing about this group's health
        if req.id in self._aborted:
            await settle(msg.ack)
            return
        existing = self._inflight.get(req.id)
        if existing is not None:
            if _stream_seq(existing.msg) == _stream_seq(msg):
                if attempt > max(existing.delivered, existing.attempt) + 1:
                    # Deliveries in between went to another replica, whose attempt the
                    # caller now follows: ours, still stamped with our first one, would be
                    # ignored until the deadline. Stop ours; the next delivery resumes.
                    log.info("request %s: delivery %d here, another replica held it since "
                             "our delivery %d; handing it back to resume", req.id, attempt,
                             existing.attempt, extra=about(req.id))  # fmt: skip
                    self._forget(existing)  # its buffered tokens too: not the next's
                    self._abort_in_engine(existing)
                    self.observer.abandoned(existing, "handed_back")
                    await self._hand_back(msg, delay=RESUME_RETRY_S)
                    return
                existing.msg = msg  # our own request, redelivered after a late in_progress
                existing.delivered = attempt
            else:
                # Another message reusing the id of one in flight: serving it would mix two
                # answers on one reply subject, and swapping it in stranded the first unacked.
                log.warning(
                    "request %s: a second message with this id is in flight; terminated",
                    req.id,
                    extra=about(req.id),
                )
                await settle(msg.term)
            return
        misdirected = self._misdirected(req)
        if misdirected is not None:
            # Answered on its own P.out.<id> only: the reply a caller names is not trusted.
            assert self.nc is not None
            log.warning("request %s refused: %s", req.id, misdirected, extra=about(req.id))
            chunk = Chunk(id=req.id, attempt=attempt, finish_reason="error", worker=self.worker_id,
                          error=ErrorInfo("invalid_request", misdirected))  # fmt: skip
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.out(req.id), chunk.to_bytes())
            await settle(msg.term)
            return  # the caller's mistake (see _complete)
        st = Flight(req, msg, attempt, start=_started_at(req, msg))
        self.observer.fetched(st, msg, self.group)
        self._admitting[id(msg)] = st
        if req.deadline_ms is not None and time.time() * 1000 >= req.deadline_ms:
            await self._send_error(
                st, DeadlineExceededError("the request's deadline passed before it started")
            )
            return
        if self._gateways.gone(req.origin):
            # Its gateway died with the request still queued (it could not delete it): a
            # prefill for nobody, which live requests would wait behind. Ended as the
            # reaper ends one in flight, so a gateway that was only cut off and comes back
            # hears why (the resync re-sends the abort: a retryable 503 for its client).
            log.info(
                "request %s: its gateway %s is silent; not served",
                req.id,
                req.origin,
                extra=about(req.id),
            )
            self.observer.orphaned(st)
            await self._complete(st, st.final_chunk(self.worker_id, "abort"), error=False)
            return
        resume: list[int] = []
        resume_text_len = 0
        resumed = False
        if attempt > 1:
            assert self.nc is not None
            reply = await ask_resume(
                self.nc, self.subjects.resume(req.id),
                ResumeQuery(id=req.id, attempt=attempt, worker=self.worker_id),
                self.options.resume_timeout_s, self._max_payload,
            )  # fmt: skip
            if isinstance(reply, NoAnswer):
                # A timeout does not say the caller listens: every gateway subscribes to all
                # resume subjects and stays silent for ids it does not hold. Only a gateway
                # that still beats (reconnecting, or its loop late) is known to be there.
                if req.origin and not self._gateways.orphaned(req.origin):
                    if attempt >= self.config.nats.max_deliver:
                        # Handed back now, it would stay in the work queue for good (JetStream
                        # keeps a message past max_deliver); its caller never answered.
                        log.warning("request %s: its live gateway %s never answered the resume "
                                    "query, on its last delivery; dropping it", req.id,
                                    req.origin, extra=about(req.id))  # fmt: skip
                        # Its caller may still be listening, only slow: tell it, rather than
                        # leave it to its deadline.
                        given_up = st.error_chunk(self.worker_id, RequestGivenUpError(
                            "the request was given up: its caller never answered where to "
                            "resume it"))  # fmt: skip
                        await self._publish(st, given_up)
                        self._resync.finished(st)  # terminated: only a resync re-sends it
                        await settle(msg.term)
                        self.observer.answered(st, given_up, error=True)
                        return
                    # Hand the request back to be asked again, rather than drop what a client
                    # is waiting for (JetStream's max_deliver bounds the retries, and its
                    # advisory then fails the stream).
                    log.info("request %s: no answer to the resume query (%s) from live "
                             "gateway %s; handing it back", req.id, reply.value,
                             req.origin, extra=about(req.id))  # fmt: skip
                    await settle(lambda: msg.nak(delay=RESUME_RETRY_S))
                    self.observer.abandoned(st, "handed_back")
                    return
                log.info(
                    "request %s: no caller answers the resume query; dropping it",
                    req.id,
                    extra=about(req.id),
                )
                if req.origin:  # its gateway went silent meanwhile: as above, it may be back
                    self.observer.orphaned(st)
                    await self._complete(st, st.final_chunk(self.worker_id, "abort"), error=False)
                    return
                if reply is NoAnswer.SLOW:
                    # A caller without heartbeats (a NATS client) may be there, only slow:
                    # an error chunk costs nothing if it is gone, and spares it waiting
                    # silently to its deadline if not.
                    await self._publish(st, st.error_chunk(self.worker_id, RequestGivenUpError(
                        "the request was given up: its caller did not answer where to resume "
                        "it in time")))  # fmt: skip
                await settle(msg.ack)
                self.observer.abandoned(st, "no_caller")
                return
            if reply.closed:  # answered already (the first attempt's ack was lost)
                log.info(
                    "request %s: its caller has finished with it; dropping the copy",
                    req.id,
                    extra=about(req.id),
                )
                await settle(msg.ack)
                self.observer.abandoned(st, "closed")
                return
            resume, resume_text_len = reply.token_ids, reply.text_len
            st.resumed_at(resume, resume_text_len)
            resumed = True  # counted once it goes on (aborted, a twin, handed back: not)
            if req.id in self._aborted:  # aborted while we asked
                await settle(msg.ack)
                self.observer.abandoned(st, "aborted")
                return
        remaining = req.params.max_tokens - st.base
        if remaining <= 0:  # everything was delivered but the final chunk
            if resumed:
                self.observer.resumed(st)
            await self._end_resumed(st, held=False)  # not in the books yet: no check
            return
        try:
            params = sampling_params(req, remaining)
        except SamplingParamsError as exc:
            await self._send_error(st, InvalidRequestError(str(exc), param=exc.param))
            return
        prompt = req.prompt
        prompt_ids = None if prompt is not None else list(req.prompt_token_ids)
        if prompt is not None and len(prompt) > OFFLOAD_TOKENIZE_CHARS:
            # A long text prompt (a direct NATS caller's; the gateway sends token ids) is
            # tokenized here, off the engine thread, whose every request would wait for it.
            try:
                prompt_ids = await asyncio.to_thread(encode_prompt, self.engine, prompt)
            except InvalidRequestError as exc:
                await self._send_error(st, exc)
                return
            prompt = None
            if req.id in self._aborted:  # aborted while it was tokenized
                await settle(msg.ack)
                self.observer.abandoned(st, "aborted")
                return
        guide, guide_s = None, 0.0
        if params.guided is not None and hasattr(self.engine, "guide"):
            # Compiled here, on a thread: a grammar takes up to tens of milliseconds, which
            # on the engine thread every running request would wait out.
            began = time.perf_counter()
            try:
                guide = await asyncio.to_thread(
                    self.engine.guide, params.guided, resume, params.guided_after
                )
            except InvalidRequestError as exc:
                await self._send_error(st, exc)
                return
            guide_s = time.perf_counter() - began
            if req.id in self._aborted:  # aborted while it compiled
                await settle(msg.ack)
                self.observer.abandoned(st, "aborted")
                return
        twin = self._inflight.get(req.id)
        if twin is not None:
            # Another delivery of this id got in while this one awaited (a resume answer, a
            # tokenizer thread): one engine request per id, one answer on its reply.
            if _stream_seq(twin.msg) != _stream_seq(msg):
                log.warning(
                    "request %s: a second message with this id is in flight; terminated",
                    req.id,
                    extra=about(req.id),
                )
                await settle(msg.term)
                self.observer.abandoned(st, "duplicate")
                return
            if attempt <= max(twin.attempt, twin.delivered):
                self.observer.abandoned(st, "duplicate")  # an older delivery: ours goes on
                return
            # A later delivery of our own message, resumed since: its caller now follows
            # this attempt, and ignores the twin's chunks (stamped with the older one).
            self._retire(twin, "superseded")
        task = asyncio.current_task()
        if getattr(msg, "is_acked", False) or (task is not None and task.cancelling()):
            # Handed back while it was admitted (a drain's grace ran out): Python 3.11's
            # wait_for returns a reply that came with the cancel instead of raising, and
            # the request ran for nobody, in_progress renewing another replica's copy.
            self.observer.abandoned(st, "handed_back")
            return
        if self._superseded.get(req.id, 0) > attempt:
            # A later delivery resumed it elsewhere while this one was admitted (its
            # supersede found nothing in flight here): as _supersede would have, stop
            # without a word rather than run a copy for nobody.
            self.observer.abandoned(st, "superseded")
            return
        if resumed:
            self.observer.resumed(st)
        self._inflight[req.id] = st
        if guide is not None:
            self.observer.guided(st, req.params.guided_kind or "", guide_s)
        st.engine_id = f"{req.id}@{next(self._flight_numbers)}"
        assert self.bridge is not None
        self.bridge.add(
            AddRequest(
                request_id=st.engine_id,
                params=params,
                prompt=prompt,
                prompt_token_ids=prompt_ids,
                resume_token_ids=tuple(resume),
                resume_text_len=resume_text_len,
                priority=req.priority,
                arrival_time=st.start,
                cache_salt=req.cache_salt,
                guide=guide,
            )
        )

    # --- engine output -------------------------------------------------------------------

    def _on_engine_events(self, events: list[BridgeEvent]) -> None:
        """Called on the loop by the engine thread; the pump publishes in order."""
        self._events.extend(events)
        self._pump_wake.set()

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        coalescing = self._coalescing
        while True:
            await self._pump_wake.wait()
            self._pump_wake.clear()
            events, self._events = self._events, []
            for event in events:
                try:
                    await self._on_event(event)
                except Exception:
                    failed = self._flight_of(event)
                    log.exception(
                        "handling engine output for %s failed",
                        event.request_id,
                        extra=about(event.request_id) if failed is None else about_flight(failed),
                    )
                    await self._output_failed(event)
            now = loop.time()
            while coalescing:
                st = next(iter(coalescing.values()))
                if st.flush_at is not None and st.flush_at > now:
                    break
                await self._flush(st)  # takes it out of coalescing
            nxt = next(iter(coalescing.values())).flush_at if coalescing else None
            timer = self._flush_timer
            if timer is not None and timer.when() != nxt:
                timer.cancel()
                timer = self._flush_timer = None
            if timer is None and nxt is not None:
                # A timer that fired (perhaps a little early: libuv counts in ms) is gone,
                # so it is armed again; one still pending for the same time is kept.
                self._flush_timer = loop.call_at(nxt, self._flush_timer_fired)

    def _flush_timer_fired(self) -> None:
        self._flush_timer = None
        self._pump_wake.set()

    def _flight_of(self, event: BridgeEvent) -> Flight | None:
        """The flight whose engine request ``event`` is about (None: handed back or already
        answered, or an earlier flight of the id's)."""
        st = self._inflight.get(event.request_id.rpartition("@")[0])
        return st if st is not None and st.engine_id == event.request_id else None

    async def _output_failed(self, event: BridgeEvent) -> None:
        """Handling a request's output raised (a bug): it ends with an internal error and
        stops in the engine, rather than stay in flight, its slot held and in_progress
        sent, until its deadline (for good without one)."""
        st = self._flight_of(event)
        if st is None:
            return
        self._abort_in_engine(st)
        error = InternalError("the worker failed handling this request's output")
        try:
            await self._complete(st, st.error_chunk(self.worker_id, error), error=True)
        except Exception:
            log.exception("request %s: ending it failed too", st.request.id, extra=about_flight(st))
            self._forget(st)
            if not getattr(st.msg, "is_acked", False):  # answered and acked: nothing to hand back
                await self._hand_back(st.msg)  # its caller may have heard nothing
            self.observer.abandoned(st, "failed")
            self._poke()

    async def _on_event(self, event: BridgeEvent) -> None:
        st = self._flight_of(event)
        if st is None or st.output_lost:
            return
        if isinstance(event, RequestFailed):
            error = event.error
            if st.base > 0 and isinstance(error, ContextLengthExceededError):
                # Resumed right at the context limit: the first attempt would have ended here.
                # Its own task: rebuilding the held text detokenizes the whole output, and
                # every other stream's chunks wait behind the pump meanwhile.
                held = self._inflight.get(st.request.id) is st  # the engine refused it: ours
                self._spawn(self._end_resumed(st, held), "end-resumed")
            else:
                await self._flush(st)  # tokens it made before failing go out first
                if self._inflight.get(st.request.id) is not st:
                    return  # retired while the flush waited (superseded, handed back)
                await self._complete(st, st.error_chunk(self.worker_id, error), error=True)
            return
        st.absorb(event)
        self.observer.output(st, event)
        if event.finished:
            if st.error is not None and event.finish_reason == "abort":
                await self._complete(st, st.error_chunk(self.worker_id, st.error), error=True)
            else:
                reason = event.finish_reason or "stop"
                await self._complete(st, st.final_chunk(self.worker_id, reason, event), error=False)
        elif not st.first_sent or self._coalesce_s <= 0:
            await self._flush(st)  # the first token goes out at once: it is the TTFT
        elif st.flush_at is None:
            st.flush_at = asyncio.get_running_loop().time() + self._coalesce_s
            self._coalescing[st.request.id] = st

    async def _end_resumed(self, st: Flight, held: bool) -> None:
        """End a resumed request with nothing left to generate as its first attempt would
        have ended there: with the text that attempt held back (a possible stop-string
        start, an unfinished character), which the caller does not have yet. ``held``:
        ours when the task was started (judged then: a supersede or hand-back between the
        start and this task's first step must stop it too)."""
        text, matched, prompt_tokens = "", None, None
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is not None:
            try:
                text, matched, prompt_tokens = await asyncio.to_thread(
                    self._resumed_ending, st, tokenizer
                )
            except Exception:  # the tail costs its text, never the answer
                log.exception(
                    "request %s: could not rebuild the held-back text",
                    st.request.id,
                    extra=about_flight(st),
                )
        if held and self._inflight.get(st.request.id) is not st:
            return  # superseded or handed back meanwhile: its message is not ours to ack
        st.text += text
        reason = "length" if matched is None else "stop"
        chunk = st.final_chunk(self.worker_id, reason, prompt_tokens=prompt_tokens)
        if matched is not None and st.request.params.want_stop_reason:
            chunk.stop_reason = matched
        await self._complete(st, chunk, error=False)

    def _resumed_ending(self, st: Flight, tokenizer: Any) -> tuple[str, str | None, int]:
        """The held-back text, the stop string it matched, and the prompt's length (a
        text prompt's, encoded: the request carries no ids to count)."""
        req = st.request
        prompt_ids = (
            list(req.prompt_token_ids)
            if req.prompt is None
            else encode_prompt(self.engine, req.prompt)
        )
        params = sampling_params(req, req.params.max_tokens)
        text, matched = resumed_ending(
            tokenizer, prompt_ids, st.resume_ids, st.resume_text_len, params
        )
        return text, matched, len(prompt_ids)

    def _count(self, st: Flight, chunk: Chunk) -> None:
        """Telemetry for a chunk about to go out."""
        n = len(chunk.token_ids)
        if n and chunk.seq == st.base and st.base == 0 and st.attempt == 1:
            self.telemetry.first_token(time.time() - st.start)
        self.telemetry.tokens(n)
        self.observer.chunk(st, chunk)

    async def _flush(self, st: Flight) -> None:
        if self._coalescing.get(st.request.id) is st:
            del self._coalescing[st.request.id]
        if st.has_pending:
            chunk = st.take_chunk(self.worker_id)
            self._count(st, chunk)
            await self._publish(st, chunk)
        st.flush_at = None

    async def _send_error(self, st: Flight, error: QosError) -> None:
        await self._complete(st, st.error_chunk(self.worker_id, error), error=True)

    async def _complete(self, st: Flight, chunk: Chunk, *, error: bool) -> None:
        """Publish the last chunk, then ack: the request is answered (no redelivery)."""
        self._forget(st)
        self._count(st, chunk)
        # Out of the books but not settled yet: a drain waits for it (a publish pauses while
        # the client's buffer is full, and the stop cancelled the pump before the ack).
        self._completing.add(st)
        try:
            sent = await self._publish(st, chunk)
            await settle(st.msg.ack)
        finally:
            self._completing.discard(st)
        if sent is not chunk:  # too big to carry: the caller got an error ending instead
            chunk, error = sent, True
        self._resync.finished(st)
        if error and chunk.error is not None and _caller_error(chunk.error):
            pass  # a bad parameter, a prompt too long: the breakers must not see an outage
        elif error and chunk.error is not None and self._deadline_too_tight(st, chunk.error):
            # The caller's choice, not an outage: no error, no latency sample, but it ended
            # (uncounted, a replica serving mostly such requests read as stalled).
            self.telemetry.finished(None, error=False)
        elif error or chunk.finish_reason != "abort":
            # A request its caller cancelled (or whose gateway went silent) says nothing
            # about this group's latency or health: the breakers do not see it.
            first = st.attempt == 1  # a redelivery's clock ran through the wait for it
            self.telemetry.finished(time.time() - st.start if first else None, error=error)
        self.observer.answered(st, chunk, error=error)
        self._poke()

    def _deadline_too_tight(self, st: Flight, error: ErrorInfo) -> bool:
        """A deadline missed that its caller set tighter than the group's own latency bar
        (its breaker threshold): the caller's choice, not an outage. Counted, one tenant
        sending requests with 150 ms deadlines opened a healthy group's breaker, then its
        fallback's, each half-open spell re-opened by its probes."""
        deadline_ms = st.request.deadline_ms
        if error.code != "deadline_exceeded" or deadline_ms is None:
            return False
        group = self.config.groups[self.group]
        kind = group.breaker.p99_kind
        slo_ms = group.slo_e2e_p99_ms if kind == "e2e" else group.slo_ttft_ms
        return deadline_ms - st.start * 1000 < max(group.breaker.p99_threshold_ms, slo_ms)

    async def _publish(self, st: Flight, chunk: Chunk) -> Chunk:
        """Send ``chunk``; returns what went out in its place: ``chunk`` itself, or the
        error ending that replaced a final chunk too big to carry (see :meth:`_too_big`)."""
        assert self.nc is not None
        st.sent_chunks.append(chunk)
        try:
            await self.nc.publish(st.request.reply, chunk.to_bytes())
        except nats.errors.MaxPayloadError:
            return await self._too_big(st, chunk)
        except Exception as exc:
            log.warning(
                "request %s: publishing a chunk failed: %s",
                st.request.id,
                exc,
                extra=about_flight(st),
            )
        return chunk

    async def _too_big(self, st: Flight, chunk: Chunk) -> Chunk:
        """A chunk over the server's max_payload (many top logprobs, a long coalesced run)
        is never carried: its caller waited to its deadline for it while the request was
        acked here. The answer ends with an error instead, small enough to go; a final
        chunk's ending is returned, so that metrics, breakers and the span see the error
        the caller got, not the success that was not delivered."""
        assert self.nc is not None
        log.error("request %s: a chunk of %d tokens is over NATS max_payload (%d bytes); "
                  "ending the request", st.request.id, len(chunk.token_ids),
                  self.nc.max_payload, extra=about_flight(st))  # fmt: skip
        error = InternalError(
            f"a part of the answer was larger than the message bus carries ({self.nc.max_payload} "
            "bytes); ask for fewer top_logprobs"
        )
        st.sent_chunks.pop()
        if chunk.finish_reason is not None or chunk.error is not None:
            ending = st.error_chunk(self.worker_id, error)  # _complete acks after this
            st.sent_chunks.append(ending)
            with contextlib.suppress(Exception):
                await self.nc.publish(st.request.reply, ending.to_bytes())
            return ending
        # Mid-answer: stop it in the engine and end it (its own task: this may run inside
        # the flush loop over every flight). Output already on its way is dropped: an ending
        # in the same batch went out as a success behind the gap.
        st.output_lost = True
        self._abort_in_engine(st)
        self._spawn(self._send_error_if_ours(st, error), "too-big")
        return chunk

    async def _send_error_if_ours(self, st: Flight, error: QosError) -> None:
        """:meth:`_send_error` from a task of its own, unless ``st`` left the books before
        the task ran: handed back (a drain's flush found the chunk too big), its caller
        waits for the next delivery, and superseded, its message is another replica's."""
        if self._inflight.get(st.request.id) is st:
            await self._send_error(st, error)

    # --- periodic work -------------------------------------------------------------------

    async def _ticker(self) -> None:
        """Keep held messages from redelivering; abort requests whose deadline passed;
        resync callers after a NATS reconnect."""
        last_progress = time.monotonic()
        while True:
            # Paced by the consumer's ack_wait as the server has it (see _check_ack_wait).
            progress_every = self._ack_wait_s / 3
            tick = min(progress_every, 0.5)
            await asyncio.sleep(tick)
            # First and on its own: were it to stop, JetStream would redeliver requests that
            # still run here (settle() never raises).
            if time.monotonic() - last_progress >= progress_every - tick / 2:
                last_progress = time.monotonic()
                for st in list(self._inflight.values()):
                    await settle(st.msg.in_progress)
                for msg in list(self._starting.values()):
                    await settle(msg.in_progress)
            try:
                await self._tick_checks()
            except Exception:  # a bug in one check must not end the ticks for good
                log.exception("worker tick failed; the next one runs as usual")

    async def _check_ack_wait(self) -> None:
        """Every component writes the group consumer's config at start, the last one's
        ``ack_wait`` wins: paced by this worker's own, ``in_progress`` would come too late
        for a shorter one, and every long request would be redelivered and run twice. So the
        pace follows the shorter of the two, re-read every ``CONSUMER_CHECK_S``."""
        self._ack_wait_checked = time.monotonic()
        if self.js is None:
            return
        try:
            info = await self.js.consumer_info(
                self.config.nats.stream, Subjects.consumer(self.group)
            )
        except Exception as exc:  # NATS reconnecting: the last known value stands
            log.debug("consumer info for the ack_wait check failed: %s", exc)
            return
        server = float(info.config.ack_wait or self.config.nats.ack_wait_s)
        mine = self.config.nats.ack_wait_s
        if server != mine and server != self._server_ack_wait:
            log.warning("consumer %s has ack_wait %.1f s, this worker's nats.ack_wait_s is "
                        "%.1f s: in_progress paced by the shorter (keep them equal)",
                        Subjects.consumer(self.group), server, mine)  # fmt: skip
        self._server_ack_wait = server
        self._ack_wait_s = min(mine, server)

    async def _tick_checks(self) -> None:
        """Resync, deadlines, the engine thread's health and orphans: one tick's worth."""
        if self.nc is not None:
            self._resync.tick(self.nc, list(self._inflight.values()))
        if time.monotonic() - self._ack_wait_checked >= CONSUMER_CHECK_S:
            # A task of its own: a JetStream API call that stalls (up to its 5 s timeout)
            # held up this tick's deadlines and health checks, and the next in_progress.
            self._ack_wait_checked = time.monotonic()
            self._spawn(self._check_ack_wait(), "ack-wait-check")
        now_ms = time.time() * 1000
        for st in list(self._inflight.values()):
            if self._inflight.get(st.request.id) is not st:
                continue  # replaced while an earlier one was answered below
            deadline = st.request.deadline_ms
            if deadline is None or now_ms < deadline or self.bridge is None:
                continue
            if st.error is None:
                st.error = DeadlineExceededError("the request's deadline passed while generating")
                self._abort_in_engine(st)
            elif now_ms >= deadline + ENGINE_STUCK_S * 1000:
                # The engine has not acted on the abort. Answer from here, so neither the
                # caller nor the message waits on it; whatever it emits later finds no
                # request. Mid-step, it only reads aborts once the step ends: a long step
                # (a CPU prefill chunk) is the step watchdog's to judge (engine_stuck_s),
                # not a hung device; this exited 1 on a healthy replica. Between steps,
                # an abort not taken means the thread is stuck elsewhere.
                mid_step = self.bridge.step_running_s() > 0
                # Taken but not heard of: its output waits behind a pump that is late (a
                # NATS stall), which says nothing about the engine; exiting 1 over it
                # handed back every request of a healthy replica.
                taken = st.abort_at is not None and self.bridge.drained_at >= st.abort_at
                log.error("request %s: the engine has not stopped it %.0f s after its "
                          "deadline%s; answering from the event loop", st.request.id,
                          ENGINE_STUCK_S, " (one step still running)" if mid_step
                          else " (it took the abort; its output is late)" if taken
                          else "", extra=about_flight(st))  # fmt: skip
                await self._send_error(st, st.error)
                if not mid_step and not taken:
                    self._engine_failed("it did not act on an abort")
        if self.bridge is not None and not self.bridge.alive:
            self._engine_failed("its thread has ended")
        elif self.bridge is not None and self.bridge.step_running_s() > self.options.engine_stuck_s:
            self._engine_failed(f"one step has run {self.bridge.step_running_s():.0f} s")
        self._reap_orphans()

    def _engine_failed(self, why: str) -> None:
        """The engine will serve nothing more (a hung device, a dead thread): stop taking
        work, hand what it holds back to JetStream for another replica, exit 1. It used to
        stay up holding its requests (in_progress kept them from redelivery) until each
        one's deadline, taking new ones as slots freed."""
        self._cannot_serve(f"the engine failed: {why}")

    def _nats_closed(self) -> None:
        """NATS gave up on this connection (not our own close): nothing can be fetched,
        answered or acked any more, while /metrics still answers the liveness probe."""
        if not self._stopped:
            self._cannot_serve("NATS closed the connection for good")

    def _cannot_serve(self, why: str) -> None:
        """Serving is over for this process (the engine, or a loop it needs, failed): hand
        the requests back and exit 1, for the orchestrator to start a fresh one."""
        if self.exit_code:
            return
        log.error("worker %s cannot serve (%s): handing its requests back and exiting",
                  self.worker_id, why)  # fmt: skip
        self.exit_code = 1
        self._set_serving(False)
        self.request_stop()

    async def _on_heartbeat(self, msg: Msg) -> None:
        gateway_id = msg.subject.rsplit(".", 1)[-1]
        idle = idle_request_ids(msg.data)
        if idle is not None:  # its streams silent for a while (common/idle_streams.py)
            self._gateways.heard(gateway_id)
            if self.nc is not None:
                self._resync.idle_at_caller(self.nc, gateway_id, idle)
            return
        if self._gateways.heard(gateway_id, heartbeat_reconnects(msg.data)) and self.nc is not None:
            self._resync.caller_reconnected(self.nc, gateway_id, list(self._inflight.values()))

    def _reap_orphans(self) -> None:
        """Abort requests whose gateway went silent (see :mod:`workers.orphans`)."""
        watch = self._gateways
        if not watch.enabled or self.bridge is None:
            # Gateways (a new id per gateway process) are still heard for resyncs: forget
            # the ones long gone, or every worker keeps each one ever started.
            watch.forget_stale()
            return
        if self.nc is None or not self.nc.is_connected:
            watch.cut_off()
            return
        for st in list(self._inflight.values()):
            origin = st.request.origin
            if st.orphaned or st.error is not None or not watch.orphaned(origin):
                continue
            st.orphaned = True
            log.warning(
                "request %s: gateway %s silent for %.1fs; aborting (its caller is gone)",
                st.request.id, origin, watch.silent_s(origin), extra=about_flight(st),
            )  # fmt: skip
            self.observer.orphaned(st)
            self._abort_in_engine(st)
        watch.forget_stale()

    async def _telemetry_loop(self) -> None:
        while True:
            self._lapse_unrenewed_cap()
            await self._publish_telemetry(self.state)
            await asyncio.sleep(self.config.worker.telemetry_interval_s)

    def _lapse_unrenewed_cap(self) -> None:
        """Back to the group's max batch once a lower cap has gone unrenewed (no scheduler
        leads): gateways send the group its traffic again then, and 4 of 16 slots would
        queue it."""
        if self.bridge is None or self._cap_set_at is None:
            return
        group_max = self.config.groups[self.group].max_batch
        if time.monotonic() - self._cap_set_at < CAP_LAPSE_S:
            return
        self._cap_set_at = None
        if self.bridge.batch_cap < group_max:
            log.warning("batch cap %d not renewed for %.0f s (no scheduler leads?); back to %d",
                        self.bridge.batch_cap, CAP_LAPSE_S, group_max)  # fmt: skip
            self.bridge.set_batch_cap(group_max)
            self._poke()

    async def _publish_telemetry(self, state: telemetry.State) -> None:
        if self.nc is None or self.bridge is None:
            return
        message = self.telemetry.build(
            self.group, state, self.bridge.stats, self.bridge.batch_cap, self.bridge.busy_s,
            max_seq_len=self.bridge.seq_limit, engine_max_seq_len=self.bridge.built_max_seq_len,
        )  # fmt: skip
        await self._reporter.publish(
            self.nc, self.kv, self.subjects, message, self.observer.metrics_port
        )

    def _engine_view(self) -> EngineView | None:
        """The engine as ``/metrics`` reads it (from the scrape thread: snapshots only)."""
        bridge = self.bridge
        if bridge is None:
            return None
        return EngineView(
            self.group, bridge.stats, bridge.batch_cap, bridge.busy_s,
            getattr(self.engine, "kv_tier", None),
        )  # fmt: skip

    # --- control -------------------------------------------------------------------------

    async def _on_group_control(self, msg: Msg) -> None:
        """The group's control subject carries the scheduler's caps (and older gateways'
        aborts), no more: a drain, resume or move is addressed to one replica
        (``qos.ctl.<worker>``), so a publisher there cannot empty a group."""
        await self._on_control(msg, allowed=GROUP_ACTIONS)

    async def _on_abort(self, msg: Msg) -> None:
        """The group's abort subject: aborts, nothing else (no caps either: the right to
        abort, which gateways and NATS callers have, is not a say over the group)."""
        await self._on_control(msg, allowed=ABORT_ONLY)

    async def _on_control(self, msg: Msg, allowed: frozenset[str] | None = None) -> None:
        try:
            control = Control.from_bytes(msg.data, self._max_payload)
        except ProtocolError as exc:
            log.warning("bad control message on %s: %s", msg.subject, exc.message)
            return
        action = control.action
        if allowed is not None and action not in allowed:
            log.warning("control %r refused on %s: it is sent to one replica's own subject",
                        action, msg.subject)  # fmt: skip
            return
        age_s = time.time() - control.issued_ms / 1000
        fence = control.fence if action in SCHEDULER_ACTIONS else None
        if fence is not None and self._fences.stale(fence, control.issued_ms):
            # A deposed leader's command, sent late: a later leader has spoken since.
            log.warning("control %r from an earlier scheduler term ignored (fence %d < %d; %s)",
                        action, fence, self._fences.fence, control.reason or "no reason")  # fmt: skip
            return
        if action in SCHEDULER_ACTIONS and control.issued_ms and age_s > CONTROL_STALE_S:
            # A deposed leader's publishes, queued while it was cut off and sent when it got
            # back: a move or a cap the leader of today never decided. (Its caps are renewed
            # every few seconds, its moves re-planned: nothing current is lost.)
            log.warning("control %r issued %.0f s ago ignored (%s)", action, age_s,
                        control.reason or "no reason")  # fmt: skip
            return
        if action == "abort" and control.request_id:
            self._aborted.add(control.request_id)
            st = self._inflight.get(control.request_id)
            if st is not None and self.bridge is not None:
                deadline = st.request.deadline_ms
                if st.error is None and deadline is not None and time.time() * 1000 >= deadline:
                    # The gateway answered 504 before this replica's own deadline check
                    # ran: the request failed by its deadline, it was not cancelled.
                    st.error = DeadlineExceededError(
                        "the request's deadline passed while generating"
                    )
                self._abort_in_engine(st)
        elif action == "supersede" and control.request_id and control.attempt:
            if control.worker is not None:
                self._stop_second_run(
                    control.request_id, control.attempt, control.worker, control.stream_seq
                )
            else:
                self._supersede(control.request_id, control.attempt)
        elif action == "set_batch_cap" and self.bridge is not None:
            if control.group is not None and control.group != self.group:
                # For the group this replica just left (a reconcile sent before its move):
                # its new group's breaker is another matter.
                log.info("batch cap for group %s ignored: serving %s", control.group, self.group)
                return
            group_max = self.config.groups[self.group].max_batch
            before = self.bridge.batch_cap
            cap = self.bridge.set_batch_cap(min(control.batch_cap or group_max, group_max))
            self._cap_set_at = time.monotonic() if cap < group_max else None
            if cap != before:  # renewals of the same cap come every few seconds
                log.info("batch cap set to %d (%s)", cap, control.reason or "control")
            self._poke()
        elif action == "drain":
            log.info("draining (%s)", control.reason or "control")
            self._drained = True  # until a resume: a move does not undo it
            self._set_serving(False)
        elif action == "resume" and not self._stopped:
            if self._intake is None:  # a move that failed to bind: nothing would fetch
                log.warning(
                    "resume ignored: not bound to group %s (see the move's error)", self.group
                )
            elif self._switch_lock.locked():  # mid-move: the intake is halted, the move resumes
                # Undrained now, so the move's end turns serving back on (it kept a drain
                # given before it, and a resume sent meanwhile was lost: it served nothing).
                self._drained = False
                log.info("resume during a move between groups: it serves once moved")
            else:
                self._drained = False
                self._set_serving(True)
        elif action == "assign_group" and control.group:
            self._spawn(self.assign_group(control.group, control.batch_cap), "assign-group")

    def _retire(self, st: Flight, outcome: str) -> None:
        """Stop ``st`` here unanswered (another flight of its id, here or elsewhere, goes
        on): out of the books, its engine request aborted, its span ended."""
        self._forget(st)
        self._abort_in_engine(st)
        self.observer.abandoned(st, outcome)

    def _forget(self, st: Flight) -> None:
        """Take ``st`` out of the books: only ``st`` itself, never a later flight of its id
        (a stale flight's end would evict the live one, its request running for nobody)."""
        rid = st.request.id
        if self._inflight.get(rid) is st:
            del self._inflight[rid]
            if self._superseded.get(rid, 0) <= max(st.attempt, st.delivered):
                # Its supersede is spent: the delivery it named (or a later one) has ended
                # here; kept, it would drop a later request reusing the id as attempt 1.
                self._superseded.pop(rid, None)
        if self._coalescing.get(rid) is st:
            del self._coalescing[rid]

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` as a task of its own, held in ``_tasks`` (stopped with the service;
        nobody else would read it: its failure is logged as it ends). Finished ones leave
        the list (any publisher on our control subject adds one)."""
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(_log_failure)
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(task)

    def _abort_in_engine(self, st: Flight) -> None:
        """Stop ``st``'s engine request (its own, not a later flight's of the same id)."""
        if self.bridge is not None and st.engine_id:
            st.abort_at = time.monotonic()
            self.bridge.abort(st.engine_id)

    def _caller_closed(self, st: Flight) -> None:
        """A resync found the caller finished with a request still running here (it was
        cancelled while this replica was cut off, and the abort never came): abort it."""
        if self._inflight.get(st.request.id) is not st:
            return  # finished here meanwhile, or another delivery's
        log.info(
            "request %s: its caller closed it while we were cut off; aborting",
            st.request.id,
            extra=about_flight(st),
        )
        self._aborted.add(st.request.id)
        self._abort_in_engine(st)

    def _stop_second_run(
        self, request_id: str, attempt: int, worker: str, followed_seq: int | None
    ) -> None:
        """The caller follows another worker's run of the request, and this run (delivery
        ``attempt`` here) is a second one: it stops without a word. A message other than the
        followed one (``followed_seq``: the request published twice under one id) is
        terminated, never to come back; the followed message itself (a group consumer made
        again delivered it afresh), neither acked nor nak'd, comes back after ack_wait as a
        later delivery, whose resume query hears "closed" if the followed run has answered
        and resumes the request if it died."""
        st = self._inflight.get(request_id)
        if worker != self.worker_id or st is None or st.attempt != attempt:
            return
        duplicate = followed_seq is not None and _stream_seq(st.msg) not in (None, followed_seq)
        log.info("request %s: its caller follows another worker's run; stopping ours "
                 "(delivery %d%s)", request_id, attempt,
                 ", a duplicate message: terminated" if duplicate else "",
                 extra=about_flight(st))  # fmt: skip
        self._retire(st, "superseded")
        if duplicate:
            self._spawn(settle(st.msg.term), "term-duplicate")
        self._poke()

    def _supersede(self, request_id: str, attempt: int) -> None:
        """Delivery ``attempt`` of the request resumed it on another replica, and its caller
        follows that one now: a copy here from an earlier delivery only took a batch slot
        and, finishing first, would ack the message under the replica that serves it (which
        dying then would lose the request). Stop it without a word: no ack, no nak, no
        chunk (the caller ignores this attempt's), no abort mark (the request lives on)."""
        superseded = self._superseded
        superseded[request_id] = max(attempt, superseded.pop(request_id, 0))  # newest last
        while len(superseded) > MAX_SUPERSEDED:
            del superseded[next(iter(superseded))]
        st = self._inflight.get(request_id)
        if st is None or max(st.attempt, st.delivered) >= attempt:
            return  # not here (an admission still under way checks the memo), or ours
        log.info("request %s: delivery %d resumed it elsewhere; stopping ours (delivery %d)",
                 request_id, attempt, max(st.attempt, st.delivered), extra=about_flight(st))  # fmt: skip
        self._retire(st, "superseded")
        self._poke()

    async def assign_group(self, group: str, batch_cap: int | None = None) -> None:
        """Drain, then move this replica to ``group``'s consumer (its batch limit too, or
        ``batch_cap`` below it: the group's breaker degrades it)."""
        if group not in self.config.groups:
            log.warning("assign_group: unknown group %r ignored", group)
            return
        async with self._switch_lock:
            if self._stopped or self.exit_code:  # exiting: bound to nothing, serving nothing
                return
            if group != self.group:
                self._set_serving(False)
                if self._intake is not None:
                    await self._intake.halt()
                # Still subscribed to the old group's control: aborts keep reaching us.
                await self._wait_idle(self.options.grace_s)
                if self._stopped:  # stopped while the old group's requests finished
                    return
                # Before the first report under the new name, which the telemetry loop may
                # send while binding (retries back off for seconds): a long document's 20 s
                # p99 arriving as short's opened short's breaker, the group sent help.
                self.telemetry.reset_latency()
                await self._unbind()
                old = self.group
                if not await self._bind_retrying(group):
                    # Back where it was, rather than serving nothing while saying it serves.
                    if not await self._bind_retrying(old):
                        # Drained and bound to nothing, it would neither serve nor exit:
                        # its supervisor restarts it, and the start binds again.
                        self._cannot_serve(f"bound to no group, neither {group} nor {old}")
                        return
                    group = old
                self._apply_group_limits(group)
                self._cap_set_at = None
                if group != old:
                    limit = self.config.groups[group].max_batch
                    if batch_cap is not None and batch_cap < limit and self.bridge is not None:
                        self.bridge.set_batch_cap(batch_cap)  # lapses unless renewed, as any
                        self._cap_set_at = time.monotonic()
                log.info("moved from group %s to %s", old, group)
            # A drained replica stays drained, moved or not (an operator's drain was undone
            # by the scheduler's next move, or at once by one naming its own group).
            self._set_serving(not self._drained)

    def _apply_group_limits(self, group: str) -> None:
        """The group's batch size, sequence length, priority preemption and aging and
        prefill delay, within what the engine was built for (``build_engine`` sizes it for every group, so
        a moved replica serves its new group's requests, not its first group's limits)."""
        assert self.bridge is not None
        limits = self.config.groups[group]
        batch = self.bridge.set_batch_cap(limits.max_batch)
        seq = self.bridge.set_seq_limit(limits.max_seq_len)
        # Per group too (the engine's policy is its build's): a replica moved into a group
        # served by its own settings, not its first group's.
        self.bridge.set_group_scheduling(
            limits.priority_preemption, limits.prefill_delay_factor, limits.priority_aging_s
        )
        if batch < limits.max_batch or seq < limits.max_seq_len:
            log.info("group %s asks batch %d, %d tokens; this engine serves %d, %d",
                     group, limits.max_batch, limits.max_seq_len, batch, seq)  # fmt: skip

    async def _bind_retrying(self, group: str, attempts: int = 4) -> bool:
        """Bind to ``group``, retrying a failure (a NATS hiccup, a JetStream leader
        election) with backoff; False, logged, when it never succeeds."""
        delay = 0.25
        for attempt in range(1, attempts + 1):
            if self._stopped:
                return False
            self.group = group
            try:
                # No minute's wait for a consumer this user may not create (the secure
                # permissions): the retries are the wait, and the replica is drained and
                # holds the switch meanwhile.
                await self._bind(group, wait_s=0)
                return True
            except Exception as exc:
                await self._unbind()  # whatever half of it was made
                log.warning("binding to group %s failed (attempt %d of %d): %r",
                            group, attempt, attempts, exc)  # fmt: skip
                if attempt < attempts and not self._stopped:
                    await asyncio.sleep(delay)
                    delay *= 2
        return False

    async def set_slowdown(self, seconds: float) -> bool:
        """Add ``seconds`` to every engine step (SimEngine only), to provoke SLO breaches."""
        if self.bridge is None or not hasattr(self.engine, "set_slowdown"):
            return False
        await self.bridge.call(lambda engine: engine.set_slowdown(seconds))
        return True

    # --- for tests and the CLI ------------------------------------------------------------

    @property
    def inflight_ids(self) -> list[str]:
        return list(self._inflight)


def _log_failure(task: asyncio.Task[None]) -> None:
    """A control task's exception, logged as it ends (its result is never awaited)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s failed", task.get_name(), exc_info=exc)


def _caller_error(info: ErrorInfo) -> bool:
    """An error the request itself caused (a 4xx: bad parameters, a prompt over the limit),
    not the group: counted as the group's failures, a client sending bad requests opened
    its breaker, and one invalid answer among half-open probes re-opened it."""
    return error_from_code(info.code, info.message).http_status < 500
