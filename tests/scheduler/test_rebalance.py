"""A backlog on `long` while `short` idles: an idle short replica moves over, nothing is lost."""

from __future__ import annotations

import asyncio
import json
from collections import deque

from common.protocol import RequestParams, Telemetry
from tests.scheduler.conftest import hand_driven, make_config, until
from workers.sim import SimCost

SLOW_LONG = SimCost(base_s=0.1, prefill_s_per_token=0.0, decode_s_per_seq=0.0)  # 1 s a request


async def test_backlog_moves_an_idle_replica_and_drains_with_nothing_lost(
    start_worker, start_scheduler, client, observer
):
    short = [await start_worker("s1"), await start_worker("s2")]
    long = await start_worker("l1", group="long", cost=SLOW_LONG)
    sched = await start_scheduler("sched")
    await until(lambda: sched.windows.replicas("short") == 2, 5, "short reporting")
    await until(lambda: sched.windows.replicas("long") == 1, 5, "long reporting")

    async def one(i: int) -> int:
        ids, _, _ = await client.collect(
            group="long", prompt_token_ids=[1, 2, 3], params=RequestParams(max_tokens=10, seed=i),
            timeout_s=60,
        )  # fmt: skip
        return len(ids)

    requests = [asyncio.create_task(one(i)) for i in range(14)]  # 7 s of work for one replica
    await until(lambda: len(sched.moves) == 1, 8, "a move")
    move = sched.moves[0]
    assert (move.src, move.dst) == ("short", "long") and move.worker in ("s1", "s2")
    assigns = [(s, c.group) for s, c in observer.controls if c.action == "assign_group"]
    assert len(assigns) == 1 and assigns[0][1] == "long"
    assert assigns[0][0].endswith(f".ctl.{move.worker}")
    moved = next(w for w in short if w.worker_id == move.worker)
    # Serving again is the move's end: its group is named while it still binds (a CI run
    # read the new name with the old batch limit).
    await until(lambda: moved.group == "long" and moved.state == "serving", 5,
                "the worker to switch consumer")  # fmt: skip
    assert moved.bridge.batch_cap == 2  # the new group's batch limit

    results = await asyncio.wait_for(asyncio.gather(*requests), 30)
    assert results == [10] * 14
    assert len(long.telemetry.e2e.values()) + len(moved.telemetry.e2e.values()) == 14
    assert len(moved.telemetry.e2e.values()) > 0  # the moved replica took part of the backlog
    assert len(sched.moves) == 1  # short is at its minimum of 1 now
    assert sched.windows.replicas("short") >= 1
    desired = json.loads((await observer.kv.get("desired.long")).value)
    assert desired["replicas"] >= 2


async def test_a_replica_that_missed_its_report_is_not_counted_when_moving(nats_config):
    """short has a (reporting) and b (silent 1 s, not yet forgotten: maybe dead). Counting b
    would let the rebalancer move a to long's backlog, leaving short no live replica."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        service.windows.observe(Telemetry(worker="b", group="short", ts_ms=0), now[0])
        now[0] += 0.9
        assert await long_backlog_rounds(service, now, ("a",)) == []
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a"]  # both live


async def test_a_new_leader_keeps_the_cooldown_of_a_move_it_saw_the_old_one_make(
    nats_config, monkeypatch
):
    """The cooldowns lived in the old leader's memory: a standby that took over 4 s after a
    move could order it reversed within seconds. It saw the move in the worker's reports
    (a group change), and takes that cooldown up with the lease; and with every rebalance,
    for a move whose first report came after the handover."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        service.windows.observe(Telemetry(worker="w", group="short", ts_ms=0), now[0])
        now[0] += 1.0
        service.windows.observe(Telemetry(worker="w", group="long", ts_ms=0), now[0])
        moved_at = now[0]
        service.windows.observe(Telemetry(worker="x", group="short", ts_ms=0), now[0])
        now[0] += 4.0
        lease = service.lease
        answers = iter([False, True])  # a standby now, then the leader

        async def refresh() -> bool:
            lease.held = next(answers)
            return lease.held

        monkeypatch.setattr(lease, "refresh", refresh)
        await service._refresh_lease()
        await service._refresh_lease()
        until_ = moved_at + service.rebalance_settings.cooldown_s
        assert dict(service.rebalancer_state.cooldown_until) == {
            "worker:w": until_, "group:short": until_, "group:long": until_,
        }  # fmt: skip
        # A move the old leader ordered, first reported after the handover: the term's start
        # had no cooldown to take up for it, the next rebalance does.
        service.windows.observe(Telemetry(worker="x", group="long", ts_ms=0), now[0])
        await service.rebalance()
        seen_until = now[0] + service.rebalance_settings.cooldown_s
        cooldown = service.rebalancer_state.cooldown_until
        assert cooldown["worker:x"] == cooldown["group:short"] == seen_until


