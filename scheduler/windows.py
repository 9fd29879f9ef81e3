"""Telemetry → per-group samples and sliding windows (count- and time-bounded).

Workers report every ``worker.telemetry_interval_s`` on ``<prefix>.tel.<group>.<worker>``
with percentiles over their own recent requests and cumulative counters. Once per
scheduler tick, each group that reported since the previous tick gets one
:class:`GroupSample`:

- **p99** (E2E and TTFT): the highest p99 among its workers that have latency samples — an
  upper bound of the p99 of their union, and the one a user of the slow replica sees.
  p50: the samples-weighted mean of the workers' p50s.
- **stall**: a lower bound of the age of the oldest request still running, from reports
  alone: when a worker has had work running and finished nothing across reports spanning
  ``t`` seconds, some request has run at least ``t``. A worker so slow that nothing
  finishes within its own percentile window reports p99 = 0; the stall still shows it.
- **requests / errors**: finished since the previous sample (deltas of the counters; a
  counter that went backwards is a restarted worker, whose whole count is new).
- running, waiting, batch caps, KV usage, tokens/s, busy ratio, live serving replicas, and
  the queue depth the service read from the group's JetStream consumer.

A worker silent for ``worker_silent_s`` is gone; one that reports ``stopped`` goes at once.
:class:`SlidingWindow` keeps the last N samples of the last T seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from common.protocol import Telemetry

T = TypeVar("T")
# A replica back in its group this soon after leaving it had its bind fail (binding retries
# for a few seconds; a move is given up at 32 s): no move happened. A later return is a
# move of its own.
FAILED_BIND_S = 30.0


class SlidingWindow(Generic[T]):
    """The last ``max_items`` items added within the last ``horizon_s`` seconds."""

    def __init__(self, max_items: int, horizon_s: float) -> None:
        self._items: deque[tuple[float, T]] = deque(maxlen=max_items)
        self._horizon = horizon_s

    def add(self, at: float, item: T) -> None:
        self._items.append((at, item))

    def items(self, now: float) -> list[T]:
        cutoff = now - self._horizon
        while self._items and self._items[0][0] < cutoff:
            self._items.popleft()
        return [item for _, item in self._items]

    def latest(self) -> T | None:
        return self._items[-1][1] if self._items else None

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, slots=True)
class GroupSample:
    """One group at one tick (see the module docstring for how each figure is made)."""

    at: float
    replicas: int  # live workers reporting "serving"
    workers: int  # live workers in any state
    e2e_p50_ms: float
    e2e_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    stall_ms: float
    requests: int
    errors: int
    running: int
    waiting: int
    batch_cap: int
    kv_usage: float
    tokens_per_s: float
    busy_ratio: float
    queue_depth: int  # JetStream pending + ack pending; -1 when unknown
    # When the report that gives e2e_p99_ms / ttft_p99_ms arrived (None: no report gives
    # it): members that did not report this tick count with their last report, whose
    # latency window ends then, not now.
    e2e_p99_at: float | None = None
    ttft_p99_at: float | None = None

    @property
    def latency_ms(self) -> float:
        """E2E p99, or the stall when that is longer: what the breaker watches for E2E."""
        return max(self.e2e_p99_ms, self.stall_ms)


@dataclass(frozen=True, slots=True)
class GroupStats:
    """A group's window summed up, for metrics and the rebalancer."""

    samples: int
    e2e_p99_ms: float  # mean over the window
    ttft_p99_ms: float
    error_rate: float
    concurrency: float  # mean running + waiting + backlog: the demand, in requests
    queue_depth: int  # latest
    replicas: int  # latest


@dataclass
class _Worker:
    report: Telemetry
    seen_at: float
    fresh: bool = True
    base_finished: int = 0  # counters at this group's previous sample
    base_errors: int = 0
    stall_from: float | None = None

    @property
    def finished(self) -> int:
        return self.report.requests_done + self.report.errors


