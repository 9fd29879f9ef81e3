"""workers.orphans.GatewayWatch: who is silent, what does not count as silence, and who reconnected."""

from __future__ import annotations

from typing import Any

from common.config import Config
from common.protocol import heartbeat_payload, heartbeat_reconnects
from workers.orphans import GatewayWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_request_is_orphaned_once_its_gateway_is_silent_past_the_threshold() -> None:
    clock = Clock()
    watch = GatewayWatch(5.0, clock)
    watch.heard("gw-a")
    clock.now += 4.9
    assert not watch.orphaned("gw-a")
    watch.heard("gw-b")
    clock.now += 0.2
    assert watch.orphaned("gw-a") and not watch.orphaned("gw-b")
    assert round(watch.silent_s("gw-a"), 6) == 5.1
    watch.heard("gw-a")  # back (a partition healed): not orphaned any more
    assert not watch.orphaned("gw-a")


def test_requests_from_nats_clients_and_a_disabled_watch_are_never_orphaned() -> None:
    clock = Clock()
    watch = GatewayWatch(5.0, clock)
    clock.now += 60
    assert not watch.orphaned("")  # no origin: a NATS-native caller, no heartbeat to expect
    off = GatewayWatch(0.0, clock)
    clock.now += 60
    assert not off.enabled and not off.orphaned("gw-a")


def test_a_gateway_never_heard_gets_the_threshold_from_when_the_worker_started_listening() -> None:
    clock = Clock()
    watch = GatewayWatch(5.0, clock)
    clock.now += 3
    assert not watch.orphaned("gw-unknown")
    clock.now += 3
    assert watch.orphaned("gw-unknown")


def test_silence_while_the_worker_itself_is_cut_off_does_not_count() -> None:
    clock = Clock()
    watch = GatewayWatch(5.0, clock)
    watch.heard("gw-a")
    for _ in range(20):  # a 10 s NATS outage, seen from this worker's ticker
        clock.now += 0.5
        watch.cut_off()
    clock.now += 4.0  # reconnected 4 s ago; the gateway has not reconnected yet
    assert not watch.orphaned("gw-a")
    clock.now += 1.5
    assert watch.orphaned("gw-a")


def test_gateways_long_gone_are_forgotten() -> None:
    clock = Clock()
    watch = GatewayWatch(1.0, clock)
    watch.heard("gw-old")
    clock.now += 5
    watch.heard("gw-new")
    clock.now += 6  # gw-old silent 11 s (> 10 thresholds), gw-new 6 s
    watch.forget_stale()
    assert watch.known() == ["gw-new"]


def test_a_new_reconnect_count_is_news_a_repeated_one_is_not() -> None:
    watch = GatewayWatch(10.0, Clock())
    assert not watch.heard("gw-a", 0)  # first heard, never reconnected: no news
    assert not watch.heard("gw-a", 0)
    assert not watch.heard("gw-a", None)  # an old gateway's empty beat: no news either
    assert watch.heard("gw-a", 1)
    assert not watch.heard("gw-a", 1)
    # First heard after a reconnect (a worker that joined just before the gateway's link
    # dropped heard no beat until it was back): news, its streams here are resynced.
    assert watch.heard("gw-b", 3)
    assert not watch.heard("gw-b", 3)  # counts are per gateway
    assert watch.heard("gw-b", 4) and not watch.heard("gw-a", 1)


def test_heartbeat_payload_round_trip_and_junk() -> None:
    assert heartbeat_reconnects(heartbeat_payload(0)) == 0
    assert heartbeat_reconnects(heartbeat_payload(12345)) == 12345
    for junk in (b"", b"-1", b"1.5", b"\xff", b"9" * 13, b" 3"):
        assert heartbeat_reconnects(junk) is None


async def test_gateways_long_gone_are_forgotten_with_orphan_detection_off_too(
    start_worker: Any, worker_config: Config
) -> None:
    """Heartbeats are still heard for resyncs with worker.orphan_after_s 0: every gateway
    process id ever started stayed on every worker."""
    off = worker_config.worker.model_copy(update={"orphan_after_s": 0.0})
    service = await start_worker(config=worker_config.model_copy(update={"worker": off}))
    assert not service._gateways.enabled
    service._gateways._seen["gw-gone"] = -1e9  # heard long ago, listening since
    service._gateways._listening_since = -1e9
    service._reap_orphans()
    assert "gw-gone" not in service._gateways.known()


async def test_a_queued_request_of_a_dead_gateway_is_ended_unserved_with_an_abort(
    start_worker: Any, worker_config: Config, nc: Any, subjects: Any
) -> None:
    """A gateway that died could not delete its queued requests: each was loaded into the
    engine and prefilled, for nobody, until the reaper's next tick. It is now ended at
    once, as the reaper ends one (an abort chunk a gateway that only was cut off hears when
    it is back), and never reaches the engine."""
    import asyncio

    from common.protocol import Chunk, GenerateRequest, RequestParams
    from tests.workers.conftest import new_id

    worker = worker_config.worker.model_copy(update={"orphan_after_s": 0.3})
    service = await start_worker(config=worker_config.model_copy(update={"worker": worker}))
    service._gateways.heard("gw-dead")  # beat, and died...
    await asyncio.sleep(0.5)  # ... silent past the threshold by now
    added: list[str] = []
    real_add = service.bridge.add
    service.bridge.add = lambda cmd: (added.append(cmd.request_id), real_add(cmd))[1]
    rid = new_id()
    req = GenerateRequest(
        id=rid, group="short", reply=subjects.out(rid), prompt_token_ids=[1, 2],
        params=RequestParams(max_tokens=50), origin="gw-dead",
    )  # fmt: skip
    chunks = await nc.subscribe(subjects.out(rid))
    await nc.jetstream().publish(
        subjects.request("short"), req.to_bytes(), headers={"Nats-Msg-Id": rid}
    )
    final = Chunk.from_bytes((await chunks.next_msg(timeout=5)).data)
    assert (final.finish_reason, final.token_ids) == ("abort", [])
    assert added == []
    assert not service._gateways.gone("gw-unheard")  # maybe new: its first beat not here yet


def test_a_gateway_forgotten_for_its_silence_is_still_known_to_be_gone() -> None:
    """Forgotten after ten thresholds (bounded memory), a dead gateway's still-queued
    requests (deadlines may be a day off) were prefilled for nobody again."""
    clock = Clock()
    watch = GatewayWatch(1.0, clock)
    watch.heard("gw-dead")
    clock.now += 11
    watch.forget_stale()
    assert watch.known() == [] and watch.gone("gw-dead")
    watch.heard("gw-dead")  # it was only cut off, and is back: not gone
    assert not watch.gone("gw-dead")


def test_a_worker_back_from_a_long_outage_forgets_no_gateway_for_it() -> None:
    """Silence while the worker was cut off does not count towards forgetting either: a
    live gateway forgotten at the reconnect had its requests, fetched before its next beat,
    aborted as a dead gateway's."""
    clock = Clock()
    watch = GatewayWatch(1.0, clock)
    watch.heard("gw-live")
    for _ in range(300):  # 150 s cut off, the reaper ticking
        clock.now += 0.5
        watch.cut_off()
    clock.now += 0.5  # the first connected tick
    watch.forget_stale()
    assert watch.known() == ["gw-live"] and not watch.gone("gw-live")
    clock.now += 1.5  # still silent, now past the threshold since the reconnect: gone
    assert watch.gone("gw-live")