async def long_backlog_rounds(service, now, short: tuple[str, ...], rounds: int = 3) -> list[str]:
    """``rounds`` rebalances (move_after_ticks is 2) with ``short``'s replicas idle and long
    busy with 12 queued; the workers moved so far."""
    for _ in range(rounds):
        now[0] += 0.1
        for worker in short:
            service.windows.observe(Telemetry(worker=worker, group="short", ts_ms=0), now[0])
        busy = Telemetry(worker="l1", group="long", ts_ms=0, running=2, waiting=4)
        service.windows.observe(busy, now[0])
        service.queue_depths.update(short=0, long=12)  # what JetStream said this round
        service.windows.sample(now[0], service.queue_depths)  # what a tick does
        await service.rebalance()
    return [m.worker for m in service.moves]


def moves_counted(service, name: str) -> float:
    value = service.metrics.registry.get_sample_value(name, {"from": "short", "to": "long"})
    return value or 0.0


async def test_a_replica_that_never_moves_counts_failed_and_the_next_idle_one_goes(nats_config):
    """The order goes over core NATS, unacknowledged. A worker that drops it (lost, a stale
    clock, a bind that went back) stays in short; the move counted as made, and once the
    cooldown ran out the same replica (idle ones go by name) was ordered again, forever."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a"]
        assert moves_counted(service, "qos_rebalance_moves_total") == 0  # ordered, not done
        now[0] += service.pending_moves.deadline_s  # a still reports from short
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a", "b"]
        assert moves_counted(service, "qos_rebalance_moves_failed_total") == 1
        assert moves_counted(service, "qos_rebalance_moves_total") == 0


async def test_a_replica_still_draining_past_the_move_deadline_has_not_failed_to_move(
    nats_config,
):
    """A request the replica fetched before the order runs to its end (the long group
    drains for a minute) past the 30 s deadline: counted failed, the move lifted short's
    cooldown and the next decision took a second replica out of it."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a"]
        now[0] += service.pending_moves.deadline_s
        draining = Telemetry(worker="a", group="short", ts_ms=0, state="draining")
        service.windows.observe(draining, now[0])
        await long_backlog_rounds(service, now, ("b",), rounds=3)
        assert moves_counted(service, "qos_rebalance_moves_failed_total") == 0
        assert [m.worker for m in service.moves] == ["a"]  # b stays: short keeps its cooldown
        service.windows.observe(Telemetry(worker="a", group="long", ts_ms=0), now[0])
        await service.rebalance()
        assert moves_counted(service, "qos_rebalance_moves_total") == 1


async def test_a_move_counts_once_the_replica_reports_from_its_new_group(nats_config):
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a"]
        assert moves_counted(service, "qos_rebalance_moves_total") == 0
        service.windows.observe(Telemetry(worker="a", group="long", ts_ms=0), now[0])
        await service.rebalance()
        assert moves_counted(service, "qos_rebalance_moves_total") == 1
        now[0] += service.pending_moves.deadline_s
        await long_backlog_rounds(service, now, ("b",), rounds=1)
        assert moves_counted(service, "qos_rebalance_moves_failed_total") == 0