class TelemetryWindows:
    """Latest report per worker and a :class:`SlidingWindow` of samples per group."""

    def __init__(
        self,
        groups: list[str],
        *,
        silent_s: float,
        window_samples: int,
        window_s: float,
        moves_kept_s: float = 3600.0,
        min_interval_s: float = 0.0,
    ) -> None:
        self.groups = list(groups)
        # A group's samples come at most this often (a little under the workers' report
        # interval): ticks twice as fast as reports counted each report in two samples,
        # and one slow request, held in its worker's p99 for three reports, filled six of
        # the breaker's ten samples. Counters add up across the ticks skipped.
        self._min_interval_s = min_interval_s
        self._sampled_at: dict[str, float] = {}
        self._silent_s = silent_s
        self._moves_kept_s = moves_kept_s  # at least the move cooldown a new leader takes up
        self._workers: dict[str, _Worker] = {}
        # worker -> (when, old group, new group) of the last group change seen in its reports
        self.moves_seen: dict[str, tuple[float, str, str]] = {}
        self.windows: dict[str, SlidingWindow[GroupSample]] = {
            g: SlidingWindow(window_samples, window_s) for g in self.groups
        }

    # --- feeding -------------------------------------------------------------------------

    def observe(self, report: Telemetry, now: float) -> None:
        """Record one worker report (``now``: the caller's monotonic clock)."""
        if report.group not in self.windows:
            return  # a group this scheduler was not configured with
        if report.state == "stopped":
            self._workers.pop(report.worker, None)
            return
        known = self._workers.get(report.worker)
        if known is None or known.report.group != report.group:
            # New here, or moved: its counters start counting for this group from now.
            if known is not None:
                seen = self.moves_seen.get(report.worker)
                if (
                    seen is not None
                    and seen[1:] == (report.group, known.report.group)
                    and now - seen[0] <= FAILED_BIND_S
                ):
                    # Back where it came from (its bind failed): no move happened, and its
                    # cooldowns, merged in again, kept both groups from giving up a replica
                    # after the failed move had lifted them.
                    del self.moves_seen[report.worker]
                else:
                    self.moves_seen[report.worker] = (now, known.report.group, report.group)
            known = _Worker(report, now, base_finished=report.requests_done + report.errors,
                            base_errors=report.errors)  # fmt: skip
            self._workers[report.worker] = known
            progressed = True
        else:
            progressed = report.requests_done + report.errors > known.finished
            known.report, known.seen_at, known.fresh = report, now, True
        if report.running == 0:
            known.stall_from = None
        elif progressed or known.stall_from is None:
            # What runs now still runs at the next report if nothing finishes in between.
            known.stall_from = now

    def recent_moves(self, now: float, within_s: float) -> list[tuple[float, str, str, str]]:
        """(when, worker, old group, new group) of group changes seen within ``within_s``."""
        for worker in [w for w, (at, _, _) in self.moves_seen.items() if now - at > within_s]:
            del self.moves_seen[worker]
        return [(at, w, src, dst) for w, (at, src, dst) in self.moves_seen.items()]

    def expire(self, now: float) -> list[Telemetry]:
        """Forget workers silent for ``silent_s`` (returns their last reports), and moves
        older than a new leader could still need (a standby never asks: it kept them all)."""
        gone = [w for w in self._workers.values() if now - w.seen_at >= self._silent_s]
        for w in gone:
            del self._workers[w.report.worker]
        for worker in [w for w, (at, _, _) in self.moves_seen.items()
                       if now - at > self._moves_kept_s]:  # fmt: skip
            del self.moves_seen[worker]
        return [w.report for w in gone]

    def serving_in(self, worker: str, group: str) -> bool:
        """Whether ``worker``'s latest report has it serving in ``group``."""
        known = self._workers.get(worker)
        return known is not None and known.report.group == group and known.report.state == "serving"

    def worker_ids(self) -> set[str]:
        """Workers reporting now (neither silent nor stopped)."""
        return set(self._workers)

    def sample(self, now: float, queue_depths: dict[str, int]) -> dict[str, GroupSample]:
        """One sample per group with reports since the last call; each joins its window."""
        out: dict[str, GroupSample] = {}
        for group in self.groups:
            members = [w for w in self._workers.values() if w.report.group == group]
            if not any(w.fresh for w in members):
                continue
            if now - self._sampled_at.get(group, float("-inf")) < self._min_interval_s:
                continue
            self._sampled_at[group] = now
            sample = _combine(members, now, queue_depths.get(group, -1))
            for w in members:
                w.fresh = False
                w.base_finished, w.base_errors = w.finished, w.report.errors
            self.windows[group].add(now, sample)
            out[group] = sample
        return out

    # --- reading -------------------------------------------------------------------------

    def workers(self, group: str | None = None) -> Iterator[Telemetry]:
        """Latest report of each live worker (of ``group``)."""
        for w in self._workers.values():
            if group is None or w.report.group == group:
                yield w.report

    def reported_within(self, group: str, now: float, within_s: float) -> set[str]:
        """Workers of ``group`` whose latest report is at most ``within_s`` old."""
        return {
            w.report.worker
            for w in self._workers.values()
            if w.report.group == group and now - w.seen_at <= within_s
        }

    def replicas(self, group: str) -> int:
        """Live workers of ``group`` that report ``serving``."""
        return sum(1 for r in self.workers(group) if r.state == "serving")

    def stats(self, group: str, now: float, queue_depth: int = -1) -> GroupStats:
        """The group's window summed up; an empty window gives zeros."""
        samples = self.windows[group].items(now)
        n = len(samples)
        requests = sum(s.requests for s in samples)
        errors = sum(s.errors for s in samples)
        latest = samples[-1] if samples else None
        depth = queue_depth if queue_depth >= 0 else (latest.queue_depth if latest else 0)
        return GroupStats(
            samples=n,
            e2e_p99_ms=sum(s.latency_ms for s in samples) / n if n else 0.0,
            ttft_p99_ms=sum(s.ttft_p99_ms for s in samples) / n if n else 0.0,
            error_rate=errors / requests if requests else 0.0,
            concurrency=sum(_demand(s) for s in samples) / n if n else 0.0,
            queue_depth=max(depth, 0),
            replicas=self.replicas(group),
        )


