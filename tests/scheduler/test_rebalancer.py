"""Rebalancer decisions: desired replicas, moves, minimums, hysteresis and cooldown."""

from __future__ import annotations

from scheduler.rebalancer import (
    GroupView,
    RebalancerState,
    RebalanceSettings,
    ReplicaView,
    decide,
    desired_replicas,
)

S = RebalanceSettings(move_after_ticks=3, cooldown_s=30, target_utilization=0.5)


def idle(*ids: str) -> tuple[ReplicaView, ...]:
    return tuple(ReplicaView(w) for w in ids)


def busy(*ids: str) -> tuple[ReplicaView, ...]:
    return tuple(ReplicaView(w, running=2) for w in ids)


def fleet(long_backlog: int = 8, short_backlog: int = 0, short=("s1", "s2")) -> list[GroupView]:
    return [
        GroupView("short", replicas=idle(*short), backlog=short_backlog,
                  concurrency=short_backlog, slo_ms=500, max_batch=16),
        GroupView("long", replicas=busy("l1"), backlog=long_backlog,
                  concurrency=2 + long_backlog, p99_ms=9000, slo_ms=60000, max_batch=2),
    ]  # fmt: skip


def run(ticks: list[list[GroupView]], state=None, start=0.0, settings=S):
    state = state or RebalancerState()
    moves = []
    for i, views in enumerate(ticks):
        d = decide(views, state, settings, start + i)
        state = d.state
        moves += d.moves
    return moves, state


def test_desired_replicas_follow_demand_history_and_minimum():
    g = GroupView("long", replicas=busy("l1"), concurrency=5, max_batch=2, min_replicas=1)
    assert desired_replicas(g, S) == (5, "demand")  # 5 / (2 × 0.5)
    assert desired_replicas(GroupView("x", forecast=7, max_batch=2), S) == (7, "history")
    assert desired_replicas(GroupView("x", min_replicas=2), S) == (2, "minimum")
    hot = GroupView("x", replicas=busy("a", "b"), backlog=1, concurrency=1, p99_ms=900,
                    slo_ms=500, max_batch=16)  # fmt: skip
    assert desired_replicas(hot, S) == (3, "slo")
    capped = RebalanceSettings(max_replicas=4, target_utilization=0.5)
    assert desired_replicas(GroupView("x", concurrency=100, max_batch=2), capped)[0] == 4


def test_moves_an_idle_replica_to_the_backlogged_group_after_k_ticks():
    moves, _ = run([fleet()] * 3)
    assert len(moves) == 1
    m = moves[0]
    assert (m.worker, m.src, m.dst) == ("s1", "short", "long")


def test_no_move_before_the_condition_held_k_ticks():
    moves, state = run([fleet()] * 2)
    assert moves == [] and state.streak == 2


def test_alternating_backlog_never_moves():
    a = fleet(long_backlog=8, short_backlog=0, short=("s1", "s2"))
    b = [
        GroupView("short", replicas=busy("s1", "s2"), backlog=40, concurrency=60,
                  slo_ms=500, max_batch=16),
        GroupView("long", replicas=idle("l1", "l2"), backlog=0, slo_ms=60000, max_batch=2),
    ]  # fmt: skip
    moves, _ = run([a, b] * 20)
    assert moves == []


def test_backlog_that_comes_and_goes_never_moves():
    moves, _ = run([fleet(long_backlog=8), fleet(long_backlog=0)] * 20)
    assert moves == []


def test_never_takes_a_group_below_its_minimum():
    only_one = fleet(short=("s1",))
    assert run([only_one] * 10)[0] == []
    two_min_two = [g if g.name != "short" else GroupView(
        "short", replicas=idle("s1", "s2"), slo_ms=500, max_batch=16, min_replicas=2)
        for g in fleet()]  # fmt: skip
    assert run([two_min_two] * 10)[0] == []


