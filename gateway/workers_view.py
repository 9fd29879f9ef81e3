"""Which instance groups can take work now: live workers and breaker state.

**Live workers** come from telemetry (``<prefix>.tel.<group>.<worker>``, every second): a
worker is live while its latest report is at most ``live_window_s`` (3 s) old and says
``state == "serving"`` (``starting`` is not ready; ``draining`` takes no new work).

**Breakers** come from the JetStream KV bucket ``nats.kv_bucket`` (default ``qos_state``),
which the scheduler writes and this view watches:

- key ``breaker.<group>`` (``<group>`` as configured, e.g. ``breaker.short``);
- value: a JSON object or a msgpack map ``{"state": "closed" | "open" | "half_open", ...}``;
  other fields (reason, since, batch cap...) are ignored here;
- a missing, deleted or purged key, or a value that does not decode, reads as ``closed``,
  so a scheduler that is down never takes a group out of service by accident;
- so does an ``open`` or ``half_open`` value not written again for ``breaker_stale_s``
  (:data:`BREAKER_STALE_S`, 30 s): the leading scheduler rewrites those every 5 s
  (``scheduler.records.BREAKER_RENEW_S``), so one that stays unrenewed was left by a
  scheduler that died, and the group would otherwise stay diverted (or refused, with no
  fallback) until one came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Literal, cast

import msgpack
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from common.errors import ProtocolError
from common.fence import FenceGuard
from common.protocol import Telemetry
from common.subjects import Subjects, read_telemetry
from common.tasks import cancel_and_wait, watch

log = logging.getLogger(__name__)

BreakerState = Literal["closed", "open", "half_open"]
BREAKER_STATES: frozenset[str] = frozenset({"closed", "open", "half_open"})
BREAKER_KEY_PREFIX = "breaker."
LIVE_WINDOW_S = 3.0
# A worker silent this many live windows is forgotten (crashed: no last report), so the
# per-request liveness checks do not walk every worker ever seen.
FORGET_AFTER_WINDOWS = 20
BREAKER_STALE_S = 30.0


def record_ints(value: bytes | None, *names: str) -> tuple[int, ...]:
    """Integer fields of a ``breaker.<group>`` record, the JSON parsed once (``written_ms``:
    when the scheduler decided it; ``fence``: its term; ``probe_at_ms``: when an open
    breaker probes); 0 for each unsaid or unreadable."""
    try:
        obj: Any = json.loads(value or b"")
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return (0,) * len(names)
    out = []
    for name in names:
        try:
            out.append(int(obj.get(name, 0)))
        except (ValueError, TypeError):
            out.append(0)
    return tuple(out)


def decode_breaker(value: bytes | None) -> BreakerState:
    """A ``breaker.<group>`` value → its state; anything unreadable is ``closed``."""
    if not value:
        return "closed"
    try:
        obj: Any = json.loads(value) if value[:1] == b"{" else msgpack.unpackb(value, raw=False)
    except Exception:
        log.warning("undecodable breaker value %r; treating it as closed", value[:64])
        return "closed"
    state = obj.get("state") if isinstance(obj, dict) else None
    if state not in BREAKER_STATES:
        log.warning("breaker value without a known state: %r; treating it as closed", obj)
        return "closed"
    return cast(BreakerState, state)


class WorkersView:
    """Live worker counts per group and breaker states, fed by NATS, read by admission."""

    def __init__(
        self,
        groups: Iterable[str],
        *,
        live_window_s: float = LIVE_WINDOW_S,
        breaker_stale_s: float = BREAKER_STALE_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._groups = list(groups)
        self._window = live_window_s
        self._clock = clock
        self._wall = wall
        # group -> worker -> monotonic time of its latest "serving" report
        self._serving: dict[str, dict[str, float]] = {g: {} for g in self._groups}
        # group -> worker -> the longest sequence it says it serves (its report's max_seq_len)
        self._seq_lens: dict[str, dict[str, int]] = {g: {} for g in self._groups}
        self._pruned_at = clock()
        self._breakers: dict[str, BreakerState] = {}
        self._breaker_stale_s = breaker_stale_s
        self._breaker_at: dict[str, float] = {}  # group -> when its record was last written
        self._fences = FenceGuard()  # the scheduler's term, from its records' fences
        self._probe_at_ms: dict[str, int] = {}  # group -> when its open breaker probes
        self._stale_logged: set[str] = set()
        self._waiters: list[tuple[Collection[str], asyncio.Future[None]]] = []
        self._sub: Subscription | None = None
        self._subjects = Subjects()
        self._watch_task: asyncio.Task[None] | None = None

    # -- reading ---------------------------------------------------------------------------

    def live_workers(self, group: str) -> int:
        """Workers of ``group`` whose latest report is recent and says serving."""
        seen = self._serving.get(group)
        if not seen:
            return 0
        oldest = self._clock() - self._window
        return sum(1 for t in seen.values() if t >= oldest)

    def is_live(self, group: str) -> bool:
        seen = self._serving.get(group)
        if not seen:
            return False
        oldest = self._clock() - self._window
        return any(t >= oldest for t in seen.values())

    def seq_limit(self, group: str, configured: int) -> int:
        """The longest sequence (prompt + max_tokens) ``group`` can take: its configured
        ``max_seq_len``, or less when its live workers serve less (a model's context or a
        KV cache shorter than the group's limit): a request any of them would refuse must
        be refused here, before it queues."""
        seen, lens = self._serving.get(group), self._seq_lens.get(group)
        if not seen or not lens:
            return configured
        oldest = self._clock() - self._window
        served = [lens[w] for w, t in seen.items() if t >= oldest and w in lens]
        return min(configured, *served) if served else configured

    def live_counts(self) -> dict[str, int]:
        return {g: self.live_workers(g) for g in self._groups}

    def breaker(self, group: str) -> BreakerState:
        state = self._breakers.get(group, "closed")
        if state == "closed" or self._clock() - self._breaker_at[group] <= self._breaker_stale_s:
            return state
        if group not in self._stale_logged:
            self._stale_logged.add(group)
            log.warning(
                "breaker %s: %s but not renewed for %.0f s (no scheduler leads?); "
                "treating it as closed",
                group,
                state,
                self._breaker_stale_s,
            )
        return "closed"

    def opens_for_s(self, group: str) -> float | None:
        """How long ``group``'s open breaker stays open, by its record (None: not open, or
        the record does not say)."""
        probe_at_ms = self._probe_at_ms.get(group, 0)
        if self.breaker(group) != "open" or not probe_at_ms:
            return None
        return max(0.0, probe_at_ms / 1000 - self._wall())

    def breakers(self) -> dict[str, BreakerState]:
        return {g: self.breaker(g) for g in self._groups}

    async def wait_live(self, groups: Collection[str], timeout_s: float) -> bool:
        """Wait until a serving report arrives from any of ``groups``; False on timeout."""
        if any(self.is_live(g) for g in groups):
            return True
        if timeout_s <= 0:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (groups, waiter)
        self._waiters.append(entry)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(waiter)
        finally:
            self._waiters.remove(entry)
        return waiter.done()

    # -- feeding ---------------------------------------------------------------------------

    def on_telemetry(self, report: Telemetry) -> None:
        """Record one worker report (also used by tests that have no NATS)."""
        seen = self._serving.setdefault(report.group, {})
        lens = self._seq_lens.setdefault(report.group, {})
        if report.state != "serving":
            seen.pop(report.worker, None)
            lens.pop(report.worker, None)
            return
        now = seen[report.worker] = self._clock()
        if now - self._pruned_at > FORGET_AFTER_WINDOWS * self._window:
            self._forget_silent(now)
        if report.max_seq_len is not None:
            lens[report.worker] = report.max_seq_len
        else:  # a worker that does not say: the configured limit
            lens.pop(report.worker, None)
        for groups, waiter in self._waiters:
            if report.group in groups and not waiter.done():
                waiter.set_result(None)

    def _forget_silent(self, now: float) -> None:
        """Drop workers silent for many live windows: a crashed one says no last word, and
        every request's liveness check walked every worker ever seen."""
        self._pruned_at = now
        horizon = now - FORGET_AFTER_WINDOWS * self._window
        for group, seen in self._serving.items():
            for worker in [w for w, at in seen.items() if at < horizon]:
                del seen[worker]
                self._seq_lens.get(group, {}).pop(worker, None)

    def set_breaker(self, group: str, state: BreakerState, age_s: float = 0.0) -> None:
        """A record was written ``age_s`` ago (a change or a renewal)."""
        previous = self._breakers.get(group, "closed")
        self._breakers[group] = state
        self._breaker_at[group] = self._clock() - max(0.0, age_s)
        self._stale_logged.discard(group)
        if state != previous:
            log.info("breaker %s: %s -> %s", group, previous, state)

    def on_breaker_entry(
        self,
        key: str,
        value: bytes | None,
        operation: str | None,
        written: datetime.datetime | None = None,
    ) -> None:
        """Apply one KV update for ``breaker.<group>`` (DEL/PURGE = closed). ``written``: when
        the server stored it, so a record replayed at start-up, left by a scheduler that died
        long ago, is already stale rather than fresh from now."""
        if not key.startswith(BREAKER_KEY_PREFIX):
            return
        group = key[len(BREAKER_KEY_PREFIX) :]
        age_s = 0.0 if written is None else self._wall() - written.timestamp()
        deleted = operation in ("DEL", "PURGE")
        decided_ms, fence, probe_at_ms = (
            (0, 0, 0) if deleted else record_ints(value, "written_ms", "fence", "probe_at_ms")
        )
        if fence and self._fences.stale(fence, decided_ms):
            # A deposed leader's write, stored late: today's leader rewrites it shortly.
            log.warning("breaker %s: a record of an earlier scheduler term ignored", group)
            return
        if decided_ms:  # a replayed write is as old as its decision, whenever stored
            age_s = max(age_s, self._wall() - decided_ms / 1000)
        self._probe_at_ms[group] = probe_at_ms
        self.set_breaker(group, "closed" if deleted else decode_breaker(value), age_s)

    # -- NATS ------------------------------------------------------------------------------

    async def start(
        self,
        nc: Client,
        subjects: Subjects,
        kv: KeyValue | None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """Subscribe to telemetry and, given the bucket, watch ``breaker.*`` (``on_failure``:
        told if the watch dies)."""
        self._subjects = subjects
        self._sub = await nc.subscribe(subjects.telemetry_wildcard, cb=self._on_message)
        if kv is not None:
            self._watch_task = asyncio.create_task(self._watch(kv), name="gateway-breakers")
            if on_failure is not None:
                watch(self._watch_task, on_failure)

    async def stop(self) -> None:
        if self._watch_task is not None:
            await cancel_and_wait([self._watch_task], what="breaker watch")
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_message(self, msg: Msg) -> None:
        try:
            report = read_telemetry(msg.subject, msg.data, self._subjects)
        except ProtocolError as exc:
            log.warning("bad telemetry on %s: %s", msg.subject, exc.message)
            return
        self.on_telemetry(report)

    async def _watch(self, kv: KeyValue) -> None:
        # The watcher replays current values first, then follows updates; if it fails
        # (NATS restarted, stream recreated) start a new one rather than go blind.
        while True:
            try:
                watcher = await kv.watch(BREAKER_KEY_PREFIX + "*")
                async for entry in watcher:
                    if entry is not None:
                        self.on_breaker_entry(
                            entry.key, entry.value, entry.operation, entry.created
                        )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("breaker watch failed; retrying in 1 s", exc_info=True)
            await asyncio.sleep(1.0)
