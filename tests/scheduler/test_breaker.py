"""The breaker state machine, table by table, and its legal moves under any input."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import BreakerConfig, default_groups
from gateway import workers_view
from scheduler import records
from scheduler.breaker import LEGAL, MAX_HALF_OPEN_S, Breaker, BreakerSample, BreakerSettings

S = BreakerSettings(
    window_samples=10,
    min_samples=5,
    p99_threshold_ms=500,
    error_rate_threshold=0.2,
    min_requests=10,
    wait_open_s=10,
    close_after_healthy=3,
)
SLOW, FAST = BreakerSample(900, requests=2), BreakerSample(100, requests=2)
IDLE = BreakerSample(0)  # nothing finished since the last sample


def feed(b: Breaker, samples: list[BreakerSample], start: float = 0.0, step: float = 1.0):
    """Observe each sample one ``step`` apart; returns the transitions made."""
    out = []
    for i, s in enumerate(samples):
        t = b.observe(s, start + i * step)
        if t is not None:
            out.append(t)
    return out


def opened(at: float = 0.0) -> Breaker:
    return Breaker("short", S, state="open", since=at)


def test_opens_when_mean_p99_of_the_window_exceeds_the_threshold():
    b = Breaker("short", S)
    moves = feed(b, [BreakerSample(400)] * 5 + [BreakerSample(1000)] * 2)
    # mean of 5×400 + 1000 = 500 is not over; + another 1000 → 571 > 500
    assert [(m.source, m.target) for m in moves] == [("closed", "open")]
    assert moves[0].at == 6.0 and "mean p99" in moves[0].reason


def test_needs_min_samples_before_judging_latency():
    b = Breaker("short", S)
    assert feed(b, [SLOW] * 4) == []
    assert b.state == "closed"
    assert feed(b, [SLOW], start=4.0)[0].target == "open"


def test_only_the_last_window_samples_count():
    b = Breaker("short", S)
    feed(b, [BreakerSample(1000)] + [FAST] * 10)  # 1000 + 4×100: mean 280
    assert b.state == "closed" and b.mean_p99_ms() == 100


def test_error_rate_over_the_limit_opens_with_fast_latency():
    b = Breaker("short", S)
    moves = feed(b, [BreakerSample(50, requests=4, errors=1)] * 3)
    assert moves[0].target == "open" and "error rate" in moves[0].reason


def test_error_rate_needs_min_requests():
    b = Breaker("short", S)
    assert feed(b, [BreakerSample(50, requests=2, errors=2)] * 4) == []  # 8 < min_requests


def test_a_group_failing_every_request_at_low_traffic_opens():
    """Ten samples span ~5 s at the service's 0.5 s ticks: a group at 1.5 req/s failing
    every request never had min_requests (10) in its window and stayed closed for good,
    its traffic never diverted. The error rate reaches back (error_window_s) for them."""
    b = Breaker("realtime", S)
    failing = [BreakerSample(0, requests=1, errors=1) if i % 2 else BreakerSample(0)
               for i in range(40)]  # fmt: skip
    moves = feed(b, failing, step=0.5)
    assert (moves[0].source, moves[0].target, moves[0].at) == ("closed", "open", 9.5)
    assert "error rate 100% of 10 requests" in moves[0].reason
    # A busy group is still judged on its window alone: old errors do not dilute a burst.
    busy = Breaker("short", S)
    feed(busy, [BreakerSample(100, requests=50)] * 10, step=0.5)
    assert feed(busy, [BreakerSample(100, requests=50, errors=50)] * 3, start=5.0, step=0.5)


def test_half_open_judges_every_probe_since_it_began_not_a_few_seconds_of_them():
    """Probes failing every 5 s never made close_after_healthy (3) requests inside the
    few-second window, so it never re-opened; and a failed probe did not break the row of
    healthy samples, so ok/fail/ok/fail/ok (40 % failed) closed it."""
    b = Breaker("short", S, state="half_open", since=0.0)
    ok, bad = BreakerSample(100, requests=1), BreakerSample(0, requests=1, errors=1)
    assert b.observe(ok, 1.0) is None
    assert b.observe(bad, 6.0) is None  # 1 of 2: too few to judge, but the row is broken
    assert b.healthy_in_row == 0
    move = b.observe(ok, 11.0)  # 1 failed of 3 since half-open: 33 % > 20 %
    assert move is not None and move.target == "open"
    slow = Breaker("short", S, state="half_open", since=0.0)
    moves = feed(slow, [bad, IDLE, IDLE, IDLE, IDLE] * 3, step=1.0)
    assert [m.target for m in moves] == ["open"] and moves[0].at == 10.0


def test_half_open_does_not_judge_the_p99_of_requests_that_finished_before_it():
    """The workers' p99 covers their last few seconds: a backlog that drained while open
    re-opened the breaker at its first probe sample, 20 s more of diverted traffic."""
    settings = dataclasses.replace(S, stale_p99_s=3.0)
    b = Breaker("short", settings, state="half_open", since=10.0)
    assert b.observe(BreakerSample(4000), 10.5) is None  # the backlog's, not a probe's
    assert b.state == "half_open"
    move = b.observe(BreakerSample(4000, requests=1), 13.5)  # its own, once the window turned
    assert move is not None and move.target == "open"
    # Unjudged on p99, a sample proves no health either: three slow ones must not close it.
    probing = Breaker("short", settings, state="half_open", since=10.0)
    assert feed(probing, [BreakerSample(4000, requests=2)] * 3, start=10.5, step=0.5) == []
    assert probing.state == "half_open" and probing.healthy_in_row == 0


def test_a_report_made_before_the_stale_period_ended_stays_unjudged_on_p99() -> None:
    """A worker that did not report this tick counts with its last report, whose p99 window
    ends when it was made: judged by the tick's time, a healed group re-opened on the
    backlog that finished while it was open, whenever two workers reported out of phase."""
    settings = dataclasses.replace(S, stale_p99_s=3.0)
    b = Breaker("short", settings, state="half_open", since=10.0)
    late = BreakerSample(4000, requests=1, reported_at=12.8)  # judged at 13.5, made at 12.8
    assert b.observe(late, 13.5) is None and b.state == "half_open"
    move = b.observe(BreakerSample(4000, requests=1, reported_at=13.2), 14.0)
    assert move is not None and move.target == "open"  # one made after it: judged


def test_open_ignores_samples_then_half_opens_after_wait():
    b = opened(at=0.0)
    assert b.observe(FAST, 5.0) is None and b.state == "open"
    assert len(b.window) == 0  # nothing from the open period is kept
    assert b.tick(9.9) is None
    t = b.tick(10.0)
    assert t is not None and (t.source, t.target) == ("open", "half_open")


def test_half_open_closes_after_consecutive_healthy_samples():
    b = opened()
    b.tick(10.0)
    moves = feed(b, [FAST] * 3, start=10.5)
    assert [(m.source, m.target) for m in moves] == [("half_open", "closed")]
    assert moves[0].at == 12.5


def test_half_open_reopens_on_one_unhealthy_sample():
    b = opened()
    b.tick(10.0)
    moves = feed(b, [FAST, FAST, SLOW], start=11.0)
    assert [(m.source, m.target) for m in moves] == [("half_open", "open")]
    assert b.since == 13.0  # a new wait starts, twice as long: the probe failed
    assert b.tick(32.9) is None and b.tick(33.0) is not None


def test_half_open_reopens_on_errors():
    b = opened()
    b.tick(10.0)
    moves = feed(b, [BreakerSample(50, requests=10, errors=5)], start=11.0)
    assert moves[0].target == "open"


def test_half_open_does_not_close_on_samples_in_which_no_probe_succeeded():
    """A sample with nothing finished (a long group's probes take seconds), or only
    failures (which stay out of the latency windows: p99 0), is no evidence of health: it
    closed a breaker whose every probe failed, which then re-opened: a 14 s flap."""
    b = opened()
    b.tick(10.0)
    assert feed(b, [IDLE] * 5, start=10.5) == [] and b.state == "half_open"
    moves = feed(b, [IDLE, FAST, IDLE, FAST, FAST], start=16.0)
    assert [(m.source, m.target) for m in moves] == [("half_open", "closed")]
    failing = opened()
    failing.tick(10.0)
    moves = feed(failing, [BreakerSample(0, requests=2, errors=2)] * 3, start=10.5)
    # Judged from close_after_healthy (3) finished requests, not min_requests (10).
    assert [(m.source, m.target) for m in moves] == [("half_open", "open")]
    assert moves[0].at == 11.5 and "error rate" in moves[0].reason


def test_a_half_open_breaker_that_no_probe_reaches_closes_after_max_half_open_s():
    """With no traffic no probe ever finished: the breaker stayed half-open for good, the
    group at the open cap and kept from giving up an idle replica (sources must be closed)."""
    b = opened()
    b.tick(10.0)
    assert feed(b, [IDLE] * 5, start=11.0) == []
    end = 10.0 + S.max_half_open_s
    assert b.tick(end - 0.1) is None and b.state == "half_open"
    t = b.tick(end)
    assert t is not None and (t.source, t.target) == ("half_open", "closed")
    assert "0 of 0 probes failed" in t.reason


def test_the_sample_that_arrives_at_the_time_limit_is_judged_too():
    """It was judged without its own probes, then dropped with the window: the probes that
    failed in it read as none, and the breaker closed."""
    b = opened()
    b.tick(10.0)
    failed = BreakerSample(0, requests=2, errors=2)
    t = b.observe(failed, 10.0 + S.max_half_open_s)
    assert t is not None and (t.source, t.target) == ("half_open", "open")


def test_a_restored_half_open_breaker_counts_its_time_from_the_restore():
    """A new leader restores the state and its start, not the probes the old one counted:
    judged at once on its few seconds of evidence, it closed a group still failing."""
    b = Breaker("short", S)
    b.restore("half_open", since=0.0)
    assert b.tick(S.max_half_open_s + 5.0) is None  # its own count starts here
    t = b.tick(2 * S.max_half_open_s + 5.0)
    assert t is not None and t.target == "closed"


def test_a_half_open_breaker_whose_few_probes_failed_reopens_after_max_half_open_s():
    b = opened()
    b.tick(10.0)
    one_failed = BreakerSample(0, requests=1, errors=1)  # too few to judge (3 needed)
    assert feed(b, [one_failed, IDLE], start=11.0) == [] and b.state == "half_open"
    t = b.tick(10.0 + S.max_half_open_s)
    assert t is not None and (t.source, t.target) == ("half_open", "open")
    assert b.reopens == 1  # a failed probe: the next wait doubles


def test_every_groups_breaker_has_the_max_half_open_time():
    for group in default_groups().values():
        settings = BreakerSettings.for_group(group, stale_p99_s=10.0)
        assert settings.max_half_open_s == MAX_HALF_OPEN_S > settings.stale_p99_s


def test_every_transition_resets_the_window():
    b = Breaker("short", S)
    feed(b, [SLOW] * 5)
    assert b.state == "open" and len(b.window) == 0
    b.tick(20.0)
    feed(b, [FAST] * 3, start=21.0)
    assert b.state == "closed" and len(b.window) == 0
    # Closed again: needs min_samples of its own before opening, whatever came before.
    assert feed(b, [SLOW] * 4, start=30.0) == []


def test_a_sample_arriving_after_the_wait_half_opens_without_being_judged():
    b = opened()
    t = b.observe(SLOW, 11.0)
    assert t is not None and t.target == "half_open" and b.state == "half_open"


def test_restore_continues_a_persisted_state():
    b = Breaker("short", S)
    b.restore("open", since=-8.0, reason="p99")
    assert b.state == "open" and b.tick(1.9) is None
    assert b.tick(2.0) is not None  # 10 s after -8


def test_threshold_is_the_configured_one_but_never_below_the_group_slo():
    groups = default_groups()
    assert BreakerSettings.for_group(groups["short"]).p99_threshold_ms == 500
    assert BreakerSettings.for_group(groups["long"]).p99_threshold_ms == 60000
    realtime = groups["realtime"].model_copy(
        update={"breaker": BreakerConfig(p99_threshold_ms=200)}
    )
    assert BreakerSettings.for_group(realtime).p99_threshold_ms == 200
    ttft = groups["short"].model_copy(
        update={"breaker": BreakerConfig(p99_kind="ttft", p99_threshold_ms=50)}
    )
    assert BreakerSettings.for_group(ttft).p99_threshold_ms == 200  # short's TTFT SLO


events = st.lists(
    st.one_of(
        st.tuples(
            st.just("sample"),
            st.floats(0, 3000),
            st.integers(0, 20),
            st.integers(0, 20),
            st.floats(0, 6),
        ),
        st.tuples(st.just("tick"), st.floats(0, 15)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(events=events)
def test_transitions_are_only_the_legal_ones_under_any_input(events):
    b = Breaker(
        "g", BreakerSettings(window_samples=4, min_samples=2, min_requests=3, wait_open_s=5)
    )
    now = 0.0
    for event in events:
        before, since = b.state, b.since
        if event[0] == "sample":
            _, p99, requests, errors, dt = event
            now += dt
            t = b.observe(BreakerSample(p99, requests, min(errors, requests)), now)
        else:
            now += event[1]
            t = b.tick(now)
        if t is None:
            assert b.state == before
            continue
        assert (t.source, t.target) in LEGAL
        assert t.source == before and b.state == t.target and b.since == t.at == now
        if t.target == "half_open":
            assert now - since >= 5  # never probes before wait_open_s
        if t.source == "open":
            assert t.target == "half_open"  # never straight back to closed


def test_samples_from_before_a_gap_do_not_judge_the_replicas_that_came_back():
    """Four slow samples while the group's workers died (too few to trip), then nothing for
    an hour, then a healthy replica: the old samples are past ``max_age_s`` and stay out."""
    b = Breaker("short", S)
    assert feed(b, [BreakerSample(2000)] * 4) == []
    assert feed(b, [FAST] * 3, start=3600.0) == []
    assert b.state == "closed" and len(b.window) == 3
    # Within the age the window counts as before: slow samples close together still trip.
    assert [t.target for t in feed(b, [BreakerSample(3000)] * 5, start=3603.0)] == ["open"]


def test_every_groups_transition_series_exists_at_zero_before_the_first_one():
    """Created at the first transition, already at 1, a series shows Prometheus no step:
    increase() read 0 for every group's first incident (and after each failover)."""
    from common.config import Config
    from scheduler.service import SchedulerService

    service = SchedulerService(Config(), scheduler_id="metrics-only")
    samples = {
        (s.labels["group"], s.labels["from"], s.labels["to"]): s.value
        for family in service.metrics.registry.collect()
        for s in family.samples
        if s.name == "qos_breaker_transitions_total"
    }
    expected = {(g, a, b) for g in Config().groups for a, b in LEGAL}
    assert set(samples) == expected and set(samples.values()) == {0.0}


def test_a_group_without_samples_exports_no_p99_and_an_unknown_queue_no_depth():
    """They read 0: an idle group's p99 looked perfect, a failed JetStream poll an empty
    queue. Absent, the dashboard says "no data"."""
    from common.config import Config
    from common.protocol import Telemetry
    from scheduler.service import SchedulerService

    service = SchedulerService(Config(), scheduler_id="metrics-only")

    def series(name: str) -> set[tuple[str, ...]]:
        return {
            tuple(s.labels.values())
            for family in service.metrics.registry.collect()
            for s in family.samples
            if s.name == name
        }

    service._export_groups(100.0)
    assert series("qos_group_p99_seconds") == set() and series("qos_group_queue_depth") == set()
    report = Telemetry(worker="w", group="short", ts_ms=0, e2e_p99_ms=120.0, samples=3)
    service.windows.observe(report, 100.0)
    service.queue_depths["short"] = 4
    service.windows.sample(100.5, service.queue_depths)
    service._export_groups(100.5)
    assert ("short", "e2e") in series("qos_group_p99_seconds")
    assert ("short",) in series("qos_group_queue_depth")
    # The poll fails while reports keep coming: the newest sample knows no depth either
    # (it read 0, an empty queue, through the outage).
    service.windows.observe(report, 101.0)
    service.queue_depths["short"] = -1
    service.windows.sample(101.5, service.queue_depths)
    service._export_groups(101.5)
    assert ("short",) not in series("qos_group_queue_depth")


def test_a_group_healthy_only_when_probed_is_not_flipped_every_few_seconds():
    """Overloaded at full traffic (p99 1.1× the threshold), healthy at the half-open share
    (0.8×): with a fixed 10 s wait it opened every ~15 s (8 incidents, 8 alerts, caps
    swinging 4↔16 in two minutes). Each re-open soon after closing doubles the wait."""
    b = Breaker("short", S)
    opens: list[float] = []
    waits: list[float] = []
    now = 0.0
    while now < 120:
        now += 0.5
        p99 = 400 if b.state == "half_open" else 550
        t = b.observe(BreakerSample(p99, requests=2), now) or b.tick(now)
        if t is not None and t.target == "open":
            opens.append(now)
            waits.append(b.wait_s)
    assert len(opens) <= 4, opens
    assert waits[:4] == [10, 20, 40, 80]


def test_the_wait_goes_back_to_wait_open_s_after_a_long_healthy_spell_and_is_capped():
    b = Breaker("short", dataclasses.replace(S, max_wait_open_s=30))
    assert b.wait_s == 10
    b.reopens = 10
    assert b.wait_s == 30  # capped
    b = Breaker("short", S)
    b.restore("half_open", 0.0)
    assert [t.target for t in feed(b, [FAST] * 3, start=1)] == ["closed"]
    assert [t.target for t in feed(b, [SLOW] * 5, start=10)] == ["open"]
    assert b.wait_s == 20  # 7 s after closing: the same incident
    b = Breaker("short", S)
    b.restore("half_open", 0.0)
    feed(b, [FAST] * 3, start=1)
    assert [t.target for t in feed(b, [SLOW] * 5, start=500)] == ["open"]
    assert b.wait_s == 10  # closed for minutes: a new incident


def test_an_open_breakers_record_says_when_it_probes():
    """Gateways answered every 503 of an open group with Retry-After 2 s, whatever its wait
    (10 s, doubling to 120 s): clients came back into the same 503 up to 60 times."""
    from common.config import Config
    from scheduler.service import SchedulerService

    now = [1000.0]
    service = SchedulerService(Config(), scheduler_id="records", clock=lambda: now[0])
    breaker = service.breakers["short"]
    breaker.restore("open", now[0] - 4.0, "an incident")
    breaker.reopens = 1  # a re-open: 20 s
    record = service._record("short", "open", breaker.since, breaker.reason)
    assert record.probe_at_ms - record.since_ms == 20_000
    assert service._record("short", "closed", breaker.since, "").probe_at_ms == 0


def test_schedulers_and_gateways_read_a_record_as_stale_after_the_same_time():
    assert records.BREAKER_STALE_S == workers_view.BREAKER_STALE_S


def test_restore_continues_the_backoff_and_a_closed_state_counts_from_its_close():
    b = Breaker("short", S)
    b.restore("open", 100.0, "incident", reopens=2)
    assert b.wait_s == 40 and b.tick(139.0) is None and b.tick(140.0) is not None
    closed = Breaker("short", S)
    closed.restore("closed", 200.0, "3 healthy samples", reopens=2)
    move = feed(closed, [BreakerSample(900, requests=2)] * 5, start=210.0)[0]
    assert move.target == "open" and closed.reopens == 3  # soon after closing: longer
    fresh = Breaker("short", S, state="open", since=0.0)
    fresh.reopens = 3
    fresh.restore("closed", 50.0)  # no backoff given: none kept from before
    assert fresh.reopens == 0
