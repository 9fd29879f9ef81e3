"""A per-group circuit breaker: a pure state machine (no I/O, no clock of its own).

CLOSED → OPEN → HALF_OPEN → CLOSED, as in resilience4j, fed one :class:`BreakerSample`
per scheduler tick in which the group reported (:meth:`Breaker.observe`) and told the time
(:meth:`Breaker.tick`). Both return the :class:`Transition` they made, or None; the
service acts on it (batch cap, KV state, alert).

- CLOSED: a window of the last ``window_samples`` samples of the last ``max_age_s``
  seconds (a sample from before a gap, when the group had no live worker, is not
  evidence about the replicas that came back). It opens when, with at least
  ``min_samples`` in the window, the **mean of their p99s** exceeds the threshold (the
  field study: 10 samples, mean p99 > 500 ms), or when the error rate (errors / finished
  requests) exceeds ``error_rate_threshold``, judged over the window's requests or, when
  those are fewer than ``min_requests``, over as many of the state's samples of the last
  ``error_window_s`` as it takes to reach them: the window spans a few seconds, and a
  group at 1 req/s failing every request never had ``min_requests`` in it.
- OPEN: samples are ignored (they describe the incident the breaker already acted on);
  after its wait it goes HALF_OPEN. The wait is ``wait_open_s``, doubled for each re-open
  in a row (a probe that failed, or a trip within ``max_wait_open_s`` of closing) up to
  ``max_wait_open_s``: a group healthy at a quarter of its traffic and overloaded at all
  of it otherwise flips every ~15 s, its traffic diverted and its caps swinging.
- HALF_OPEN: each sample is judged alone: unhealthy (p99 over the threshold, or the error
  rate of every probe since half-open began, judged from ``close_after_healthy`` finished
  requests) re-opens; ``close_after_healthy`` healthy samples in a row close it. A sample
  is healthy only if a probe *succeeded* in it and its own error share is within the
  limit: one in which nothing finished (a long group's probes take seconds) is no
  evidence, and one whose probes mostly failed breaks the row (failed requests stay out
  of the latency windows, so their p99 reads as 0). For its first ``stale_p99_s`` (the
  workers' latency window) a sample's p99 is not judged: it still holds requests that
  finished before half-open began (a backlog drained while open). A half-open state that
  reaches ``max_half_open_s`` undecided (no traffic: its probes never came) is judged on all
  the probes of the spell, however few: closed when their error rate is within the limit
  (none failed, or none came: nothing says the group is broken), re-opened otherwise.
  Left half-open, an idle group kept its open cap and its replicas for good (a group gives
  up a replica only with its breaker closed).

Every transition empties the window, so no state judges data from before its start.

The threshold is ``max(breaker.p99_threshold_ms, the group's SLO)`` of the watched kind
(E2E by default, ``breaker.p99_kind``): the field study's 500 ms applies to chat, and a
group meeting its own SLO (128k documents take seconds) is healthy by definition.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from common.config import GroupConfig

State = Literal["closed", "open", "half_open"]
STATES: tuple[State, ...] = ("closed", "open", "half_open")
# Every move the machine can make; tests hold it to these.
LEGAL: frozenset[tuple[State, State]] = frozenset(
    {("closed", "open"), ("open", "half_open"), ("half_open", "closed"), ("half_open", "open")}
)
# qos_breaker_state values (DESIGN §7).
STATE_GAUGE: dict[State, int] = {"closed": 0, "half_open": 1, "open": 2}
# The longest a half-open state waits for probe evidence by default: longer than the
# gateway's default deadline (120 s), so probes that run to it report before the judgment;
# BreakerConfig.max_half_open_s sets it.
MAX_HALF_OPEN_S = 180.0


@dataclass(frozen=True, slots=True)
class BreakerSample:
    """One group-level observation: its p99 now and the requests finished since the last."""

    p99_ms: float
    requests: int = 0  # finished, errors included
    errors: int = 0
    # When the report that gives ``p99_ms`` was made (None: now): its latency window ends
    # then, so it is stale for half-open until stale_p99_s after the half-open began.
    reported_at: float | None = None


@dataclass(frozen=True, slots=True)
class Transition:
    """A state change; ``at`` is the caller's clock (monotonic seconds)."""

    group: str
    source: State
    target: State
    at: float
    reason: str


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """The thresholds of one group's breaker, resolved from its config."""

    window_samples: int = 10
    min_samples: int = 5
    p99_threshold_ms: float = 500.0
    error_rate_threshold: float = 0.2
    min_requests: int = 10
    wait_open_s: float = 10.0
    max_wait_open_s: float = 120.0
    close_after_healthy: int = 3
    max_age_s: float = 10.0
    error_window_s: float = 60.0
    stale_p99_s: float = 0.0
    max_half_open_s: float = MAX_HALF_OPEN_S

    @classmethod
    def for_group(
        cls, group: GroupConfig, max_age_s: float = 10.0, stale_p99_s: float = 0.0
    ) -> BreakerSettings:
        b = group.breaker
        slo = group.slo_e2e_p99_ms if b.p99_kind == "e2e" else group.slo_ttft_ms
        return cls(
            window_samples=b.window_samples,
            min_samples=min(b.min_samples, b.window_samples),
            p99_threshold_ms=max(b.p99_threshold_ms, slo),
            error_rate_threshold=b.error_rate_threshold,
            min_requests=b.min_requests,
            wait_open_s=b.wait_open_s,
            max_wait_open_s=max(b.max_wait_open_s, b.wait_open_s),
            close_after_healthy=b.close_after_healthy,
            max_age_s=max_age_s,
            error_window_s=max(b.error_window_s, max_age_s),
            stale_p99_s=stale_p99_s,
            max_half_open_s=max(b.max_half_open_s, stale_p99_s),
        )


