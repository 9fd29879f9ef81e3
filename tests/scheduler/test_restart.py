"""Restarts and replicas: the state lives in the bucket, the lease picks who acts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
import yaml

from common.nats import barrier
from common.protocol import Control, Telemetry
from common.services import free_port
from scheduler.history import KEY_PREFIX as HISTORY_PREFIX
from scheduler.history import DemandHistory
from scheduler.lease import LEASE_KEY, Lease, LeaseRecord
from scheduler.rebalancer import Move
from scheduler.records import BREAKER_RENEW_S, BreakerRecord, breaker_key
from tests.scheduler.conftest import MAX_TOKENS, hand_driven, make_config, until

ROOT = Path(__file__).resolve().parents[2]


def spawn_scheduler(config, tmp_path: Path, scheduler_id: str) -> subprocess.Popen[bytes]:
    """``python -m scheduler --config FILE`` in a child process."""
    data = config.model_dump(mode="json")
    data["groups_replace_defaults"] = True
    file = tmp_path / "qos.yaml"
    file.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
    log = (tmp_path / f"{scheduler_id}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "scheduler", "--config", str(file), "--scheduler-id", scheduler_id],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        return response.read().decode()


async def test_scheduler_killed_mid_incident_resumes_from_the_bucket(
    nats_config, start_worker, start_scheduler, start_load, observer, tmp_path
):
    port = free_port()
    config = make_config(nats_config, metrics_port=port)
    workers = [await start_worker("w1"), await start_worker("w2")]
    child = spawn_scheduler(config, tmp_path, "sched-old")
    try:
        load = start_load("short", 5)
        await _wait_for_holder(observer.kv, "sched-old", 15)
        for w in workers:
            w.engine.set_slowdown(0.15)
        await until(lambda: observer.state("short") == "open", 15, "the breaker to open")
        metrics = await asyncio.to_thread(scrape, port)
        assert 'qos_breaker_state{group="short"} 2.0' in metrics
        assert 'qos_breaker_transitions_total{from="closed",group="short",to="open"} 1.0' in metrics
        child.send_signal(signal.SIGKILL)
        child.wait(5)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    killed = time.monotonic()
    # Nobody acts now; the bucket keeps the state for the gateways.
    entry = await observer.kv.get("breaker.short")
    assert json.loads(entry.value)["state"] in ("open", "half_open")

    new = await start_scheduler("sched-new", make_config(nats_config))
    assert new.breakers["short"].state in ("open", "half_open")  # read at start
    await until(lambda: new.is_leader, 5, "the new scheduler to take over the stale lease")
    took_over_s = time.monotonic() - killed
    # A replica joining the open group gets the open cap: on its own subject once it
    # reports, or first by the term-start cap or a renewal on the group's subject
    # (test_caps.py pins the own-subject path).
    workers.append(await start_worker("w3"))
    await until(lambda: workers[2].bridge.batch_cap == 4, 5, "the joiner to get the open cap")
    assert observer.state("short") != "closed"  # still slow: it must not close
    for w in workers:
        w.engine.set_slowdown(0.0)
    await until(lambda: observer.state("short") == "closed", 30, "the breaker to close")
    assert new.acted and new.acted[0].source in ("open", "half_open")  # continued, not restarted
    await until(lambda: all(w.bridge.batch_cap == 8 for w in workers), 2, "the cap restored")
    results = await load.finish()
    assert [r for r in results if r != MAX_TOKENS] == []
    assert 1.0 <= took_over_s < 5  # waited for the TTL (1.5 s), not much longer


async def _wait_for_holder(kv, holder: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            record = LeaseRecord.from_bytes((await kv.get(LEASE_KEY)).value)
            if record is not None and record.holder == holder:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{holder} never took the lease")


async def test_lease_one_holder_takeover_when_stale_and_handover_on_release(nats_config, js):
    from common.nats import ensure_kv

    kv = await ensure_kv(js, nats_config)
    a, b = Lease(kv, "a", ttl_s=0.6), Lease(kv, "b", ttl_s=0.6)
    won = await asyncio.gather(a.refresh(), b.refresh())
    assert sorted(won) == [False, True]  # the create is a compare-and-set: one wins
    holder, other = (a, b) if a.held else (b, a)
    assert await holder.refresh() and not await other.refresh()
    await asyncio.sleep(0.7)  # the holder stops renewing: stale
    assert await other.refresh() and other.held
    assert not await holder.refresh()  # the old holder sees it lost
    await other.release()
    assert await holder.refresh()  # released: taken at once, no TTL to wait out


async def test_a_new_leader_whose_breaker_load_fails_retries_it_and_starts_its_term_clean(
    nats_config, start_scheduler, monkeypatch
):
    """Taking the lease, the scheduler resets what an earlier term left (desired replicas)
    before loading the breakers; a load that fails (a JetStream timeout) is retried at the
    next refresh instead of never."""
    service = await start_scheduler("sched-a", make_config(nats_config))
    assert service.is_leader
    for task in service._tasks:  # the refreshes and ticks are driven by hand here
        task.cancel()
    await asyncio.gather(*service._tasks, return_exceptions=True)
    lease = service.lease
    answers = iter([False, True, True])  # lose the lease, then win it back

    async def refresh() -> bool:
        lease.held = next(answers)
        return lease.held

    monkeypatch.setattr(lease, "refresh", refresh)
    service.metrics.desired_replicas.labels("short").set(3)
    await service._refresh_lease()  # standby now
    # Autoscalers take the max over the replicas' figures: a standby exports none.
    assert not [x for m in service.metrics.desired_replicas.collect() for x in m.samples]
    service.desired["short"] = 3  # what an earlier term published
    real_load = service._load_breakers
    loads = {"n": 0}

    async def flaky_load() -> None:
        loads["n"] += 1
        if loads["n"] == 1:
            raise TimeoutError("JetStream timed out")
        await real_load()

    monkeypatch.setattr(service, "_load_breakers", flaky_load)
    with contextlib.suppress(TimeoutError):
        await service._refresh_lease()  # leader again; the load fails
    assert service.desired == {}  # reset before the load, failed or not
    assert not service.acts  # no tick or rebalance acts on (or saves over) unloaded state
    await service._refresh_lease()  # the next refresh retries it
    assert loads["n"] == 2 and service._leader_synced


async def test_the_leader_renews_an_open_breaker_record_and_not_a_closed_one(nats_config, js):
    """Gateways read an open record nobody renews as left by a dead scheduler; the leader
    must therefore rewrite it every BREAKER_RENEW_S while it stays open."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert service.is_leader and service.kv is not None
        kv = service.kv

        async def revision(group: str) -> int:
            try:
                return (await kv.get(breaker_key(group))).revision
            except nats.js.errors.KeyNotFoundError:
                return 0

        assert service.nc is not None
        caps = await service.nc.subscribe(service.subjects.control_group("long"))
        service.breakers["long"].restore("open", now[0], "an incident")
        await service.tick()
        first = await revision("long")
        record = BreakerRecord.from_bytes((await kv.get(breaker_key("long"))).value)
        assert first and record is not None and record.state == "open"
        now[0] += BREAKER_RENEW_S - 1
        await service.tick()
        assert await revision("long") == first  # not due yet
        now[0] += 1
        await service.tick()
        assert await revision("long") > first
        assert service.breakers["long"].state == "open"  # a renewal, not a transition
        # The workers' cap is renewed with it, so theirs lapses only with no leader.
        orders = [Control.from_bytes((await caps.next_msg(timeout=2)).data) for _ in range(2)]
        assert [(c.action, c.batch_cap) for c in orders] == [("set_batch_cap", 2)] * 2
        assert await revision("short") == 0  # closed: nothing to renew