def test_busy_replicas_and_open_breakers_give_nothing_up():
    views = fleet()
    views[0] = GroupView("short", replicas=busy("s1", "s2"), slo_ms=500, max_batch=16)
    assert run([views] * 10)[0] == []
    views[0] = GroupView("short", replicas=idle("s1", "s2"), slo_ms=500, max_batch=16,
                         breaker="open")  # fmt: skip
    assert run([views] * 10)[0] == []


def test_cooldown_after_a_move():
    short3 = ("s1", "s2", "s3")
    moves, state = run([fleet(short=short3)] * 3)
    assert [m.worker for m in moves] == ["s1"]
    # s1 left; the backlog persists: no second move out of short until the cooldown ends.
    later, state = run([fleet(short=("s2", "s3"))] * 20, state=state, start=3.0)
    assert later == []
    after, _ = run([fleet(short=("s2", "s3"))] * 3, state=state, start=40.0)
    assert [m.worker for m in after] == ["s2"]


def test_prefers_the_source_with_most_headroom_and_the_most_backlogged_destination():
    views = [
        GroupView("realtime", replicas=idle("r1", "r2"), p99_ms=150, slo_ms=200, max_batch=1),
        GroupView("short", replicas=idle("s1", "s2"), p99_ms=100, slo_ms=500, max_batch=16),
        GroupView("long", replicas=busy("l1"), backlog=6, concurrency=8, slo_ms=60000,
                  max_batch=2),
        GroupView("other", replicas=busy("o1"), backlog=16, concurrency=20, slo_ms=500,
                  max_batch=16),
    ]  # fmt: skip
    moves, _ = run([views] * 3)
    # long: 6 / 2 = 3 batches waiting; other: 16 / 16 = 1. short: headroom 0.8 > 0.25.
    assert [(m.src, m.dst) for m in moves] == [("short", "long")]


def test_moving_can_be_switched_off():
    off = RebalanceSettings(move_replicas=False, move_after_ticks=1)
    d = decide(fleet(), RebalancerState(), off, 0.0)
    assert d.moves == () and d.desired["long"] >= 2


def test_a_replica_moves_only_into_a_group_whose_sequences_it_holds():
    """long's replicas serve 128k tokens: a short replica whose KV cache holds 32k would
    cut long's limit (the gateway takes the least a group's live workers serve) and fail
    the long prompts already queued. One that holds 128k moves; a group nobody serves
    takes any replica."""
    small, big = ReplicaView("s1", capacity=32_768), ReplicaView("s2", capacity=131_072)

    def views(replicas: tuple[ReplicaView, ...], seq_need: int) -> list[GroupView]:
        long = fleet()[1]
        return [
            GroupView("short", replicas=replicas, slo_ms=500, max_batch=16),
            GroupView("long", replicas=long.replicas, backlog=8, concurrency=10,
                      slo_ms=60000, max_batch=2, seq_need=seq_need),
        ]  # fmt: skip

    moves, _ = run([views((small, big), 131_072)] * 3)
    assert [m.worker for m in moves] == ["s2"]  # not s1, first by name
    small2 = ReplicaView("s3", capacity=32_768)
    assert run([views((small, small2), 131_072)] * 10)[0] == []
    assert [m.worker for m in run([views((small, small2), 0)] * 3)[0]] == ["s1"]
    unknown = (ReplicaView("s1"), ReplicaView("s3"))  # workers that predate the field
    assert [m.worker for m in run([views(unknown, 131_072)] * 3)[0]] == ["s1"]


def test_never_moves_a_groups_last_replica_even_with_a_minimum_of_zero():
    """A group left with no replica is not live: the gateway refuses its requests (503),
    so it never shows a backlog and never gets a replica back."""
    views = [g if g.name != "short" else GroupView(
        "short", replicas=idle("s1"), slo_ms=500, max_batch=16, min_replicas=0)
        for g in fleet()]  # fmt: skip
    assert run([views] * 10)[0] == []


