"""SchedulerService: telemetry in, breaker and rebalancing decisions out, over NATS.

- Subscribes to ``<prefix>.tel.>`` and keeps per-group windows (:mod:`scheduler.windows`).
- Every ``scheduler.tick_interval_s`` (0.5 s): reads each group's queue depth from its
  JetStream consumer (``num_pending + num_ack_pending``), turns the reports since the last
  tick into one sample per group, feeds the breakers (:mod:`scheduler.breaker`) and acts on
  each transition at once: ``breaker.<group>`` in the state bucket (gateways divert on
  it), ``set_batch_cap`` on ``<prefix>.ctl.group.<group>`` (``open_batch_cap`` when it
  opens, ``max_batch`` when it closes), an alert (:mod:`scheduler.alerts`, sent once the
  record is stored: one never stored never took effect) and metrics.
  A worker whose reported cap disagrees with its group's breaker (it restarted, or moved
  into the group) gets ``set_batch_cap`` on ``<prefix>.ctl.<worker>``.
- Every ``scheduler.rebalance_interval_s`` (5 s): the rebalancer (:mod:`scheduler.rebalancer`)
  sets desired replicas (``desired.<group>``, ``qos_desired_replicas``) and may move an idle
  replica with ``assign_group`` on ``<prefix>.ctl.<worker>``, done once the replica reports
  serving in its new group (a move not seen done in time counts failed,
  :mod:`scheduler.moves`);
  the hour-of-week history (:mod:`scheduler.history`) learns the demand.
- Only the holder of the lease (:mod:`scheduler.lease`) acts; a standby keeps its windows
  warm and its breakers in step with the bucket, and taking over it fills each closed
  breaker's window from its group's samples, so it takes over where the leader stood.
  Once synced, a new leader sends every group its breaker's cap (``set_batch_cap``), which
  stamps its fence on every worker: a deposed leader's order sent late is dropped then.
  A scheduler that starts continues each breaker from ``breaker.<group>``. Nothing is
  deleted on exit: with no scheduler, workers keep their last batch cap and gateways the
  last breaker state, until an open or half-open one goes unrenewed (the leader rewrites
  it every ``BREAKER_RENEW_S``) long enough that they read it as closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

import common.nats as qnats
from common.config import Config
from common.errors import ProtocolError
from common.liveness import LoopBeat
from common.protocol import Control
from common.subjects import Subjects, read_telemetry
from common.tasks import cancel_and_wait
from scheduler.alerts import Alerter, QueuedAlert
from scheduler.breaker import (
    LEGAL,
    Breaker,
    BreakerSample,
    BreakerSettings,
    State,
    Transition,
)
from scheduler.heartbeat_sweep import STALE_AFTER_S, SWEEP_EVERY_S, sweep_heartbeats
from scheduler.history import KEY_PREFIX as HISTORY_PREFIX
from scheduler.history import DemandHistory
from scheduler.lease import Lease
from scheduler.metrics import SchedulerMetrics
from scheduler.moves import MOVE_DRAIN_S, PendingMove, PendingMoves, after_failure
from scheduler.rebalancer import (
    GroupView,
    Move,
    RebalancerState,
    RebalanceSettings,
    ReplicaView,
    decide,
)
from scheduler.records import (
    BREAKER_RENEW_S,
    BREAKER_STALE_S,
    BreakerRecord,
    DesiredRecord,
    ServedRecord,
    breaker_key,
    desired_key,
    served_key,
)
from scheduler.windows import GroupSample, TelemetryWindows, backlog

log = logging.getLogger(__name__)

# A worker told its cap is not told again sooner: its next report may predate the order.
CAP_RESEND_S = 2.0
CAP_CLOSED_TRIES = 2  # times a closed group's cap is sent to a worker that stays at the open cap
HISTORY_SAVE_S = 60.0
QUEUE_POLL_TIMEOUT_S = 0.5
TERM_START_REASON = "a new scheduler term"  # the cap each group gets as a term begins
STALE_RECORD_REASON = "stale record"
RECENT_ACTIONS = 1000  # transitions and moves kept in memory


def default_scheduler_id() -> str:
    """``sched-<hostname>-<pid>-<random>``, a valid subject token."""
    raw = f"sched-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:128]


class SchedulerService:
    """One scheduler replica; :meth:`start`, then :meth:`run` (or :meth:`stop`)."""

    def __init__(
        self,
        config: Config,
        *,
        scheduler_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.cfg = config.scheduler
        self.id = scheduler_id or default_scheduler_id()
        self.groups = list(config.groups)
        self.subjects = Subjects(config.nats.subject_prefix)
        self._clock, self._wall = clock, wall
        self.breakers = {
            g: Breaker(
                g,
                BreakerSettings.for_group(
                    gc, self.cfg.window_s, stale_p99_s=config.worker.latency_window_s
                ),
                since=clock(),
            )
            for g, gc in config.groups.items()
        }
        self.windows = TelemetryWindows(
            self.groups,
            silent_s=self.cfg.worker_silent_s,
            window_samples=self.cfg.window_samples,
            window_s=self.cfg.window_s,
            moves_kept_s=max(3600.0, self.cfg.move_cooldown_s),
            min_interval_s=0.9 * config.worker.telemetry_interval_s,
        )
        self.metrics = SchedulerMetrics()
        for group in self.groups:  # at 0 from the start: increase() sees the first one
            for source, target in sorted(LEGAL):
                self.metrics.breaker_transitions.labels(group, source, target)
        self.alerter = Alerter(self.cfg.alert_webhook_url)
        self.rebalance_settings = RebalanceSettings(
            move_replicas=self.cfg.move_replicas,
            move_after_ticks=self.cfg.move_after_ticks,
            cooldown_s=self.cfg.move_cooldown_s,
            target_utilization=self.cfg.target_utilization,
            max_replicas=self.cfg.max_replicas,
        )
        self.rebalancer_state = RebalancerState()
        self._replica_current_s = 2 * config.worker.telemetry_interval_s
        # A moved replica drains, binds, then reports from its new group.
        self.pending_moves = PendingMoves(MOVE_DRAIN_S + 2 * config.worker.telemetry_interval_s)
        self.histories: dict[str, DemandHistory] = {g: DemandHistory() for g in self.groups}
        self.queue_depths: dict[str, int] = dict.fromkeys(self.groups, -1)
        self._closed_checked: dict[str, float] = {}  # group -> when its record was read back
        # Groups seen with a live replica, leader or standby, or by any scheduler before
        # (``served.<group>``; one that lost its last is refilled to its minimum; one never
        # served may be meant empty).
        self.served_groups: set[str] = set()
        self._served_saved: set[str] = set()  # those whose record is in the bucket
        self.desired: dict[str, int] = {}
        # As leader: the breakers are loaded from the bucket since this term began.
        self._leader_synced = False
        # As leader: every group was sent this term's fence (the term-start caps).
        self._term_announced = False
        # The latest transitions this replica acted on and moves it ordered (a flapping
        # breaker makes ~115k transitions a week): for tests and debugging.
        self.acted: deque[Transition] = deque(maxlen=RECENT_ACTIONS)
        self.moves: deque[Move] = deque(maxlen=RECENT_ACTIONS)
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.kv: KeyValue | None = None
        self.lease: Lease | None = None
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.beat = LoopBeat()  # /livez: this loop still runs
        self._cap_sent: dict[str, float] = {}  # worker -> when it was last told its cap
        # worker -> times told, while closed, to leave the open cap and not risen: one
        # started with --max-batch at the open cap stays there, and was told every 2 s.
        self._cap_unheeded: dict[str, int] = {}
        self._unsaved: dict[str, BreakerRecord] = {}  # breaker states the bucket lacks
        # group -> alerts waiting for its record to be stored: a transition whose record
        # never was (a failed write, then the lease lost) was undone by the reload.
        self._alerts: dict[str, list[QueuedAlert]] = {}
        # Alerts of records whose write failed as this replica's term ended: one may have
        # been stored all the same (its acknowledgement lost), which the next load tells.
        self._unconfirmed: dict[str, list[QueuedAlert]] = {}
        self._breaker_written: dict[str, float] = {}  # group -> when this replica last wrote it
        self._history_saved = 0.0
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self.exit_code = 0  # 1 when NATS closed the connection for good

    @property
    def is_leader(self) -> bool:
        return self.lease is not None and self.lease.valid()

    @property
    def acts(self) -> bool:
        """Leader, with this term's state loaded from the bucket (breakers, histories): until
        then a tick or a rebalance would act on, or save over, what the last leader left."""
        return self.is_leader and self._leader_synced

    # --- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, make sure the stream/consumers/bucket exist, load state, start the loops.

        ``/livez`` (and ``/metrics``) answer first, as the worker's do: served only once
        JetStream had answered (5 s a call while a NATS cluster elects its leader), the
        probe port was closed and Kubernetes' liveness killed a start that would succeed."""
        self.metrics.serve(self.cfg.metrics_port, self.beat, self.cfg.metrics_host)
        self._tasks = [asyncio.create_task(self.beat.run(), name="sched-beat")]
        try:
            await self._connect_and_load()
        except BaseException:
            await self._cancel_tasks()
            await self._close()
            raise
        self._tasks += [
            asyncio.create_task(
                self._every(self.cfg.tick_interval_s, self.tick), name="sched-tick"
            ),
            asyncio.create_task(
                self._every(self.cfg.lease_renew_s, self._refresh_lease), name="sched-lease"
            ),
            asyncio.create_task(
                self._every(self.cfg.rebalance_interval_s, self.rebalance), name="sched-rebalance"
            ),
            asyncio.create_task(
                self._every(SWEEP_EVERY_S, self.sweep_heartbeats), name="sched-heartbeats"
            ),
        ]
        log.info("scheduler %s started (groups %s)", self.id, ", ".join(self.groups))

    async def _connect_and_load(self) -> None:
        self.nc = await qnats.connect(
            self.config.nats, f"scheduler-{self.id}", service="scheduler",
            on_closed=self._nats_closed,
        )  # fmt: skip
        self.js = self.nc.jetstream()
        _, _, self.kv = await qnats.ensure_jetstream(self.js, self.config.nats, self.groups)
        self._sub = await self.nc.subscribe(self.subjects.telemetry_wildcard, cb=self._on_telemetry)
        await self._load_breakers()
        await self._load_served()
        await self._load_histories()
        self.lease = Lease(self.kv, self.id, self.cfg.lease_ttl_s)
        await self._refresh_lease()

    async def run(self) -> None:
        """Serve until :meth:`request_stop` (a signal), then stop."""
        await self._stop_requested.wait()
        await self.stop()

    def request_stop(self) -> None:
        self._stop_requested.set()

    def _nats_closed(self) -> None:
        """NATS gave up on us (not our own close): nothing acts any more while /metrics
        still answers the probes; exit 1 for a restart."""
        if self._stopped or self._stop_requested.is_set():
            return
        log.error("scheduler %s: NATS closed the connection for good; exiting", self.id)
        self.exit_code = 1
        self.request_stop()

    async def stop(self) -> None:
        """Stop acting, save the history, hand the lease over; the bucket's state stays."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        await self._cancel_tasks()
        if self.is_leader:
            with contextlib.suppress(Exception):
                await self._save_histories()
        if self.lease is not None:
            await self.lease.release()
        await self._close()
        log.info("scheduler %s stopped", self.id)

    async def crash(self) -> None:
        """Vanish without a word (tests): no release, no last writes; the lease goes stale."""
        self._stopped = True
        await self._cancel_tasks()
        await self._close()

    async def _cancel_tasks(self) -> None:
        await cancel_and_wait(self._tasks, what=f"scheduler {self.id} tasks")
        self._tasks = []

    async def _close(self) -> None:
        self.metrics.close()
        self.metrics.leader.set(0)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def _every(self, interval_s: float, step: Callable[[], Any]) -> None:
        """Run ``step`` every ``interval_s``; an error is logged and the loop goes on."""
        while True:
            started = self._clock()
            try:
                await step()
            except Exception:
                log.exception("scheduler %s: %s failed", self.id, getattr(step, "__name__", step))
            await asyncio.sleep(max(0.0, interval_s - (self._clock() - started)))

    # --- telemetry -----------------------------------------------------------------------

    async def _on_telemetry(self, msg: Msg) -> None:
        try:
            report = read_telemetry(
                msg.subject, msg.data, self.subjects, self.config.nats.max_payload_bytes
            )
        except ProtocolError as exc:
            log.warning("bad telemetry on %s: %s", msg.subject, exc.message)
            return
        self.windows.observe(report, self._clock())

    async def _poll_queue_depths(self) -> None:
        """``num_pending + num_ack_pending`` of each group's consumer; -1 when unknown."""
        assert self.js is not None
        js, stream = self.js, self.config.nats.stream

        async def depth(group: str) -> int:
            name = Subjects.consumer(group)
            info = await js.consumer_info(stream, name, timeout=QUEUE_POLL_TIMEOUT_S)
            return (info.num_pending or 0) + (info.num_ack_pending or 0)

        results = await asyncio.gather(*(depth(g) for g in self.groups), return_exceptions=True)
        for group, result in zip(self.groups, results, strict=True):
            self.queue_depths[group] = result if isinstance(result, int) else -1

    # --- the tick: breakers ----------------------------------------------------------------

    async def tick(self) -> None:
        """Sample the windows, feed the breakers, act on transitions (leader only)."""
        now = self._clock()
        for gone in self.windows.expire(now):
            log.info("worker %s (group %s) went silent", gone.worker, gone.group)
        # Workers that went silent or stopped (deploys, moves, exits) need no cap resent.
        for worker in self._cap_sent.keys() - self.windows.worker_ids():
            del self._cap_sent[worker]
            self._cap_unheeded.pop(worker, None)
        await self._poll_queue_depths()
        samples = self.windows.sample(now, self.queue_depths)
        self._export_groups(now)
        # Standbys too: one that takes over after a group's last replica died with the old
        # leader's node must know the group was served, or it never refills it.
        self.served_groups.update(g for g in self.groups if self.windows.replicas(g))
        if not self.acts:
            return
        for group, breaker in self.breakers.items():
            if not self.acts:
                # The lease lapsed during this tick's JetStream calls: no breaker moves in
                # memory only (its record, caps and alert unsent), to be undone by a reload.
                break
            sample = samples.get(group)
            if sample is not None:
                transition = breaker.observe(self._breaker_sample(group, sample), now)
            else:
                transition = breaker.tick(now)
            if transition is not None:
                await self._act(transition)
            elif (
                breaker.state != "closed"
                and group not in self._unsaved
                and now - self._breaker_written.get(group, -1e9) >= BREAKER_RENEW_S
            ):
                # Renewed, so gateways (the record) and workers (the cap) can tell this
                # breaker from one a dead scheduler left.
                record = self._record(group, breaker.state, breaker.since, breaker.reason)
                self._unsaved[group] = record
                await self._publish(
                    self.subjects.control_group(group),
                    Control(
                        action="set_batch_cap",
                        issued_ms=int(self._wall() * 1000),
                        group=group,
                        batch_cap=record.batch_cap,
                        reason=f"breaker {breaker.state} (renewed)",
                    ),
                )
        await self._heal_closed_records(now)
        if self._unsaved:
            await self._save_breakers()
        await self._reconcile_caps(now)

    async def _heal_closed_records(self, now: float) -> None:
        """Every ``BREAKER_RENEW_S``, a closed breaker's record is read back and rewritten
        if another leader's write stands there: a deposed leader's ``open``, queued while it
        was cut off and stored when it got back, would otherwise divert the group's traffic
        until it went stale (30 s), and a later leader would continue it."""
        assert self.kv is not None and self.lease is not None
        term = self.lease.term
        for group, breaker in self.breakers.items():
            if (
                breaker.state != "closed"
                or group in self._unsaved
                or now - self._closed_checked.get(group, -1e9) < BREAKER_RENEW_S
            ):
                continue
            self._closed_checked[group] = now
            try:
                entry = await self.kv.get(breaker_key(group))
            except nats.js.errors.KeyNotFoundError:
                continue  # missing reads as closed
            except Exception as exc:
                log.warning("breaker %s: reading the record back failed: %s", group, exc)
                continue
            if not (self.acts and self.lease.term == term and breaker.state == "closed"):
                # A new term began during the read (the lease's task): it dropped what was
                # queued and took the bucket's state up, an open breaker's included, so a
                # "closed" queued now would overwrite a live incident and resolve its alert.
                return
            if group in self._unsaved:
                continue
            record = BreakerRecord.from_bytes(entry.value)
            if record is not None and record.state != "closed":
                log.warning("breaker %s: the bucket says %s (scheduler %s, fence %d); "
                            "rewriting closed", group, record.state, record.scheduler or "?",
                            record.fence)  # fmt: skip
                closed = self._record(group, "closed", breaker.since, breaker.reason)
                self._unsaved[group] = closed
                # Whoever wrote it alerted its opening: this resolves it, once stored.
                age_ms = closed.written_ms - (record.written_ms or record.since_ms)
                why = (
                    STALE_RECORD_REASON
                    if age_ms > BREAKER_STALE_S * 1000
                    else f"record of scheduler {record.scheduler or '?'} (fence {record.fence})"
                )
                # Stamped now: the closed state's start (this breaker's) may be older than
                # the record it resolves, and a receiver ordering by time kept that open.
                self._alert(group, record.state, "closed", why, closed, closed.written_ms)

    def _breaker_sample(self, group: str, sample: GroupSample) -> BreakerSample:
        kind = self.config.groups[group].breaker.p99_kind
        p99 = sample.latency_ms if kind == "e2e" else sample.ttft_p99_ms
        return BreakerSample(
            p99_ms=p99,
            requests=sample.requests,
            errors=sample.errors,
            reported_at=sample.e2e_p99_at if kind == "e2e" else sample.ttft_p99_at,
        )

    def _cap_for(self, group: str, state: State) -> int:
        gc = self.config.groups[group]
        return gc.max_batch if state == "closed" else min(gc.breaker.open_batch_cap, gc.max_batch)

    async def _act(self, t: Transition) -> None:
        """Publish a transition: bucket first (gateways divert; its alert goes once it is
        stored), then workers."""
        assert self.nc is not None and self.kv is not None
        record = self._record(t.group, t.target, t.at, t.reason)
        cap = record.batch_cap
        self.acted.append(t)
        self.metrics.transition(t.group, t.source, t.target)
        self.metrics.set_breaker(t.group, t.target)
        self._unsaved[t.group] = record
        self._alert(t.group, t.source, t.target, t.reason, record)
        await self._save_breakers()
        if t.target in ("open", "closed"):  # half-open keeps the open cap while probing
            control = Control(
                action="set_batch_cap",
                issued_ms=int(self._wall() * 1000),
                group=t.group,
                batch_cap=cap,
                reason=f"breaker {t.target}: {t.reason}",
            )
            await self._publish(self.subjects.control_group(t.group), control)
            for report in self.windows.workers(t.group):
                self._cap_sent[report.worker] = self._clock()

    def _alert(
        self,
        group: str,
        source: State,
        target: State,
        reason: str,
        record: BreakerRecord,
        ts_ms: int | None = None,
    ) -> None:
        """Queue the alert of ``group``'s move to ``record``; sent once the record is stored.
        ``ts_ms``: when it happened (default: when the record's state began)."""
        event = {
            "group": group,
            "from": source,
            "to": target,
            "reason": reason,
            "fallback": self.config.groups[group].fallback,
            "batch_cap": record.batch_cap,
            "ts_ms": record.since_ms if ts_ms is None else ts_ms,
            "scheduler": self.id,
        }
        self._alerts.setdefault(group, []).append(QueuedAlert(record, event))

    def _drop_unsaved(self) -> None:
        """Forget the records not stored: the bucket's word counts now. Their alerts wait
        for the next load, which tells whether one was stored after all."""
        self._unsaved.clear()
        for group, queued in self._alerts.items():
            self._unconfirmed.setdefault(group, []).extend(queued)
        self._alerts.clear()

    def _confirm_alerts(self, group: str, record: BreakerRecord | None) -> None:
        """Send the alerts that led to ``record``, the one the bucket holds, if this replica
        wrote it (its write took effect though its acknowledgement was lost); drop the rest."""
        queued = self._unconfirmed.pop(group, [])
        stored = next(
            (i for i, a in enumerate(queued) if record is not None and a.record == record), None
        )
        if stored is None:
            return
        for alert in queued[: stored + 1]:
            self._send_alert(alert)

    def _send_alert(self, alert: QueuedAlert) -> None:
        """Send ``alert`` unless it went already: a write acknowledged after the lease went
        (or a new term began) sends it, and so does the load that confirms its record."""
        if not alert.sent:
            alert.sent = True
            self.alerter.breaker(alert.event)

    def _record(self, group: str, state: State, since: float, reason: str) -> BreakerRecord:
        """The bucket's record of ``group``'s breaker in ``state`` since ``since`` (our clock)."""
        since_ms = int((self._wall() - (self._clock() - since)) * 1000)
        fallback = self.config.groups[group].fallback
        wait_s = self.breakers[group].wait_s if state == "open" else None
        return BreakerRecord(
            state, since_ms, reason, fallback, self._cap_for(group, state), self.id,
            written_ms=int(self._wall() * 1000), fence=self._fence() or 0,
            probe_at_ms=since_ms + int(wait_s * 1000) if wait_s is not None else 0,
            reopens=self.breakers[group].reopens,
        )  # fmt: skip

    async def _save_breakers(self) -> None:
        """Write the breaker states not yet in the bucket (a failed write is retried)."""
        assert self.kv is not None
        for group, record in list(self._unsaved.items()):
            if not self.acts:
                return  # kept unsaved: a new term reloads the bucket and starts over
            events = list(self._alerts.get(group, ()))  # up to this record
            try:
                await self.kv.put(breaker_key(group), record.to_bytes())
            except Exception as exc:
                log.error("breaker %s: writing the state failed (retrying): %s", group, exc)
                continue
            self._breaker_written[group] = self._clock()
            # Stored, so it took effect: alerted even if the lease went meanwhile (which
            # dropped what was unsaved).
            if self._unsaved.get(group) is record:
                del self._unsaved[group]
            if left := self._alerts.pop(group, [])[len(events) :]:
                self._alerts[group] = left  # a later record's
            for alert in events:
                self._send_alert(alert)

    async def _reconcile_caps(self, now: float) -> None:
        """Tell a worker whose cap disagrees with its group's breaker (joined, restarted)."""
        for group, breaker in self.breakers.items():
            gc = self.config.groups[group]
            want = self._cap_for(group, breaker.state)
            open_cap = self._cap_for(group, "open")
            for report in self.windows.workers(group):
                if report.state not in ("serving", "draining"):
                    continue
                wrong = (
                    report.batch_cap > want
                    if breaker.state != "closed"
                    # Only undo our own cap: an engine may be built smaller than max_batch.
                    else report.batch_cap == open_cap < gc.max_batch
                )
                if not wrong:
                    self._cap_unheeded.pop(report.worker, None)
                    continue
                if now - self._cap_sent.get(report.worker, -1e9) < CAP_RESEND_S:
                    continue
                if breaker.state == "closed":
                    # Told once and resent once, and still at the open cap: the engine's
                    # own limit, not ours to undo.
                    tries = self._cap_unheeded.get(report.worker, 0)
                    if tries >= CAP_CLOSED_TRIES:
                        continue
                    self._cap_unheeded[report.worker] = tries + 1
                self._cap_sent[report.worker] = now
                control = Control(
                    action="set_batch_cap",
                    issued_ms=int(self._wall() * 1000),
                    group=group,
                    batch_cap=want,
                    reason=f"breaker {breaker.state}",
                )
                await self._publish(self.subjects.control(report.worker), control)

    # --- rebalancing ---------------------------------------------------------------------

    async def rebalance(self) -> None:
        """Desired replicas per group, at most one move, the history (leader only)."""
        if not self.acts:
            return
        now, epoch = self._clock(), self._wall()
        self._settle_moves(now)
        # Also those of moves first reported after this term began (the old leader ordered
        # them late in its term): taken up at the term's start only, they had none.
        cooldown = dict(self.rebalancer_state.cooldown_until)
        for key, until in self._seen_move_cooldowns(now).items():
            cooldown[key] = max(cooldown.get(key, 0.0), until)
        self.rebalancer_state = replace(self.rebalancer_state, cooldown_until=cooldown)
        await self._load_served()
        views = []
        for group, gc in self.config.groups.items():
            stats = self.windows.stats(group, now, self.queue_depths[group])
            reports = list(self.windows.workers(group))
            # A replica that missed its last report may be dead (it is forgotten only after
            # worker_silent_s): counting it could move the group's last live one away.
            current = self.windows.reported_within(group, now, self._replica_current_s)
            held = sum(r.running + r.waiting for r in reports)
            depth_known = self.queue_depths[group] >= 0
            waiting = backlog(self.queue_depths[group], held)
            if depth_known:  # an unknown depth reads as no backlog: no lesson for the history
                self.histories[group].observe(held + waiting, epoch, self.cfg.history_alpha)
            kind = gc.breaker.p99_kind
            replicas = tuple(
                ReplicaView(
                    r.worker,
                    r.running,
                    r.waiting,
                    r.state == "serving" and r.worker in current,
                    r.engine_max_seq_len or 0,
                )
                for r in reports
            )
            serves = [
                r.max_seq_len or gc.max_seq_len
                for r, v in zip(reports, replicas, strict=True)
                if v.serving
            ]
            views.append(
                GroupView(
                    name=group,
                    replicas=replicas,
                    backlog=waiting,
                    concurrency=stats.concurrency,  # the window's mean: a burst is not a trend
                    p99_ms=stats.e2e_p99_ms if kind == "e2e" else stats.ttft_p99_ms,
                    slo_ms=gc.slo_e2e_p99_ms if kind == "e2e" else gc.slo_ttft_ms,
                    max_batch=gc.max_batch,
                    min_replicas=self.cfg.min_replicas.get(group, self.cfg.default_min_replicas),
                    forecast=self.histories[group].forecast(epoch),
                    breaker=self.breakers[group].state,
                    seq_need=min([gc.max_seq_len, *serves]) if serves else 0,
                    rank=gc.rank,
                    depth_known=depth_known,
                    was_served=group in self.served_groups,
                )
            )
            if views[-1].serving:
                self.served_groups.add(group)
        await self._save_served()
        decision = decide(views, self.rebalancer_state, self.rebalance_settings, now)
        self.rebalancer_state = decision.state
        for view in views:
            await self._publish_desired(view, decision.desired[view.name], decision.why[view.name])
        for move in decision.moves:
            await self._order_move(move)
        if now - self._history_saved >= HISTORY_SAVE_S:
            await self._save_histories()

    async def _publish_desired(self, view: GroupView, replicas: int, why: str) -> None:
        assert self.kv is not None
        self.metrics.desired_replicas.labels(view.name).set(replicas)
        if self.desired.get(view.name) == replicas or not self.acts:
            return
        self.desired[view.name] = replicas
        record = DesiredRecord(replicas, view.serving, why, int(self._wall() * 1000))
        try:
            await self.kv.put(desired_key(view.name), record.to_bytes())
        except Exception as exc:
            self.desired.pop(view.name, None)  # try again next round
            log.warning("desired.%s: write failed: %s", view.name, exc)
            return
        log.info("desired replicas %s: %d (%s; now %d)", view.name, replicas, why, view.serving)

    async def _order_move(self, move: Move) -> None:
        # Leading may have lapsed during the desired.* writes: _publish refuses then, and the
        # refusal lifts the cooldowns the decision set (a bare return kept them a minute).
        control = Control(
            action="assign_group",
            issued_ms=int(self._wall() * 1000),
            group=move.dst,
            # The destination's breaker cap, so the replica does not run its first batch
            # there at full size while the group is degraded.
            batch_cap=self._cap_for(move.dst, self.breakers[move.dst].state),
            reason=f"rebalance: {move.reason}",
        )
        until = self.rebalancer_state.cooldown_until.get(f"worker:{move.worker}", 0.0)
        if not await self._publish(self.subjects.control(move.worker), control):
            # Not sent: nothing moves, so neither group is held by the cooldowns it set.
            failed = PendingMove(move, self._clock(), until)
            self.rebalancer_state = after_failure(self.rebalancer_state, failed, self._clock(), 0.0)
            return
        self.moves.append(move)
        # Counted as moved once a report shows it serving in ``dst`` (see scheduler.moves).
        self.pending_moves.ordered(move, self._clock(), until)
        log.info("moving worker %s from %s to %s: %s", move.worker, move.src, move.dst, move.reason)

    def _settle_moves(self, now: float) -> None:
        """Count the moves reports show done; a move not done by its deadline (and whose
        replica is not still draining in its source group) is counted failed, and the next
        decision may take another replica from the same groups."""
        reports = {r.worker: (r.group, r.state) for r in self.windows.workers()}
        done, failed = self.pending_moves.settle(reports, now)
        for pending in done:
            self.metrics.moves.labels(pending.move.src, pending.move.dst).inc()
        for pending in failed:
            move = pending.move
            self.metrics.moves_failed.labels(move.src, move.dst).inc()
            self.rebalancer_state = after_failure(
                self.rebalancer_state, pending, now, self.rebalance_settings.cooldown_s
            )
            log.warning("worker %s did not move from %s to %s within %.0f s: another replica "
                        "may go instead", move.worker, move.src, move.dst,
                        self.pending_moves.deadline_s)  # fmt: skip

    def _seen_move_cooldowns(self, now: float) -> dict[str, float]:
        """The cooldowns of the moves seen in the workers' reports, whoever ordered them,
        once done (the replica serves in its new group). One still binding may fail and
        come back, and the failure lifts only its order's cooldowns (moves.after_failure):
        taken up meanwhile, later than those, they held both groups for a full cooldown."""
        cooldown_s = self.rebalance_settings.cooldown_s
        cooldown: dict[str, float] = {}
        for at, worker, src, dst in self.windows.recent_moves(now, cooldown_s):
            if not self.windows.serving_in(worker, dst):
                continue
            for key in (f"worker:{worker}", f"group:{src}", f"group:{dst}"):
                cooldown[key] = max(cooldown.get(key, 0.0), at + cooldown_s)
        return cooldown

    # --- state in the bucket ---------------------------------------------------------------

    async def _refresh_lease(self) -> None:
        assert self.lease is not None
        was, term = self.lease.held, self.lease.term
        held = await self.lease.refresh()
        # First: the loads below fail while the bucket is unreachable, and a gauge left at 1
        # showed two leaders (autoscalers and operators read it).
        self.metrics.leader.set(1 if held else 0)
        if held and (not was or self.lease.term != term):
            # A new term (taken, or renewed over another replica's term that this one's slow
            # calls never saw): nothing from an earlier one counts, and the breakers continue from
            # where the previous leader left them. Its cooldowns lived in its memory: those
            # of the moves this standby saw in the workers' reports are taken up again, so a
            # failover cannot bounce a moved replica straight back.
            seen = self._seen_move_cooldowns(self._clock())
            self.rebalancer_state = RebalancerState(cooldown_until=seen)
            self.pending_moves.clear()
            self.desired.clear()
            self._breaker_written.clear()
            # Records of the earlier term, written now, would overwrite a newer leader's.
            self._drop_unsaved()
            self._history_saved = self._clock()  # a history is saved only once it is loaded
            self._leader_synced = self._term_announced = False
        if held:
            if not self._leader_synced and not await self._sync_term():
                return
            if not self._term_announced:
                await self._announce_term()
        else:
            self._drop_unsaved()  # the leader's word counts now, not ours
            # Only the leader's figure may reach autoscalers (they take the max over replicas).
            self.metrics.desired_replicas.clear()
            await self._load_breakers()  # a standby follows the leader's decisions

    async def _sync_term(self) -> bool:
        """A new term's loads from the bucket; whether the term is still this replica's
        when they end. A failure (a JetStream timeout) raises, and the next refresh retries.
        The histories too: a standby learns no demand, and its first save would overwrite
        the bucket's.

        The loads run side by side and the lease is renewed while they do: one after another
        with no renewal, on a bucket slow enough that they outlasted the lease's TTL, the
        standby took it, started the same sync, lost it back the same way, and neither
        replica ever acted."""
        assert self.lease is not None
        term = self.lease.term
        loads = asyncio.gather(
            self._load_breakers(), self._load_served(), self._load_histories(),
            return_exceptions=True,  # each ends before one's failure is raised: none left behind
        )  # fmt: skip
        try:
            while not loads.done():
                await asyncio.wait({loads}, timeout=self.cfg.lease_renew_s)
                if not loads.done() and (not await self.lease.refresh() or self.lease.term != term):
                    return False  # lost meanwhile: the loads are cancelled below
            for result in loads.result():
                if isinstance(result, BaseException):
                    raise result
        finally:
            if not loads.done():
                loads.cancel()
                await asyncio.gather(loads, return_exceptions=True)
        if not (self.lease.held and self.lease.term == term):
            return False
        self._recall_breaker_windows()
        self._leader_synced = True
        return True

    async def _load_breakers(self) -> None:
        """Each breaker continues from ``breaker.<group>`` (missing = closed)."""
        assert self.kv is not None
        now, wall_ms = self._clock(), self._wall() * 1000
        for group, breaker in self.breakers.items():
            try:
                entry = await self.kv.get(breaker_key(group))
                record = BreakerRecord.from_bytes(entry.value)
            except nats.js.errors.KeyNotFoundError:
                record = None
            self._confirm_alerts(group, record)
            written_ms = record.written_ms or record.since_ms if record is not None else 0
            if (
                record is not None
                and record.state != "closed"
                and (wall_ms - written_ms > BREAKER_STALE_S * 1000)
            ):
                # No scheduler renewed it (all were down): gateways and workers have read
                # it as closed since; reviving it would divert a group serving normally.
                log.info("breaker %s: its %s record is %.0f s old, read as closed", group,
                         record.state, (wall_ms - written_ms) / 1000)  # fmt: skip
                record = None
            if record is None:
                if breaker.state != "closed":
                    breaker.restore("closed", now)
            else:
                since = breaker.since
                if record.state != breaker.state or record.reason != breaker.reason:
                    since = now - max(0.0, wall_ms - record.since_ms) / 1000
                if record.state != breaker.state:
                    log.info("breaker %s: continuing %s (%s)", group, record.state, record.reason)
                breaker.restore(record.state, since, record.reason, record.reopens)
            self.metrics.set_breaker(group, breaker.state)

    async def _announce_term(self) -> None:
        """Send every group its breaker's cap, stamped with this term's fence: a worker
        learns a new leader only from a command, and one that heard none would still take
        a deposed leader's move sent late (under ``CONTROL_STALE_S`` old), emptying a group.
        The cap is the one the breaker holds the group to anyway: no worker changes."""
        sent = True
        for group, breaker in self.breakers.items():
            control = Control(
                action="set_batch_cap",
                issued_ms=int(self._wall() * 1000),
                group=group,
                batch_cap=self._cap_for(group, breaker.state),
                reason=TERM_START_REASON,
            )
            sent = await self._publish(self.subjects.control_group(group), control) and sent
            for report in self.windows.workers(group):
                self._cap_sent[report.worker] = self._clock()
        self._term_announced = sent  # else again at the next refresh

    def _recall_breaker_windows(self) -> None:
        """A standby feeds no breaker (it would judge what it cannot act on): taking over,
        each closed one gets the samples its group's window holds, so a group the old
        leader was about to open does not start again from an empty window."""
        now = self._clock()
        for group, breaker in self.breakers.items():
            samples = self.windows.windows[group].items(now)
            breaker.recall(((s.at, self._breaker_sample(group, s)) for s in samples), now)

    async def _load_served(self) -> None:
        """The groups a scheduler saw served (``served.<group>``, this one's or another's)
        and those live now: rebuilt each time, so a key an operator deleted (a group meant
        to stay empty) is forgotten by every scheduler, not only by one restarted."""
        assert self.kv is not None
        present: set[str] = set()
        for group in self.groups:
            try:
                await self.kv.get(served_key(group))
                present.add(group)
            except nats.js.errors.KeyNotFoundError:
                pass
            except Exception as exc:  # unread: as it was
                log.warning("served.%s: reading it failed: %s", group, exc)
                if group in self._served_saved:
                    present.add(group)
        live = {g for g in self.groups if self.windows.replicas(g)}
        self.served_groups = present | live
        self._served_saved = present

    async def _save_served(self) -> None:
        """Leader only: a group seen served for the first time is recorded for good."""
        assert self.kv is not None
        for group in sorted(self.served_groups - self._served_saved):
            if not self.acts:
                return
            record = ServedRecord(int(self._wall() * 1000), self.id)
            try:
                await self.kv.put(served_key(group), record.to_bytes())
            except Exception as exc:
                log.warning("served.%s: write failed (retrying): %s", group, exc)
                continue
            self._served_saved.add(group)

    async def _load_histories(self) -> None:
        assert self.kv is not None
        for group in self.groups:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = await self.kv.get(HISTORY_PREFIX + group)
                self.histories[group] = DemandHistory.from_bytes(entry.value or b"")

    async def _save_histories(self) -> None:
        assert self.kv is not None
        self._history_saved = self._clock()
        for group, history in self.histories.items():
            if not self.acts:
                return
            await self.kv.put(HISTORY_PREFIX + group, history.to_bytes())

    async def sweep_heartbeats(self) -> None:
        """Leader only: heartbeat keys of workers long gone leave the bucket."""
        if self.acts and self.js is not None and self.kv is not None:
            await sweep_heartbeats(
                self.js, self.kv, self.config.nats.kv_bucket, STALE_AFTER_S, self._wall() * 1000
            )

    # --- helpers -------------------------------------------------------------------------

    def _fence(self) -> int | None:
        """This term's fencing token (None before a term: nothing is sent then)."""
        return self.lease.fence if self.lease is not None and self.lease.fence else None

    async def _publish(self, subject: str, control: Control) -> bool:
        """Send a control, only while this replica leads: a tick or a rebalance checks at its
        start, but its JetStream calls (5 s timeouts) can outlast the 3 s lease, and a
        standby that took over meanwhile must not have a second scheduler commanding.
        True when it went out."""
        assert self.nc is not None
        if not self.acts:
            log.info("not leading any more: %s on %s not sent", control.action, subject)
            return False
        control.fence = self._fence()
        try:
            await self.nc.publish(subject, control.to_bytes())
        except Exception as exc:
            log.warning("control on %s failed: %s", subject, exc)
            return False
        return True

    def _depth_known(self, group: str, now: float) -> bool:
        """Whether the group's queue depth is known: polled now, or the newest sample has
        one (a sample taken while the poll failed carries none: -1, which read as 0)."""
        if self.queue_depths[group] >= 0:
            return True
        samples = self.windows.windows[group].items(now)
        return bool(samples) and samples[-1].queue_depth >= 0

    def _export_groups(self, now: float) -> None:
        m = self.metrics
        for group in self.groups:
            stats = self.windows.stats(group, now, self.queue_depths[group])
            m.group_replicas.labels(group).set(stats.replicas)
            # No samples, no p99; an unknown depth (the JetStream poll failed), no depth:
            # absent series read "no data" on the dashboard, where a 0 read perfect/empty.
            for kind, p99_ms in (("e2e", stats.e2e_p99_ms), ("ttft", stats.ttft_p99_ms)):
                if stats.samples:
                    m.group_p99.labels(group, kind).set(p99_ms / 1e3)
                else:
                    with contextlib.suppress(KeyError):
                        m.group_p99.remove(group, kind)
            if self._depth_known(group, now):
                m.queue_depth.labels(group).set(stats.queue_depth)
            else:
                with contextlib.suppress(KeyError):
                    m.queue_depth.remove(group)
            m.error_rate.labels(group).set(stats.error_rate)