async def test_a_scheduler_starting_after_an_outage_does_not_revive_a_stale_open_record(
    nats_config,
):
    """With every scheduler down for minutes, gateways and workers read the unrenewed open
    record as closed and the group served normally; a scheduler that then started restored
    it, turned it half-open at its first tick and diverted 75 % of the group's traffic
    again (long, with no fallback: 503s) until probes proved it healthy."""
    async with hand_driven(make_config(nats_config)) as (service, _):
        assert service.kv is not None
        wall_ms = int(time.time() * 1000)
        stale = BreakerRecord("open", since_ms=wall_ms - 300_000, reason="an old incident",
                              written_ms=wall_ms - 290_000)  # fmt: skip
        fresh = BreakerRecord("open", since_ms=wall_ms - 12_000, reason="a live incident",
                              written_ms=wall_ms - 2_000)  # fmt: skip
        await service.kv.put(breaker_key("long"), stale.to_bytes())
        await service.kv.put(breaker_key("short"), fresh.to_bytes())
        await service._load_breakers()
        assert service.breakers["long"].state == "closed"
        assert service.breakers["short"].state == "open"  # a leader renewed it: continued
        await service.tick()
        record = BreakerRecord.from_bytes((await service.kv.get(breaker_key("long"))).value)
        assert record is not None and record.state == "closed"  # set right, not revived
        assert service.breakers["long"].state == "closed" and not [
            t for t in service.acted if t.group == "long"
        ]