class Breaker:
    """One group's breaker. ``since`` is when the current state began (caller's clock)."""

    def __init__(
        self,
        group: str,
        settings: BreakerSettings,
        state: State = "closed",
        since: float = 0.0,
        reason: str = "",
    ) -> None:
        self.group = group
        self.settings = settings
        self.state: State = state
        self.since = since
        self.reason = reason
        self.window: deque[BreakerSample] = deque(maxlen=settings.window_samples)
        self._window_at: deque[float] = deque(maxlen=settings.window_samples)  # when each came
        # (when, finished, failed) of the state's samples of the last error_window_s.
        self._outcomes: deque[tuple[float, int, int]] = deque()
        self.healthy_in_row = 0
        self.probes = self.failed_probes = 0  # finished, failed since half-open began
        # Since when ``probes`` counts (None: from the next look, after a restore).
        self._probes_since: float | None = since
        self.reopens = 0  # opens in a row that came soon after the last (the wait doubles)
        self._closed_at: float | None = None  # when it last closed from half-open

    # --- reading -------------------------------------------------------------------------

    def mean_p99_ms(self) -> float:
        """Mean of the window's p99s (0 when empty)."""
        if not self.window:
            return 0.0
        return sum(s.p99_ms for s in self.window) / len(self.window)

    @property
    def wait_s(self) -> float:
        """How long this open spell lasts: ``wait_open_s`` doubled per re-open in a row."""
        s = self.settings
        return min(s.wait_open_s * 2 ** min(self.reopens, 30), s.max_wait_open_s)

    def error_rate(self, needed: int | None = None, *, whole: bool = False) -> tuple[float, int]:
        """(errors / finished requests, finished requests) over the window's samples, and
        older ones of the state (within ``error_window_s``) while fewer than ``needed``
        (default ``min_requests``) requests are counted; ``whole``: every one of them."""
        needed = self.settings.min_requests if needed is None else needed
        start = self._window_at[0] if self._window_at else float("inf")
        requests = errors = 0
        for at, done, failed in reversed(self._outcomes):
            if at < start and requests >= needed and not whole:
                break
            requests, errors = requests + done, errors + failed
        return (errors / requests if requests else 0.0), requests

    # --- feeding -------------------------------------------------------------------------

    def observe(self, sample: BreakerSample, now: float) -> Transition | None:
        """Take one sample; returns the transition it caused, if any."""
        probing = self.state == "half_open"
        if probing:  # counted before a judgment at the time limit, which would drop it
            self.probes += sample.requests
            self.failed_probes += sample.errors
        moved = self.tick(now)  # a due OPEN → HALF_OPEN happens before judging the sample
        if moved is not None or self.state == "open":
            return moved
        while self._window_at and now - self._window_at[0] > self.settings.max_age_s:
            self._window_at.popleft()
            self.window.popleft()
        self.window.append(sample)
        self._window_at.append(now)
        outcomes = self._outcomes
        while outcomes and now - outcomes[0][0] > self.settings.error_window_s:
            outcomes.popleft()
        if sample.requests:
            outcomes.append((now, sample.requests, sample.errors))
        if self.state == "closed":
            return self._judge_closed(now)
        return self._judge_half_open(sample, now)

    def tick(self, now: float) -> Transition | None:
        """Let time pass: OPEN becomes HALF_OPEN after :attr:`wait_s`; HALF_OPEN undecided
        after ``max_half_open_s`` is judged on every probe of the spell."""
        if self.state == "open" and now - self.since >= self.wait_s:
            return self._move("half_open", now, f"probing after {self.wait_s:g}s open")
        if self.state == "half_open" and self._probes_since is None:
            self._probes_since = now  # restored (a new leader): its own count starts now
        spell_s = now - (self._probes_since if self._probes_since is not None else now)
        if self.state == "half_open" and spell_s >= self.settings.max_half_open_s:
            done, failed = self.probes, self.failed_probes
            if failed and failed / max(done, 1) > self.settings.error_rate_threshold:
                return self._move(
                    "open", now, f"{failed} of {done} probes failed in {spell_s:.0f}s half-open"
                )
            return self._move(
                "closed", now, f"{failed} of {done} probes failed in {spell_s:.0f}s half-open"
            )
        return None

    def recall(self, samples: Iterable[tuple[float, BreakerSample]], now: float) -> None:
        """A closed breaker's window from ``(at, sample)`` pairs this replica saw while
        another judged them (a standby's), unjudged: the next :meth:`observe` judges from
        where the old leader stood, not from an empty window. Samples from before the
        state began, or older than ``max_age_s`` (``error_window_s`` for the error rate),
        are no evidence about it."""
        if self.state != "closed":
            return  # open ignores samples; half-open judges the new leader's own probes
        self._clear()
        for at, sample in samples:
            if at < self.since:
                continue
            if now - at <= self.settings.max_age_s:
                self.window.append(sample)
                self._window_at.append(at)
            if sample.requests and now - at <= self.settings.error_window_s:
                self._outcomes.append((at, sample.requests, sample.errors))

    def restore(self, state: State, since: float, reason: str = "", reopens: int = 0) -> None:
        """Continue from a state persisted elsewhere (a restart, a new leader); not a
        transition. ``reopens`` continues the open wait's backoff (a closed state's counts
        from its ``since``, when it closed)."""
        if (state, since) != (self.state, self.since):
            self._clear()
        self.state, self.since, self.reason = state, since, reason
        self.reopens = reopens
        self._closed_at = since if state == "closed" and reopens else None

    # --- rules ---------------------------------------------------------------------------

    def _judge_closed(self, now: float) -> Transition | None:
        s = self.settings
        if len(self.window) >= s.min_samples:
            mean = self.mean_p99_ms()
            if mean > s.p99_threshold_ms:
                return self._move(
                    "open",
                    now,
                    f"mean p99 {mean:.0f} ms over {len(self.window)} samples "
                    f"> {s.p99_threshold_ms:g} ms",
                )
        return self._error_trip(now)

    def _judge_half_open(self, sample: BreakerSample, now: float) -> Transition | None:
        s = self.settings
        # The workers' p99 windows still hold requests from before half-open at first:
        # such a sample is judged on errors only, and proves no health either. A worker
        # that did not report this tick counts with its last report, whose window ends
        # then: judged by now, two workers reporting out of phase re-opened a healed group
        # on the backlog that finished while it was open (and doubled the wait).
        reported = now if sample.reported_at is None else min(now, sample.reported_at)
        stale = reported - self.since < s.stale_p99_s
        if not stale and sample.p99_ms > s.p99_threshold_ms:
            return self._move(
                "open", now, f"p99 {sample.p99_ms:.0f} ms > {s.p99_threshold_ms:g} ms while probing"
            )
        # Every probe since half-open began counts (the window keeps a few seconds: one
        # failing probe per 5 s never made close_after_healthy requests in it).
        tripped = self._error_trip(now, min(s.min_requests, s.close_after_healthy), whole=True)
        if tripped is not None:
            return tripped
        if sample.requests and sample.errors / sample.requests > s.error_rate_threshold:
            self.healthy_in_row = 0  # mostly failed: the row of healthy samples is broken
            return None
        if sample.requests - sample.errors <= 0 or stale:
            return None  # nothing finished, or its p99 unjudged: no evidence either way
        self.healthy_in_row += 1
        if self.healthy_in_row >= s.close_after_healthy:
            return self._move("closed", now, f"{self.healthy_in_row} healthy samples")
        return None

    def _error_trip(
        self, now: float, min_requests: int | None = None, whole: bool = False
    ) -> Transition | None:
        """Open on the error rate over at least ``min_requests`` (default the setting's);
        ``whole``: over every sample of the state, not just enough of them."""
        s = self.settings
        needed = s.min_requests if min_requests is None else min_requests
        rate, requests = self.error_rate(needed, whole=whole)
        if requests >= needed and rate > s.error_rate_threshold:
            return self._move(
                "open",
                now,
                f"error rate {rate:.0%} of {requests} requests > {s.error_rate_threshold:.0%}",
            )
        return None

    def _move(self, target: State, now: float, reason: str) -> Transition:
        if target == "open":
            soon = self.state == "half_open" or (
                self._closed_at is not None
                and now - self._closed_at < self.settings.max_wait_open_s
            )
            self.reopens = self.reopens + 1 if soon else 0
            if self.reopens:
                reason += f" (re-opened: {self.wait_s:g}s open)"
        elif target == "closed":
            self._closed_at = now
        transition = Transition(self.group, self.state, target, now, reason)
        self.state, self.since, self.reason = target, now, reason
        self._clear()  # no state judges samples from before it began
        self._probes_since = now
        return transition

    def _clear(self) -> None:
        self.window.clear()
        self._window_at.clear()
        self._outcomes.clear()
        self.healthy_in_row = 0
        self.probes = self.failed_probes = 0
        self._probes_since = None
