"""A new term, by a standby or by a restarted scheduler: nothing of an earlier term acts in it."""

from __future__ import annotations

import contextlib
import time

from common.nats import barrier
from common.protocol import Control, Telemetry
from scheduler.rebalancer import Move, RebalancerState
from scheduler.records import BreakerRecord, breaker_key, served_key
from scheduler.service import SchedulerService
from tests.scheduler.conftest import hand_driven, make_config, until


async def test_a_deposed_leaders_late_move_is_dropped_once_a_new_leader_took_over(
    start_worker, start_scheduler, observer
):
    """A worker learns a scheduler term only from a command, and with every breaker closed
    and every cap right a new leader sent none: a move the old leader had queued while cut
    off, arriving after the takeover (under CONTROL_STALE_S old), still moved the replica,
    and could take a group's last one. Each term now begins with a command to every group."""
    worker = await start_worker("w1")
    old = await start_scheduler("sched-old")
    assert old.is_leader and old.lease is not None
    await until(lambda: "w1" in old.windows.worker_ids(), 5, "w1 reporting")
    old_fence, ordered_ms = old.lease.fence, int(time.time() * 1000)  # while it still led
    await old.crash()
    new = await start_scheduler("sched-new")
    await until(lambda: new.acts, 5, "the new leader to take over the stale lease")
    assert new.lease is not None and new.lease.fence > old_fence and new.nc is not None
    await barrier(new.nc)
    # Its term's first command reached the worker (a fixed sleep here lost the race on a
    # loaded machine, and the late move was taken as the newest term's).
    await until(lambda: worker._fences.fence == new.lease.fence, 5, "the new term's command")
    late = Control(action="assign_group", issued_ms=ordered_ms, group="long",
                   reason="rebalance: queued while cut off", fence=old_fence)  # fmt: skip
    await observer.nc.publish(new.subjects.control("w1"), late.to_bytes())
    with contextlib.suppress(AssertionError):  # it moves within a second when taken
        await until(lambda: worker.group != "short", 3, "a move")
    assert worker.group == "short" and worker.state == "serving"


async def test_a_new_term_while_holding_the_lease_drops_the_earlier_terms_unsaved_records(
    nats_config, monkeypatch
):
    """A holder whose calls stalled renews over another replica's term: its records not
    yet stored (a write that timed out) were kept, and written over what the other
    leader decided since (here: an old 'open' over the group's newer 'closed')."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert service.kv is not None and service.lease is not None
        lease, renew = service.lease, service.lease.refresh
        service.breakers["short"].restore("open", now[0], "an incident")
        service._unsaved["short"] = service._record("short", "open", now[0], "an incident")
        wall_ms = int(time.time() * 1000)
        newer = BreakerRecord("closed", wall_ms, "3 healthy samples", "long", 8, "other",
                              written_ms=wall_ms, fence=lease.fence + 1)  # fmt: skip
        await service.kv.put(breaker_key("short"), newer.to_bytes())

        async def renewed_over_another_term() -> bool:
            held = await renew()
            lease.term += 1
            return held

        monkeypatch.setattr(lease, "refresh", renewed_over_another_term)
        await service._refresh_lease()
        assert service.acts and service.breakers["short"].state == "closed"
        await service.tick()
        stored = BreakerRecord.from_bytes((await service.kv.get(breaker_key("short"))).value)
        assert stored == newer


async def long_served_once(sched: SchedulerService, now: list[float]) -> None:
    """long's one worker (l1) and short's (a) report; a rebalance sees long served."""
    now[0] += 0.6
    for worker, group in (("l1", "long"), ("a", "short")):
        sched.windows.observe(Telemetry(worker=worker, group=group, ts_ms=0), now[0])
    sched.queue_depths.update(short=0, long=0)
    await sched.rebalance()
    assert "long" in sched.served_groups


async def short_only_rounds(sched: SchedulerService, now: list[float], rounds: int = 5) -> None:
    """Rebalances with three short workers reporting, and none of long."""
    for _ in range(rounds):
        now[0] += 0.6
        for worker in ("a", "b", "c"):
            sched.windows.observe(Telemetry(worker=worker, group="short", ts_ms=0), now[0])
        sched.queue_depths.update(short=0, long=0)
        sched.windows.sample(now[0], sched.queue_depths)
        await sched.rebalance()


async def test_a_restarted_scheduler_refills_a_group_that_lost_its_last_replica_before(
    nats_config,
):
    """The groups seen served lived in the scheduler's memory: long's only worker died
    while the schedulers restarted (a rollout), and the new ones, which never saw long
    served, took it for a group meant empty and left it so for good (no backlog builds
    while the gateway answers it 503)."""
    config = make_config(nats_config)
    async with hand_driven(config) as (first, now):
        await long_served_once(first, now)
    async with hand_driven(config) as (second, now):  # l1 is gone
        assert second.acts
        await short_only_rounds(second, now)
        assert [(m.worker, m.src, m.dst) for m in second.moves] == [("a", "short", "long")]


async def test_deleting_a_groups_served_record_stops_its_refill_without_a_restart(
    nats_config,
):
    """The README's way to keep a group empty: delete ``served.<group>``. The leader (and
    every standby) kept the group in memory, and refilled it until all were restarted."""
    config = make_config(nats_config)
    async with hand_driven(config) as (sched, now):
        await long_served_once(sched, now)
        assert sched.kv is not None
        # long emptied on purpose (its worker stopped), and its record deleted
        stopped = Telemetry(worker="l1", group="long", ts_ms=0, state="stopped")
        sched.windows.observe(stopped, now[0])
        await sched.kv.delete(served_key("long"))
        await short_only_rounds(sched, now)
        assert "long" not in sched.served_groups and not sched.moves


async def test_a_move_not_sent_because_leading_lapsed_holds_no_cooldown(nats_config):
    """The lease lapsed for a moment during the rebalance's slow bucket writes: the move was
    not sent, yet its cooldowns stayed, and the backlogged group waited a minute more."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        until_s = now[0] + 60
        service.rebalancer_state = RebalancerState(
            cooldown_until={"worker:w1": until_s, "group:short": until_s, "group:long": until_s}
        )
        service._leader_synced = False  # not acting for now
        await service._order_move(Move("w1", "short", "long", "backlog"))
        cooldowns = service.rebalancer_state.cooldown_until
        assert "group:short" not in cooldowns and "group:long" not in cooldowns
        assert cooldowns["worker:w1"] <= now[0] and not service.moves
