"""bench/slo_rate.py: a sweep table in, the highest rate that still meets the SLO out."""

from __future__ import annotations

import pytest

from bench.slo_rate import StepFigures, check_step, rate_at_slo, ratio_at_slo

# common.config's E2E p99 SLOs: realtime 200 ms, short 500 ms, long 60 s.
SLOS = {"realtime": 200.0, "short": 500.0, "long": 60000.0}


def step(offered: float, short_p99: float, *, sent: int = 100, completed: int = 100,
         long_p99: float = 1000.0, realtime_p99: float | None = None) -> StepFigures:  # fmt: skip
    p99 = {"short": short_p99, "long": long_p99}
    if realtime_p99 is not None:
        p99["realtime"] = realtime_p99
    return StepFigures(offered, req_s=offered * 1.6, sent=sent, completed=completed, e2e_p99_ms=p99)


def test_rate_is_the_highest_step_below_the_first_miss() -> None:
    found = rate_at_slo([step(1, 300), step(2, 450), step(4, 700), step(8, 2000)], SLOS)
    assert found.rate == 2
    assert found.req_s == pytest.approx(3.2)
    assert found.first_miss == 4
    assert [v.met for v in found.steps] == [True, True, False, False]
    assert found.steps[2].why == "short E2E p99 700 > 500 ms"


def test_a_pass_above_the_first_miss_does_not_raise_the_rate() -> None:
    # Noise on a shared machine: 4/s passes after 2/s missed. The first miss ends it.
    found = rate_at_slo([step(1, 300), step(2, 650), step(4, 480)], SLOS)
    assert found.rate == 1
    assert found.first_miss == 2


def test_steps_are_judged_in_rate_order_whatever_order_they_come_in() -> None:
    found = rate_at_slo([step(4, 700), step(1, 300), step(2, 450)], SLOS)
    assert (found.rate, found.first_miss) == (2, 4)
    assert [v.offered for v in found.steps] == [1, 2, 4]


def test_exactly_at_the_slo_meets_it() -> None:
    assert check_step(step(1, 500.0), SLOS).met
    assert not check_step(step(1, 500.01), SLOS).met


def test_long_group_latency_is_not_judged_but_realtime_is_when_it_carries_requests() -> None:
    assert check_step(step(1, 300, long_p99=90000), SLOS).met  # long is not a judged group
    miss = check_step(step(1, 300, realtime_p99=250), SLOS)
    assert not miss.met and miss.why == "realtime E2E p99 250 > 200 ms"


def test_under_99_percent_completed_misses_however_fast_the_rest_was() -> None:
    assert check_step(step(1, 100, sent=100, completed=99), SLOS).met
    miss = check_step(step(1, 100, sent=100, completed=98), SLOS)
    assert not miss.met and miss.why == "98/100 completed"
    assert not check_step(step(1, 100, sent=0, completed=0), SLOS).met


def test_every_miss_is_named() -> None:
    why = check_step(step(1, 900, sent=10, completed=5, realtime_p99=300), SLOS).why
    assert why == "5/10 completed; realtime E2E p99 300 > 200 ms; short E2E p99 900 > 500 ms"


def test_a_sweep_that_never_misses_has_no_upper_bound() -> None:
    found = rate_at_slo([step(1, 100), step(2, 200)], SLOS)
    assert (found.rate, found.first_miss) == (2, None)


def test_a_sweep_that_misses_its_lowest_step_has_no_rate() -> None:
    found = rate_at_slo([step(1, 600), step(2, 300)], SLOS)
    assert (found.rate, found.req_s, found.first_miss) == (None, None, 1)


def test_ratio_carries_the_bounds_of_both_brackets() -> None:
    policy = rate_at_slo([step(1, 100), step(2, 200), step(4, 400), step(8, 900)], SLOS)
    base = rate_at_slo([step(1, 300), step(2, 600), step(4, 900), step(8, 900)], SLOS)
    # policy in [4, 8), baseline in [1, 2): the ratio is 4, somewhere in (2, 8).
    assert ratio_at_slo(policy, base) == {"ratio": 4.0, "low": 2.0, "high": 8.0}
    assert ratio_at_slo(base, base) == {"ratio": 1.0, "low": 0.5, "high": 2.0}


