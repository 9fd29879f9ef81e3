"""Telemetry → group samples: p99 across workers, stalls, counter deltas, silent workers."""

from __future__ import annotations

from common.protocol import Telemetry
from scheduler.history import HOURS_PER_WEEK, DemandHistory, hour_of_week
from scheduler.windows import SlidingWindow, TelemetryWindows

MONDAY_0900_UTC = 1_700_000_000 - (1_700_000_000 % 604_800) + 4 * 86_400 + 9 * 3600


def tel(worker: str, group: str = "short", **kw) -> Telemetry:
    return Telemetry(worker=worker, group=group, ts_ms=0, **kw)


def windows() -> TelemetryWindows:
    return TelemetryWindows(["short", "long"], silent_s=3.0, window_samples=5, window_s=10.0)


def test_group_p99_is_the_slowest_worker_with_samples_and_p50_is_weighted():
    w = windows()
    w.observe(tel("a", e2e_p99_ms=300, e2e_p50_ms=100, samples=30), 0.0)
    w.observe(tel("b", e2e_p99_ms=900, e2e_p50_ms=400, samples=10), 0.0)
    w.observe(tel("c", e2e_p99_ms=0, samples=0), 0.0)
    s = w.sample(0.5, {"short": 7})["short"]
    assert s.e2e_p99_ms == 900 and s.e2e_p50_ms == 175 and s.queue_depth == 7
    assert s.workers == 3 and s.replicas == 3


def test_a_sample_says_when_the_report_giving_its_p99_was_made():
    """For the breaker's half-open: a worker that did not report this tick counts with its
    last report, whose latency window ended then; only the report that gives the group's
    p99 matters (a silent worker's old report with a low p99 must not hold the judgement)."""
    w = windows()
    w.observe(tel("a", e2e_p99_ms=300, ttft_p99_ms=50, samples=3), 0.2)
    w.observe(tel("b", e2e_p99_ms=900, ttft_p99_ms=20, samples=3), 0.7)
    s = w.sample(0.8, {})["short"]
    assert (s.e2e_p99_at, s.ttft_p99_at) == (0.7, 0.2)
    w.observe(tel("a", e2e_p99_ms=1200, ttft_p99_ms=50, samples=3), 1.2)
    s = w.sample(1.3, {})["short"]
    assert (s.e2e_p99_at, s.ttft_p99_at) == (1.2, 1.2)


def test_a_workers_report_weighs_in_one_sample_not_every_tick_until_its_next():
    """Two workers reporting every second, alternately, and ticks every 0.5 s: a report
    was counted again in each tick until the worker's next one, so one slow request (held
    in its worker's p99 for three reports) filled six of the breaker's ten samples. A
    group is sampled at most every 0.9 report intervals; each sample still takes the
    slowest worker's p99, and the requests of the ticks skipped add up."""
    w = TelemetryWindows(["short"], silent_s=3.0, window_samples=10, window_s=10.0,
                         min_interval_s=0.9)  # fmt: skip
    slow, done = [], 0
    for i in range(12):  # a reports at whole seconds, b at halves; ticks follow each
        now = i * 0.5
        worker = "a" if i % 2 == 0 else "b"
        p99 = 1000 if worker == "a" and 2 <= i <= 6 else 200  # a's three slow reports
        w.observe(tel(worker, e2e_p99_ms=p99, e2e_p50_ms=150, samples=20,
                      requests_done=i + 1), now)  # fmt: skip
        sample = w.sample(now + 0.25, {}).get("short")
        if sample is not None:
            slow.append(sample.e2e_p99_ms == 1000)
            done += sample.requests
    assert len(slow) == 6 and sum(slow) == 3
    # Every request counted once: a's from its first report (1 done) to its last (11),
    # b's from its first (2) to its last one sampled (10; its 12 comes after the last).
    assert done == (11 - 1) + (10 - 2)