def backlog(queue_depth: int, running: int) -> int:
    """Requests queued that no replica works on: JetStream's count less those running."""
    return max(0, queue_depth - running) if queue_depth >= 0 else 0


def _demand(s: GroupSample) -> float:
    return s.running + s.waiting + backlog(s.queue_depth, s.running + s.waiting)


def _combine(members: list[_Worker], now: float, queue_depth: int) -> GroupSample:
    reports = [w.report for w in members]
    with_samples = [r for r in reports if r.samples > 0]
    weight = sum(r.samples for r in with_samples)

    def p50(attr: str) -> float:
        if not weight:
            return 0.0
        return sum(getattr(r, attr) * r.samples for r in with_samples) / weight

    # The slowest worker's p99 is the group's (with samples, for E2E); the newest report
    # among equals, so that one just made is not judged by when an older one was.
    e2e_top = max(
        (w for w in members if w.report.samples > 0),
        key=lambda w: (w.report.e2e_p99_ms, w.seen_at),
        default=None,
    )
    ttft_top = max(members, key=lambda w: (w.report.ttft_p99_ms, w.seen_at), default=None)
    # Up to each worker's latest report, not to now: between reports nothing is known, and
    # a busy replica whose report fell in the previous tick would read as stalled.
    stalls = [w.seen_at - w.stall_from for w in members if w.stall_from is not None]
    requests = errors = 0
    for w in members:
        new_finished, new_errors = w.finished - w.base_finished, w.report.errors - w.base_errors
        if new_finished < 0 or new_errors < 0:  # the worker restarted: its counters began anew
            new_finished, new_errors = w.finished, w.report.errors
        requests += new_finished
        errors += new_errors
    return GroupSample(
        at=now,
        replicas=sum(1 for r in reports if r.state == "serving"),
        workers=len(reports),
        e2e_p50_ms=p50("e2e_p50_ms"),
        e2e_p99_ms=e2e_top.report.e2e_p99_ms if e2e_top is not None else 0.0,
        ttft_p50_ms=p50("ttft_p50_ms"),
        ttft_p99_ms=ttft_top.report.ttft_p99_ms if ttft_top is not None else 0.0,
        stall_ms=max(stalls, default=0.0) * 1e3,
        requests=requests,
        errors=errors,
        running=sum(r.running for r in reports),
        waiting=sum(r.waiting for r in reports),
        batch_cap=sum(r.batch_cap for r in reports),
        kv_usage=sum(r.kv_usage for r in reports) / len(reports) if reports else 0.0,
        tokens_per_s=sum(r.tokens_per_s for r in reports),
        busy_ratio=sum(r.busy_ratio for r in reports) / len(reports) if reports else 0.0,
        queue_depth=queue_depth,
        e2e_p99_at=e2e_top.seen_at if e2e_top is not None else None,
        ttft_p99_at=ttft_top.seen_at if ttft_top is not None else None,
    )