def test_ratio_is_open_where_a_bracket_is() -> None:
    never_misses = rate_at_slo([step(1, 100), step(2, 100)], SLOS)
    misses_first = rate_at_slo([step(1, 900), step(2, 900)], SLOS)
    met_at_1 = rate_at_slo([step(1, 100), step(2, 900)], SLOS)
    # The baseline misses at the lowest rate: no ratio, but at least 2 / 1.
    assert ratio_at_slo(never_misses, misses_first) == {"ratio": None, "low": 2.0, "high": None}
    # The policy never misses: at least 2 / 2, no upper bound.
    assert ratio_at_slo(never_misses, met_at_1) == {"ratio": 2.0, "low": 1.0, "high": None}
    # The policy misses at the lowest rate: anything from 0 up to 1 / 1.
    assert ratio_at_slo(misses_first, met_at_1) == {"ratio": None, "low": 0.0, "high": 1.0}


def test_the_long_groups_wait_bounds_the_rate_its_queue_keeps_up_with() -> None:
    """A step drains before it is judged: a rate whose long documents queue without end
    passed, since long's E2E is not judged. Its TTFT p99 against its 5 s SLO now is."""
    slow = StepFigures(16, req_s=25.6, sent=100, completed=100,
                       e2e_p99_ms={"short": 300, "long": 9000},
                       ttft_p99_ms={"short": 40, "long": 6500})  # fmt: skip
    ttft = {"realtime": 100.0, "short": 200.0, "long": 5000.0}
    assert check_step(slow, SLOS).met  # without the rule (the figures before 2026-12-01)
    miss = check_step(slow, SLOS, slo_ttft_ms=ttft)
    assert not miss.met and miss.why == "long TTFT p99 6500 > 5000 ms"
    kept_up = StepFigures(8, req_s=12.8, sent=50, completed=50, e2e_p99_ms={"short": 300},
                          ttft_p99_ms={"short": 40, "long": 4400})  # fmt: skip
    assert check_step(kept_up, SLOS, slo_ttft_ms=ttft).met
    assert rate_at_slo([kept_up, slow], SLOS, slo_ttft_ms=ttft).rate == 8


def test_a_judged_group_that_lost_over_1_percent_misses_inside_a_pooled_99() -> None:
    """Long is a fifth of the mix: 4 of its 20 requests shed leaves 96 % of the step done
    overall but not 99 % of long's, and its TTFT p99 over the 16 that got through looked
    fine. A group that lost every request has no p99 at all, and misses here."""
    by_group = {"sent_by_group": {"short": 380, "long": 20}}
    shed = StepFigures(1, 1.6, 400, 396, {"short": 100.0}, {"long": 900.0}, **by_group,
                       completed_by_group={"short": 380, "long": 16})  # fmt: skip
    ttft = {"long": 5000.0}
    miss = check_step(shed, SLOS, slo_ttft_ms=ttft)  # 396/400: 99 % pooled, met there
    assert not miss.met and miss.why == "long 16/20 completed"
    gone = StepFigures(1, 1.6, 400, 380, {"short": 100.0}, **by_group,
                       completed_by_group={"short": 380, "long": 0})  # fmt: skip
    assert check_step(gone, SLOS, min_completed=0.9, slo_ttft_ms=ttft).why == "long 0/20 completed"
    # Long is judged by its wait only where its TTFT SLO is given (as sweep_slo does).
    assert check_step(gone, SLOS, min_completed=0.9).met


def test_a_step_whose_load_went_out_late_did_not_offer_its_rate() -> None:
    """Latencies are timed from the send: a load generator sharing the cores fell behind
    its schedule at high rates, and the late sends read as a stack within its SLO."""
    on_time = StepFigures(8, 12.8, 100, 100, {"short": 300.0}, send_lag_p99_ms=40.0)
    assert check_step(on_time, SLOS).met  # within a tenth of short's 500 ms
    late = StepFigures(8, 12.8, 100, 100, {"short": 300.0}, send_lag_p99_ms=260.0)
    verdict = check_step(late, SLOS)
    assert not verdict.met and verdict.why == "load sent late (p99 260 ms)"
    assert check_step(step(8, 300), SLOS).met  # not known (older results): not judged