async def test_a_new_leader_continues_the_open_waits_backoff(nats_config):
    """The backoff lived in the old leader's memory: after a failover the new one waited
    10 s and probed a group still broken, and a rollout mid-incident reset it each time."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert service.kv is not None
        wall_ms = int(time.time() * 1000)
        fourth = BreakerRecord("open", since_ms=wall_ms - 1_000, reason="p99 over",
                               written_ms=wall_ms - 500, reopens=3)  # fmt: skip
        await service.kv.put(breaker_key("short"), fourth.to_bytes())
        await service._load_breakers()
        breaker = service.breakers["short"]
        first_wait = breaker.settings.wait_open_s  # 2 s here
        assert breaker.state == "open" and breaker.reopens == 3
        assert breaker.wait_s == min(8 * first_wait, breaker.settings.max_wait_open_s) > 4
        now[0] += first_wait + 1  # past a first spell, inside the fourth's
        await service.tick()
        assert breaker.state == "open"
        service.breakers["long"].restore("open", now[0], "an incident")
        await service.tick()
        record = BreakerRecord.from_bytes((await service.kv.get(breaker_key("short"))).value)
        assert record is not None and record.reopens == 3  # what the next leader reads


async def test_a_holder_whose_renewal_stalls_stops_acting_before_a_standby_can_take_over(
    nats_config, js
):
    from common.nats import ensure_kv

    kv = await ensure_kv(js, nats_config)
    now = [time.time()]
    lease = Lease(kv, "a", ttl_s=2.0, clock=lambda: now[0])
    assert await lease.refresh() and lease.valid()
    now[0] += 1.4  # no refresh came back since (a JetStream call hanging): 0.6 s left
    assert lease.held and lease.valid()
    now[0] += 0.2  # within the margin before the expiry it wrote: a standby's clock may be ahead
    assert lease.held and not lease.valid()
    assert await lease.refresh() and lease.valid()  # renewed: acting again


async def test_a_new_leader_takes_the_demand_history_from_the_bucket(
    nats_config, start_scheduler, monkeypatch
):
    """A standby learns no demand; taking over, it must not overwrite what the previous
    leader learnt with its own stale copy."""
    service = await start_scheduler("sched-a", make_config(nats_config))
    for task in service._tasks:
        task.cancel()
    await asyncio.gather(*service._tasks, return_exceptions=True)
    lease = service.lease
    answers = iter([False, True])

    async def refresh() -> bool:
        lease.held = next(answers)
        return lease.held

    monkeypatch.setattr(lease, "refresh", refresh)
    await service._refresh_lease()  # standby
    learnt = DemandHistory()
    learnt.observe(7.0, time.time(), alpha=0.5)
    await service.kv.put(HISTORY_PREFIX + "short", learnt.to_bytes())  # the other leader's
    await service._refresh_lease()  # leader
    assert service.histories["short"].to_bytes() == learnt.to_bytes()


async def test_a_leader_whose_lease_lapses_mid_tick_sends_and_writes_nothing_more(nats_config):
    """The lease is checked when a tick starts; its JetStream calls (5 s timeouts each) can
    outlast the 3 s lease, and a standby that took over meanwhile must not have the old
    leader still writing breaker records and ordering caps and moves."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        assert service.acts and service.nc is not None and service.lease is not None
        controls = await service.nc.subscribe(f"{service.subjects.prefix}.ctl.>")
        await barrier(service.nc)
        # Open long enough to probe: this tick would move it to half-open.
        service.breakers["long"].restore("open", now[0] - 3600, "an incident")
        first = next(iter(service.breakers))
        assert first != "long"
        real_tick = service.breakers[first].tick

        def lapse(at: float) -> object:
            assert service.lease is not None
            service.lease.current = None  # this tick's calls ran past the lease's expiry
            return real_tick(at)

        service.breakers[first].tick = lapse  # type: ignore[method-assign]
        await service.tick()
        # Not moved in memory only (its record, caps and alert unsent, undone by a reload).
        assert service.breakers["long"].state == "open" and not service.acted
        assert not service._unsaved
        await service._order_move(Move("w1", "short", "long", "test"))
        await service._publish(
            service.subjects.control_group("long"),
            Control(action="set_batch_cap", issued_ms=0, group="long", batch_cap=1, reason="x"),
        )
        with pytest.raises(nats.errors.TimeoutError):
            await controls.next_msg(timeout=0.3)
        assert not service.moves