def test_only_groups_that_reported_since_the_last_tick_get_a_sample():
    w = windows()
    w.observe(tel("a"), 0.0)
    assert set(w.sample(0.5, {})) == {"short"}
    assert w.sample(1.0, {}) == {}


def test_requests_and_errors_are_deltas_since_the_previous_sample():
    w = windows()
    w.observe(tel("a", requests_done=100, errors=5), 0.0)  # history before we saw it
    w.sample(0.1, {})
    w.observe(tel("a", requests_done=110, errors=8), 1.0)
    s = w.sample(1.1, {})["short"]
    assert (s.requests, s.errors) == (13, 3)
    w.observe(tel("a", requests_done=4, errors=1), 2.0)  # restarted: counters began anew
    s = w.sample(2.1, {})["short"]
    assert (s.requests, s.errors) == (5, 1)


def test_stall_bounds_the_latency_when_nothing_finishes():
    w = windows()
    w.observe(tel("a", running=0), 0.0)
    w.observe(tel("a", running=3), 1.0)
    w.observe(tel("a", running=3), 2.0)
    w.observe(tel("a", running=3), 3.0)
    s = w.sample(3.4, {})["short"]
    # Running since the report at t=1, nothing finished by the one at t=3: some request is
    # >= 2 s old. Not 2.4 s: nothing is known of the time since the last report.
    assert s.stall_ms == 2000 and s.latency_ms == 2000
    w.observe(tel("a", running=3, requests_done=1), 5.0)  # progress resets the bound
    assert w.sample(5.5, {})["short"].stall_ms == 0


def test_busy_replicas_reporting_between_ticks_do_not_read_as_stalled():
    """Two replicas finishing work at every report, a tick apart: a tick that finds one of
    them fresh must not count the other's time since its report as a stall (it tripped
    the breaker of a healthy group)."""
    w = windows()
    done = {"a": 0, "b": 0}
    stalls = []
    for tick in range(20):
        t = tick * 0.5
        worker = "a" if tick % 2 == 0 else "b"
        done[worker] += 5
        w.observe(tel(worker, running=8, requests_done=done[worker]), t + 0.1)
        stalls.append(w.sample(t + 0.5, {})["short"].stall_ms)
    assert stalls == [0.0] * 20


def test_a_stalled_replica_shows_next_to_a_healthy_one():
    w = windows()
    w.observe(tel("a", running=2), 0.0)
    for i in range(1, 5):
        w.observe(tel("a", running=2), float(i))  # nothing finishes on a
        w.observe(tel("b", running=2, requests_done=i), float(i))
    assert w.sample(4.2, {})["short"].stall_ms == 4000


def test_silent_and_stopped_workers_are_gone_and_a_moved_worker_changes_group():
    w = windows()
    w.observe(tel("a"), 0.0)
    w.observe(tel("b"), 2.0)
    assert [r.worker for r in w.expire(3.0)] == ["a"]
    w.observe(tel("b", state="stopped"), 2.5)
    assert w.replicas("short") == 0
    w.observe(tel("c", group="short"), 3.0)
    w.observe(tel("c", group="long"), 4.0)
    assert w.replicas("short") == 0 and w.replicas("long") == 1


def test_sliding_window_keeps_last_n_of_last_t_seconds():
    sw: SlidingWindow[int] = SlidingWindow(3, horizon_s=10.0)
    for t in range(5):
        sw.add(float(t), t)
    assert sw.items(4.0) == [2, 3, 4]
    assert sw.items(13.5) == [4]


