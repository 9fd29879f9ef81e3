"""Breaker alerts say what took effect: a transition once its record is stored, and the end
of an open spell whose record went stale or was another leader's."""

from __future__ import annotations

import time
from typing import Any

import pytest

import common.nats as qnats
from common.protocol import Telemetry
from scheduler.records import BREAKER_RENEW_S, BreakerRecord, breaker_key
from scheduler.service import STALE_RECORD_REASON, SchedulerService
from tests.scheduler.conftest import hand_driven, make_config


def slow_report(done: int) -> Telemetry:
    """short over its 400 ms threshold."""
    return Telemetry(worker="w", group="short", ts_ms=0, state="serving", batch_cap=8,
                     e2e_p99_ms=900.0, samples=5, requests_done=done)  # fmt: skip


def recorded(service: SchedulerService, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(service.alerter, "breaker", sent.append)
    return sent


def breaker_writes_fail(service: SchedulerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``breaker.*`` write times out (a JetStream leader election)."""
    assert service.kv is not None
    real_put = service.kv.put

    async def put(key: str, value: bytes, *args: Any, **kwargs: Any) -> int:
        if key.startswith("breaker."):
            raise TimeoutError("JetStream timed out")
        return await real_put(key, value, *args, **kwargs)

    monkeypatch.setattr(service.kv, "put", put)


async def lose_the_lease(service: SchedulerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease is lost at the next refresh, which runs now."""
    assert service.lease is not None

    async def lost() -> bool:
        assert service.lease is not None
        service.lease.held = False
        return False

    monkeypatch.setattr(service.lease, "refresh", lost)
    await service._refresh_lease()


async def open_short(service: SchedulerService, now: list[float]) -> None:
    for done in (5, 10, 15):  # the minimum of samples, all slow
        now[0] += 0.25
        service.windows.observe(slow_report(done), now[0])
        await service.tick()


async def test_a_transition_whose_record_was_never_stored_sends_no_alert(nats_config, monkeypatch):
    """The alert went out as the breaker moved, stored or not: a record whose write failed
    until the lease went was dropped, the breaker reloaded closed, and the webhook had a
    closed -> open that never took effect and never got its close."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        sent = recorded(service, monkeypatch)
        breaker_writes_fail(service, monkeypatch)
        await open_short(service, now)
        assert service.breakers["short"].state == "open" and "short" in service._unsaved
        assert sent == []
        await lose_the_lease(service, monkeypatch)
        assert service.breakers["short"].state == "closed"  # the bucket's word
        assert sent == [] and not service._unsaved


async def test_a_record_stored_whose_acknowledgement_was_lost_still_gets_its_alert(
    nats_config, monkeypatch
):
    """The put reached the server, its answer did not, and the lease went: the bucket holds
    the open record (traffic is diverted) but the alert was dropped with the unsaved ones."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        sent = recorded(service, monkeypatch)
        assert service.kv is not None
        real_put = service.kv.put

        async def stored_then_timed_out(key: str, value: bytes, *a: Any, **kw: Any) -> int:
            revision = await real_put(key, value, *a, **kw)
            if key.startswith("breaker."):
                raise TimeoutError("JetStream timed out")
            return revision

        with monkeypatch.context() as acking:
            acking.setattr(service.kv, "put", stored_then_timed_out)
            await open_short(service, now)
            assert sent == [] and "short" in service._unsaved
            await lose_the_lease(service, acking)
        assert service.breakers["short"].state == "open"  # the bucket's word: stored
        assert [(e["from"], e["to"]) for e in sent] == [("closed", "open")]


async def test_an_alert_goes_once_its_record_is_stored(nats_config, monkeypatch):
    async with hand_driven(make_config(nats_config)) as (service, now):
        sent = recorded(service, monkeypatch)
        with monkeypatch.context() as failing:
            breaker_writes_fail(service, failing)
            await open_short(service, now)
        assert sent == []
        await service.tick()  # the write is retried, and lands
        assert service.kv is not None
        stored = BreakerRecord.from_bytes((await service.kv.get(breaker_key("short"))).value)
        assert stored is not None and stored.state == "open"
        assert [(a["group"], a["from"], a["to"]) for a in sent] == [("short", "closed", "open")]
        await service.tick()
        assert len(sent) == 1


async def test_a_stale_open_record_read_as_closed_gets_its_resolving_alert(
    nats_config, js, monkeypatch
):
    """Every scheduler was down while long's breaker was open: its opening was alerted,
    and a scheduler starting later read the unrenewed record as closed without a word, so
    the alert stayed open for good."""
    kv = await qnats.ensure_kv(js, nats_config)
    wall_ms = int(time.time() * 1000)
    stale = BreakerRecord("open", since_ms=wall_ms - 300_000, reason="an old incident",
                          scheduler="gone", written_ms=wall_ms - 290_000)  # fmt: skip
    await kv.put(breaker_key("long"), stale.to_bytes())
    async with hand_driven(make_config(nats_config)) as (service, now):
        sent = recorded(service, monkeypatch)
        assert service.breakers["long"].state == "closed"
        for _ in range(3):
            await service.tick()
            now[0] += BREAKER_RENEW_S
        assert [(a["group"], a["from"], a["to"], a["reason"]) for a in sent] == [
            ("long", "open", "closed", STALE_RECORD_REASON)
        ]
        # Stamped when it resolved, after the opening it resolves (a receiver ordering by
        # time kept an earlier-stamped close behind the open).
        assert sent[0]["ts_ms"] > stale.since_ms and sent[0]["ts_ms"] >= wall_ms
        record = BreakerRecord.from_bytes((await kv.get(breaker_key("long"))).value)
        assert record is not None and record.state == "closed"


async def test_a_record_acknowledged_after_the_lease_went_is_alerted_once(nats_config, monkeypatch):
    """The lease went while a breaker write was in flight: the reload found the record
    stored and sent its alert, then the write's acknowledgement sent it again (a duplicate
    page)."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        sent = recorded(service, monkeypatch)
        assert service.kv is not None
        real_put = service.kv.put

        async def lease_lost_during_the_write(key: str, value: bytes, *a: Any, **kw: Any) -> int:
            revision = await real_put(key, value, *a, **kw)
            if key.startswith("breaker."):
                await lose_the_lease(service, monkeypatch)  # reloads: finds the record
            return revision

        monkeypatch.setattr(service.kv, "put", lease_lost_during_the_write)
        await open_short(service, now)
        assert service.breakers["short"].state == "open"  # the bucket's word: stored
        assert [(e["from"], e["to"]) for e in sent] == [("closed", "open")]