async def test_what_the_leader_remembers_of_workers_and_actions_is_bounded(nats_config):
    """Caps sent to workers that stopped (deploys, moves) were kept for good, and every
    transition a flapping breaker made (~115k a week)."""
    from scheduler.service import RECENT_ACTIONS

    async with hand_driven(make_config(nats_config)) as (service, _):
        service._cap_sent["stopped-long-ago"] = 0.0
        await service.tick()
        assert "stopped-long-ago" not in service._cap_sent
        assert service.acted.maxlen == service.moves.maxlen == RECENT_ACTIONS


async def test_a_renewal_over_another_replicas_term_begins_a_new_one(nats_config, js):
    """A holder whose calls stalled (slow, not failing) past its expiry never saw itself
    lose the lease; renewing over the term another replica held meanwhile, it went on as
    if nothing had happened, with that term's breakers and cooldowns never loaded."""
    from common.nats import ensure_kv

    kv = await ensure_kv(js, nats_config)
    now = [1000.0]
    a = Lease(kv, "a", ttl_s=2.0, clock=lambda: now[0])
    b = Lease(kv, "b", ttl_s=2.0, clock=lambda: now[0])
    assert await a.refresh()
    first = a.term
    assert await a.refresh() and a.term == first  # a plain renewal: the same term
    now[0] += 3  # a stalls past its expiry; b takes over, then dies in turn
    assert await b.refresh() and b.held
    now[0] += 3
    assert a.held  # a never saw a failure
    assert await a.refresh() and a.term == first + 1


async def test_the_service_starts_afresh_when_its_lease_begins_a_new_term(
    nats_config, start_scheduler, monkeypatch
):
    service = await start_scheduler("sched-a", make_config(nats_config))
    assert service.is_leader
    for task in service._tasks:
        task.cancel()
    await asyncio.gather(*service._tasks, return_exceptions=True)
    lease = service.lease

    async def renewed_over_another_term() -> bool:
        lease.term += 1
        return True

    monkeypatch.setattr(lease, "refresh", renewed_over_another_term)
    service.desired["short"] = 3  # what this replica published in its earlier term
    await service._refresh_lease()
    assert service.desired == {} and service._leader_synced  # reset, then loaded again


async def test_a_renewal_whose_ack_was_lost_is_no_new_term(nats_config, js):
    """The write landed but its reply timed out: the next renewal found its own value under
    a revision it had not recorded, counted a new term, and the scheduler reset itself."""
    from common.nats import ensure_kv

    kv = await ensure_kv(js, nats_config)
    lease = Lease(kv, "a", ttl_s=2.0)
    assert await lease.refresh()
    term = lease.term
    real_update = kv.update

    async def lost_ack(*args, **kwargs):
        await real_update(*args, **kwargs)
        raise TimeoutError("reply lost")

    kv.update = lost_ack
    await lease.refresh()  # stored; the lease still counts as held until its expiry
    kv.update = real_update
    assert await lease.refresh() and lease.term == term


