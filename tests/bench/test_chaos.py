"""bench/chaos.py's report: recovery clocks, which requests a fault window holds, and the
errors no fault explains (pure: a made-up Run, no stack)."""

from __future__ import annotations

import argparse

from bench.chaos import ERROR_GRACE_S, Fault, Result, Run, overlaps, report

START = 1000.0


def args() -> argparse.Namespace:
    return argparse.Namespace(duration=60.0, workers=2, step_ms=10.0, rps=8.0)


def ok(started: float, seconds: float = 0.3) -> Result:
    return Result(START + started, "complete", seconds, 200, None, 16, 16)


def error(started: float, seconds: float = 0.1) -> Result:
    return Result(START + started, "error", seconds, 0, "transport:RemoteProtocolError")


def fault(kind: str, at: float, restarted: float, recovered: float | None) -> Fault:
    return Fault(kind, START + at, START + restarted,
                 None if recovered is None else START + recovered, "test")  # fmt: skip


def test_recovery_is_reported_from_the_kill_and_from_the_restart() -> None:
    """The probe starts only once the part is back: from the kill, recovered_s holds the
    down time the soak chose; the report gives both clocks and judges the kill's."""
    run = Run(results=[ok(1.0)], faults=[fault("worker", 10.0, 11.25, 13.0)])
    (f,) = report(args(), run, START)["faults"]
    assert (f["down_s"], f["recovered_s"], f["recovered_after_restart_s"]) == (1.25, 3.0, 1.75)
    assert f["survived"] is True


def test_survived_is_judged_from_the_kill_not_the_restart() -> None:
    # 9 s after the restart is within NATS's 10 s, 11 s after the kill is not.
    run = Run(results=[ok(1.0)], faults=[fault("nats", 10.0, 12.0, 21.0)])
    out = report(args(), run, START)
    (f,) = out["faults"]
    assert f["recovered_after_restart_s"] == 9.0 and f["recovered_s"] == 11.0
    assert f["survived"] is False and out["passed"] is False


def test_a_request_in_flight_at_the_kill_counts_during_the_fault() -> None:
    """Started 1 s before the gateway's kill, cut 1.5 s later: the fault's error, which a
    window by start time missed (and then counted nowhere)."""
    run = Run(
        results=[error(9.0, 1.5), ok(5.0, 0.5), ok(10.5, 0.2), ok(30.0)],
        faults=[fault("gateway", 10.0, 10.5, 11.0)],
    )
    (f,) = report(args(), run, START)["faults"]
    # The cut stream and the request started inside; not the one done before the kill,
    # nor the one long after.
    assert (f["requests_during"], f["errors_during"]) == (2, 1)


def test_a_lost_request_spanning_the_fault_counts_as_lost_during_it() -> None:
    lost = Result(START + 2.0, "lost", 45.0, 200, "truncated")  # timed out at 47 s
    run = Run(results=[lost], faults=[fault("scheduler", 20.0, 21.0, 22.0)])
    assert report(args(), run, START)["faults"][0]["lost_during"] == 1


def test_an_error_outside_every_fault_window_fails_the_run() -> None:
    faults = [fault("gateway", 10.0, 10.5, 11.0)]
    inside = Run(results=[error(9.5, 1.0), ok(20.0)], faults=faults)
    # Within the grace after recovery: the fault's backlog, not a failure of its own.
    grace = Run(results=[error(11.0 + ERROR_GRACE_S - 1.0), ok(20.0)], faults=faults)
    outside = Run(results=[error(40.0), ok(20.0)], faults=faults)
    assert report(args(), inside, START)["errors_outside_faults"] == 0
    assert report(args(), inside, START)["passed"] is True
    assert report(args(), grace, START)["errors_outside_faults"] == 0
    got = report(args(), outside, START)
    assert got["errors_outside_faults"] == 1 and got["passed"] is False


def test_an_error_with_no_fault_at_all_fails_the_run() -> None:
    got = report(args(), Run(results=[ok(1.0), error(2.0)]), START)
    assert got["errors_outside_faults"] == 1 and got["passed"] is False


def test_the_bad_input_probes_4xx_are_not_errors_of_the_load() -> None:
    run = Run(results=[ok(1.0)], bad={"nan": {400: 30}, "garbage": {400: 12, 0: 1}})
    got = report(args(), run, START)
    assert got["errors_outside_faults"] == 0 and got["bad_inputs"]["5xx"] == 0
    assert got["passed"] is True


def test_overlap_takes_the_requests_whole_span() -> None:
    window = (10.0, 12.0)
    assert overlaps(Result(9.0, "error", 1.0), window)  # ended at the kill
    assert not overlaps(Result(8.0, "error", 1.9), window)  # ended before it
    assert overlaps(Result(11.9, "complete", 0.1), window)
    assert not overlaps(Result(12.0, "complete", 0.1), window)  # started after recovery
    # A fault that never recovered spans the probe's whole limit.
    assert Fault("nats", 10.0).window(5.0) == (10.0, 10.0 + 120.0 + 5.0)