def test_history_folds_each_hour_and_forecasts_now_or_the_next_hour():
    h = DemandHistory()
    assert hour_of_week(MONDAY_0900_UTC) == 9
    h.observe(2.0, MONDAY_0900_UTC, alpha=0.5)
    h.observe(4.0, MONDAY_0900_UTC + 60, alpha=0.5)
    h.observe(1.0, MONDAY_0900_UTC + 3600, alpha=0.5)  # 10:00 folds 09:00's mean
    assert h.slots[9] == 3.0
    assert h.forecast(MONDAY_0900_UTC - 3600) == 3.0  # 08:00 sees the 09:00 peak coming
    h.observe(0.0, MONDAY_0900_UTC + 604_800, alpha=0.5)  # a week on: 10:00 folds, then 09:00
    h.observe(0.0, MONDAY_0900_UTC + 604_800 + 3600, alpha=0.5)
    assert h.slots[9] == 1.5 and h.slots[10] == 1.0
    back = DemandHistory.from_bytes(h.to_bytes())
    assert back.slots == h.slots and (back.hour, back.count) == (h.hour, h.count)
    assert DemandHistory.from_bytes(b"junk").slots == [None] * HOURS_PER_WEEK


def test_moves_and_stopped_workers_are_forgotten():
    """A long-lived leader, or a standby that never leads, kept every group change ever
    seen; a worker that stops leaves the reporting set at once."""
    w = TelemetryWindows(["short", "long"], silent_s=3.0, window_samples=5, window_s=10.0,
                         moves_kept_s=100.0)  # fmt: skip
    w.observe(tel("a", "short"), 0.0)
    w.observe(tel("a", "long"), 1.0)  # moved
    w.observe(tel("b", "short"), 1.0)
    assert set(w.moves_seen) == {"a"} and w.worker_ids() == {"a", "b"}
    w.observe(tel("b", "short", state="stopped"), 2.0)
    assert w.worker_ids() == {"a"}
    w.expire(50.0)
    assert set(w.moves_seen) == {"a"}  # within what a new leader may still need
    w.expire(102.0)
    assert w.moves_seen == {}


def test_a_replica_back_in_its_group_after_a_failed_bind_is_no_move_seen() -> None:
    """Its bounce back re-imposed both groups' cooldowns for a minute, though the failed
    move had lifted them so that another replica could go."""
    w = TelemetryWindows(["short", "long"], silent_s=3.0, window_samples=5, window_s=10.0,
                         moves_kept_s=100.0)  # fmt: skip
    w.observe(tel("a", "short"), 0.0)
    w.observe(tel("a", "long"), 1.0)  # binding to long
    assert [m[1:] for m in w.recent_moves(2.0, 60.0)] == [("a", "short", "long")]
    w.observe(tel("a", "short"), 3.0)  # the bind failed: back
    assert w.recent_moves(4.0, 60.0) == []
    w.observe(tel("a", "long"), 70.0)  # a later move is seen as ever
    assert [m[1:] for m in w.recent_moves(71.0, 60.0)] == [("a", "short", "long")]
    # A real move back, long after (a standby keeps moves for an hour): seen, not undone.
    w.observe(tel("a", "short"), 1800.0)
    assert [m[1:] for m in w.recent_moves(1801.0, 60.0)] == [("a", "long", "short")]


def test_a_stored_history_no_run_writes_starts_empty_rather_than_stop_the_rebalancer() -> None:
    """An hour off the week or a NaN slot decoded fine, then made every rebalance raise
    (an index error, ceil(NaN)): the rebalancer stopped for good."""
    import json
    import math

    good = DemandHistory()
    good.observe(3.0, MONDAY_0900_UTC, alpha=0.5)
    stored = json.loads(good.to_bytes())
    for bad in ({"hour": 500}, {"hour": -7}, {"slots": [math.nan] * HOURS_PER_WEEK},
                {"slots": [-1.0] * HOURS_PER_WEEK}, {"sum": math.inf}, {"n": -2}):  # fmt: skip
        value = json.dumps({**stored, **bad}).encode()
        back = DemandHistory.from_bytes(value)
        assert back.slots == [None] * HOURS_PER_WEEK and back.hour == -1, bad
        back.observe(1.0, MONDAY_0900_UTC, alpha=0.5)  # and it works on
    assert DemandHistory.from_bytes(good.to_bytes()).slots == good.slots