async def test_a_new_leader_opens_a_breaker_the_old_one_was_one_slow_sample_from_opening(
    nats_config, monkeypatch
):
    """A standby samples its windows but feeds no breaker; taking over, it started each
    closed breaker from an empty window, so a group already slow for the whole window went
    min_samples more ticks without a breaker (seconds of SLO misses after every failover)."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        lease = service.lease
        assert lease is not None
        renew = lease.refresh

        async def lost() -> bool:
            lease.held = False
            return False

        def slow_tick(done: int) -> Telemetry:
            return Telemetry(worker="w", group="short", ts_ms=0, state="serving", batch_cap=8,
                             e2e_p99_ms=900.0, samples=5, requests_done=done)  # fmt: skip

        monkeypatch.setattr(lease, "refresh", lost)
        await service._refresh_lease()
        assert not service.acts
        for done in (5, 10, 15):  # the minimum of samples, all over short's 400 ms
            now[0] += 0.25
            service.windows.observe(slow_tick(done), now[0])
            await service.tick()
        assert service.breakers["short"].state == "closed" and not service.acted
        monkeypatch.setattr(lease, "refresh", renew)
        await service._refresh_lease()  # the old leader is gone: a new term
        assert service.acts
        now[0] += 0.25
        service.windows.observe(slow_tick(20), now[0])
        await service.tick()
        assert service.breakers["short"].state == "open"


async def test_a_deposed_leaders_open_record_is_rewritten_closed_and_commands_carry_the_fence(
    nats_config,
):
    """A cut-off leader's queued 'open' landed over today's leader's closed breaker: nothing
    rewrote a closed record, so gateways diverted until it went stale and a later leader
    continued it. Today's leader reads closed records back and rewrites another's."""
    async with hand_driven(make_config(nats_config)) as (service, _):
        assert service.lease is not None and service.lease.fence > 0
        assert service.kv is not None and service.nc is not None
        controls = await service.nc.subscribe(f"{service.subjects.prefix}.ctl.>")
        await barrier(service.nc)
        stale = BreakerRecord("open", 0, "old incident", None, 4, "deposed", fence=1)
        await service.kv.put(breaker_key("short"), stale.to_bytes())
        await service.tick()
        record = BreakerRecord.from_bytes((await service.kv.get(breaker_key("short"))).value)
        assert record is not None and record.state == "closed"
        assert record.fence == service.lease.fence and record.scheduler == service.id
        await service._publish(
            service.subjects.control_group("long"),
            Control(action="set_batch_cap", issued_ms=1, group="long", batch_cap=1, reason="x"),
        )
        sent = Control.from_bytes((await controls.next_msg(timeout=2)).data)
        assert sent.fence == service.lease.fence


async def test_livez_answers_while_the_scheduler_is_still_connecting(nats_config):
    """/livez was served only once JetStream had answered: while a NATS cluster elected its
    leader (5 s a call), the probe port stayed closed and Kubernetes' liveness killed a
    start that would have succeeded. It answers first now, as the worker's does."""
    import socket

    from scheduler.service import SchedulerService

    silent = socket.socket()  # accepts, never speaks: the client waits for NATS's INFO
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = free_port()
    url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
    config = make_config(nats_config.model_copy(update={"url": url}), metrics_port=port)
    service = SchedulerService(config, scheduler_id="slow-start")
    starting = asyncio.create_task(service.start())
    try:

        def livez() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=2) as r:
                return r.read().decode()

        for _ in range(100):
            with contextlib.suppress(OSError):
                assert (await asyncio.to_thread(livez)).strip() == "ok"
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("/livez never answered while the scheduler connected")
        assert not starting.done()  # still connecting
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        silent.close()
    with pytest.raises(OSError):  # the failed start let its port go
        await asyncio.to_thread(livez)


async def test_a_new_leader_keeps_its_lease_through_a_sync_slower_than_the_lease(
    nats_config, monkeypatch
):
    """Taking over, a leader read its state from the bucket one key after another with no
    renewal: on a bucket slow enough that the reads outlasted the lease, the standby took
    the lease, began the same sync, lost it back the same way, and neither ever acted."""
    config = make_config(nats_config)  # lease: 1.5 s, renewed every 0.3 s
    async with hand_driven(config) as (service, _):
        lease, kv = service.lease, service.kv
        assert lease is not None and kv is not None
        rival = Lease(kv, "standby", config.scheduler.lease_ttl_s)
        renew, get = lease.refresh, kv.get

        async def lost() -> bool:
            lease.held = False
            return False

        async def slow_get(key: str, *args, **kwargs):  # type: ignore[no-untyped-def]
            if key != LEASE_KEY:
                await asyncio.sleep(0.9)  # two groups: the sync's reads take ~5 s in a row
            return await get(key, *args, **kwargs)

        monkeypatch.setattr(lease, "refresh", lost)
        await service._refresh_lease()  # a standby for a moment
        monkeypatch.setattr(lease, "refresh", renew)
        monkeypatch.setattr(kv, "get", slow_get)
        await rival.refresh()  # the lease is still the leader's: no
        taking = asyncio.create_task(service._refresh_lease())  # a new term, its sync slow
        rival_held = []
        while not taking.done():
            await asyncio.sleep(0.3)
            rival_held.append(await rival.refresh())
        await taking
        assert service.acts and not any(rival_held)


async def test_a_closed_record_read_back_across_a_new_term_is_not_rewritten(nats_config):
    """The read-back of a closed breaker's record awaited the bucket while the lease's task
    began a new term, dropped what was queued and took up another leader's open record:
    the read-back then queued "closed" over it anyway (and alerted the incident resolved)."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        lease, kv = service.lease, service.kv
        assert lease is not None and kv is not None
        other = BreakerRecord("open", 0, "slow", None, 4, "other", fence=lease.fence + 1)
        get = kv.get

        async def read_across_a_new_term(key: str, *args, **kwargs):  # type: ignore[no-untyped-def]
            if key == breaker_key("short"):
                await kv.put(key, other.to_bytes())  # the other leader's, meanwhile
                lease.term += 1  # renewed over it: a new term, synced from the bucket
                service._drop_unsaved()
            return await get(key, *args, **kwargs)

        kv.get = read_across_a_new_term  # type: ignore[method-assign]
        try:
            await service._heal_closed_records(now[0] + BREAKER_RENEW_S + 1)
        finally:
            kv.get = get  # type: ignore[method-assign]
        assert "short" not in service._unsaved