async def test_a_group_that_lost_its_last_replica_gets_one_back_without_a_backlog(nats_config):
    """long's only worker died with its queue empty: the gateway answers long's requests
    503 while no worker is live, so no backlog ever builds and, waiting for one, the
    rebalancer left long empty while short idled on three replicas."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        for round_ in range(5):
            now[0] += 0.6
            if round_ == 0:  # l1 serves, then falls silent
                service.windows.observe(Telemetry(worker="l1", group="long", ts_ms=0), now[0])
            for worker in ("a", "b", "c"):
                service.windows.observe(Telemetry(worker=worker, group="short", ts_ms=0), now[0])
            service.queue_depths.update(short=0, long=0)
            service.windows.sample(now[0], service.queue_depths)
            await service.rebalance()
            if round_ == 0:
                assert service.moves == deque()  # long has its replica
        assert [(m.worker, m.src, m.dst) for m in service.moves] == [("a", "short", "long")]


async def test_a_standby_that_saw_a_group_served_refills_it_when_it_takes_over(nats_config):
    """The served groups were noted only by the leader's rebalance: a standby that took over
    after long's only worker died with the old leader's node had never noted long, so it
    left long empty for good (no backlog builds while the gateway answers it 503)."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        service._leader_synced = False  # a standby: it ticks, it does not act
        assert not service.acts
        now[0] += 0.6
        service.windows.observe(Telemetry(worker="l1", group="long", ts_ms=0), now[0])
        for worker in ("a", "b", "c"):
            service.windows.observe(Telemetry(worker=worker, group="short", ts_ms=0), now[0])
        await service.tick()
        await service.rebalance()
        assert service.moves == deque()  # a standby orders nothing
        service._leader_synced = True  # it takes over once l1 (and its leader) are gone
        for _ in range(5):
            now[0] += 0.6
            for worker in ("a", "b", "c"):
                service.windows.observe(Telemetry(worker=worker, group="short", ts_ms=0), now[0])
            service.queue_depths.update(short=0, long=0)
            service.windows.sample(now[0], service.queue_depths)
            await service.rebalance()
        assert [(m.worker, m.src, m.dst) for m in service.moves] == [("a", "short", "long")]


def test_a_worker_still_binding_in_its_destination_has_a_grace_past_the_deadline():
    """It drained in its source to near the deadline, then its binds retried: counted
    failed, though it served a moment later."""
    from scheduler.moves import BIND_GRACE_S, PendingMoves
    from scheduler.rebalancer import Move

    moves = PendingMoves(deadline_s=30.0)
    moves.ordered(Move("a", "short", "long", "backlog"), 0.0, 60.0)
    binding = {"a": ("long", "draining")}
    assert moves.settle(binding, 31.0) == ([], []) and len(moves) == 1
    done, failed = moves.settle({"a": ("long", "serving")}, 35.0)
    assert [p.move.worker for p in done] == ["a"] and not failed
    moves.ordered(Move("a", "short", "long", "backlog"), 0.0, 60.0)
    _, failed = moves.settle(binding, 30.0 + BIND_GRACE_S)
    assert [p.move.worker for p in failed] == ["a"]


async def test_a_move_whose_bind_failed_is_not_counted_done(nats_config):
    """A moving worker names its new group as it starts binding, and reports it there while
    still draining: one report settled the move as done, though the bind then failed and
    the worker went back to short. No failure counted, the groups stayed held by the
    move's cooldown, and long got no replica."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a"]
        binding = Telemetry(worker="a", group="long", ts_ms=0, state="draining")
        service.windows.observe(binding, now[0])
        await service.rebalance()
        assert moves_counted(service, "qos_rebalance_moves_total") == 0
        assert len(service.pending_moves) == 1  # still under way
        now[0] += service.pending_moves.deadline_s  # the bind failed: a serves short again
        await long_backlog_rounds(service, now, ("a", "b"), rounds=1)
        assert moves_counted(service, "qos_rebalance_moves_failed_total") == 1
        assert moves_counted(service, "qos_rebalance_moves_total") == 0


async def test_a_move_seen_binding_that_fails_lifts_the_cooldowns_it_was_given(nats_config):
    """A rebalance saw the replica report from its destination while it bound, and merged
    that move's cooldowns (later than the order's); the bind failed, the replica went back,
    and the failure lifted only the order's: both groups stayed held, and the next idle
    replica waited out the cooldown while long's backlog grew."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a"]
        ordered = now[0]
        now[0] += 10.0  # drained, then bound in long
        binding = Telemetry(worker="a", group="long", ts_ms=0, state="draining")
        service.windows.observe(binding, now[0])
        await service.rebalance()
        now[0] += 1.0  # the bind failed: a serves short again
        await long_backlog_rounds(service, now, ("a", "b"), rounds=1)
        now[0] = ordered + service.pending_moves.deadline_s
        assert await long_backlog_rounds(service, now, ("a", "b")) == ["a", "b"]
        assert moves_counted(service, "qos_rebalance_moves_failed_total") == 1
