"""Fencing tokens: a deposed scheduler leader's late messages are told from today's."""

from __future__ import annotations

from common.fence import FenceGuard


def test_a_lower_term_issued_before_the_newest_seen_is_stale():
    guard = FenceGuard()
    assert not guard.stale(7, issued_ms=1_000)  # the old leader
    assert not guard.stale(12, issued_ms=5_000)  # a standby took over
    assert guard.stale(7, issued_ms=2_000)  # the old leader's queued publish, sent late
    assert not guard.stale(12, issued_ms=4_000)  # today's leader, any order
    assert guard.fence == 12


def test_a_term_that_falls_with_a_later_issue_time_is_adopted():
    """The lease bucket made again (JetStream's storage lost) numbers from 1: its leader's
    commands, issued after everything seen, must not all be dropped for good."""
    guard = FenceGuard()
    assert not guard.stale(900, issued_ms=1_000)
    assert not guard.stale(2, issued_ms=60_000)
    assert guard.fence == 2
    assert not guard.stale(2, issued_ms=61_000)  # and its later ones go on
    assert guard.stale(1, issued_ms=30_000)  # an earlier term of the new bucket, late