def test_a_destination_no_replica_can_hold_does_not_block_the_next():
    """long outranked short on backlog, no idle replica held long's sequences, and short,
    backlogged too, never got one either."""
    views = [
        GroupView("short", replicas=busy("s1"), backlog=14, concurrency=20, slo_ms=500,
                  max_batch=16, rank=1),
        GroupView("long", replicas=busy("l1"), backlog=4, concurrency=6, slo_ms=60000,
                  max_batch=2, rank=2, seq_need=131_072),
        GroupView("realtime", replicas=tuple(ReplicaView(f"r{i}", capacity=4096) for i in range(3)),
                  slo_ms=200, max_batch=1),
    ]  # fmt: skip
    moves, _ = run([views] * 3)
    assert [(m.src, m.dst) for m in moves] == [("realtime", "short")]


def test_groups_are_served_by_rank_and_a_group_over_its_slo_gives_nothing_up():
    views = [
        GroupView("realtime", replicas=busy("r1"), backlog=3, concurrency=4, slo_ms=200,
                  max_batch=1),
        GroupView("short", replicas=busy("s1"), backlog=64, concurrency=80, slo_ms=500,
                  max_batch=16, rank=1),
        GroupView("long", replicas=idle("l1", "l2"), slo_ms=60000, max_batch=2, rank=2),
    ]  # fmt: skip
    moves, _ = run([views] * 3)
    assert [(m.src, m.dst) for m in moves] == [("long", "realtime")]  # 3/1 < 64/16, rank 0
    views[2] = GroupView("long", replicas=idle("l1", "l2"), p99_ms=90_000, slo_ms=60000,
                         max_batch=2, rank=2)  # fmt: skip
    assert run([views] * 3)[0] == []  # over its SLO (its queue empty for a moment)


def test_a_group_nobody_serves_gets_the_replica_that_holds_the_longest_sequences():
    """With no live replica in long (seq_need 0) the first idle one by name moved: a 32k
    one capped long's limit at 32k and its queued 100k prompts failed on fetch."""
    small, big = ReplicaView("s1", capacity=32_768), ReplicaView("s2", capacity=131_072)
    views = [
        GroupView("short", replicas=(small, big, ReplicaView("s3", capacity=32_768)),
                  slo_ms=500, max_batch=16),
        GroupView("long", backlog=4, concurrency=4, slo_ms=60000, max_batch=2),
    ]  # fmt: skip
    assert [m.worker for m in run([views] * 3)[0]] == ["s2"]


def test_a_group_whose_last_replica_died_is_refilled_to_its_minimum_without_a_backlog():
    """The gateway answers 503 while a group has no live worker, so its queue stays empty:
    waiting for a backlog left long without a replica for good."""
    short = GroupView("short", replicas=idle("s1", "s2", "s3"), slo_ms=500, max_batch=16)
    empty_long = GroupView("long", slo_ms=60000, max_batch=2, min_replicas=1, was_served=True)
    moves, _ = run([[short, empty_long]] * 3)
    assert [(m.worker, m.src, m.dst) for m in moves] == [("s1", "short", "long")]
    assert "below its minimum of 1" in moves[0].reason
    scaled_to_zero = GroupView("long", slo_ms=60000, max_batch=2, min_replicas=0, was_served=True)
    never_served = GroupView("long", slo_ms=60000, max_batch=2, min_replicas=1)
    for meant_empty in (scaled_to_zero, never_served):  # left so
        assert run([[short, meant_empty]] * 10)[0] == []


def test_a_group_whose_queue_depth_is_unknown_gives_nothing_up_and_keeps_its_count():
    """JetStream did not answer: the backlog read 0, the group looked drained, gave a
    replica away between two requests and its desired count fell to what ran."""
    unknown = GroupView("short", replicas=idle("s1", "s2", "s3"), slo_ms=500, max_batch=16,
                        depth_known=False)  # fmt: skip
    long = fleet()[1]
    moves, _ = run([[unknown, long]] * 10)
    assert moves == []
    assert desired_replicas(unknown, S) == (3, "queue depth unknown")
    known = GroupView("short", replicas=idle("s1", "s2", "s3"), slo_ms=500, max_batch=16)
    assert len(run([[known, long]] * 3)[0]) == 1  # the same fleet, depth known: it moves
