"""Which finished requests a worker keeps for a resync with a gateway that was cut off."""

from __future__ import annotations

import types
from typing import Any

import pytest

from common.protocol import GenerateRequest, ResumeReply
from common.subjects import Subjects
from tests.workers.conftest import new_id
from workers import resync as resync_module
from workers.orphans import GatewayWatch
from workers.outbox import Flight
from workers.resync import KEEP_S, Resync


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _flight(rid: str) -> Flight:
    req = GenerateRequest(id=rid, group="short", reply=f"_INBOX.{rid}", origin="gw-a")
    return Flight(req, msg=None, attempt=1, start=0.0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(resync_module.time, "monotonic", c)
    return c


def _setup(clock: Clock) -> tuple[Resync, GatewayWatch, types.SimpleNamespace]:
    watch = GatewayWatch(orphan_after_s=10.0, clock=clock)
    resync = Resync(Subjects(), "w0", 1 << 20, origin_silent_s=watch.silent_s)
    nc = types.SimpleNamespace(stats={"reconnects": 0}, is_connected=True)  # the worker's link
    return resync, watch, nc


def _tick_until(resync: Resync, nc: object, clock: Clock, until: float, step: float = 0.5) -> None:
    while clock.now < until:
        clock.now = min(until, clock.now + step)
        resync.tick(nc, [])  # type: ignore[arg-type]


def test_a_stale_beat_after_a_cut_does_not_drop_streams_finished_during_it(clock: Clock) -> None:
    """The gateway is cut off at t=0; its streams finish at t=0.3; it is back at t=2.8 and
    a beat it queued during the cut (old reconnect count) arrives before the one with the
    new count. The finished streams must still be there for that second beat."""
    resync, watch, nc = _setup(clock)
    t0 = clock.now
    watch.heard("gw-a", 0)
    clock.now = t0 + 0.3
    flights = [_flight(f"r{i}") for i in range(3)]
    for st in flights:
        resync.finished(st)
    _tick_until(resync, nc, clock, t0 + 2.8)  # quiet for > 2 s: kept
    assert watch.heard("gw-a", 0) is False  # the stale beat: alive, no news
    _tick_until(resync, nc, clock, t0 + 3.1)  # the streams are now > 2 s old
    assert {st.request.id for st in resync._flights([])} == {"r0", "r1", "r2"}
    assert watch.heard("gw-a", 1) is True  # the news: a resync of all three follows


def test_finished_streams_of_a_gateway_that_stays_heard_are_dropped_after_keep_s(
    clock: Clock,
) -> None:
    resync, watch, nc = _setup(clock)
    t0 = clock.now
    st = _flight("r0")
    resync.finished(st)
    while clock.now < t0 + KEEP_S - 0.5:
        watch.heard("gw-a", 0)
        _tick_until(resync, nc, clock, clock.now + 0.2, step=0.2)
    assert len(resync._flights([])) == 1  # kept: its caller may still ask for a resync
    while clock.now < t0 + KEEP_S + 1.0:
        watch.heard("gw-a", 0)
        _tick_until(resync, nc, clock, clock.now + 0.2, step=0.2)
    assert resync._flights([]) == []


def test_streams_of_a_gateway_that_never_returns_go_after_the_window(clock: Clock) -> None:
    resync, watch, nc = _setup(clock)
    t0 = clock.now
    watch.heard("gw-a", 0)
    resync.finished(_flight("r0"))
    _tick_until(resync, nc, clock, t0 + 9.0)
    assert len(resync._flights([])) == 1
    _tick_until(resync, nc, clock, t0 + 10.5)
    assert resync._flights([]) == []


async def test_a_caller_whose_gateway_beats_is_asked_again_after_a_silent_query(
    nc: Any, subjects: Subjects
) -> None:
    """After a NATS restart every worker resyncs at once and a gateway's loop runs late:
    one silent query used to end the resync for good (a gateway that has everything answers
    closed), leaving its client a gap or no final chunk until the deadline."""
    beats = {"gw-a": 0.1}  # seconds since its last heartbeat
    resync = Resync(subjects, "w0", 1 << 20, timeout_s=0.2, window_s=5.0,
                    origin_silent_s=lambda origin: beats.get(origin, 99.0))  # fmt: skip
    st = _flight(new_id())
    asked: list[int] = []

    async def late_then_answers(msg: Any) -> None:
        asked.append(1)
        if len(asked) > 1:  # the first query finds its loop busy
            await msg.respond(ResumeReply(id=st.request.id, token_ids=[4, 5]).to_bytes())

    await nc.subscribe(subjects.resume(st.request.id), cb=late_then_answers)
    reply = await resync._ask(nc, st)
    assert reply is not None and reply.token_ids == [4, 5] and len(asked) == 2
    beats["gw-a"] = 60.0  # a gateway gone quiet: its silence is an answer
    asked.clear()
    assert await resync._ask(nc, st) is None and len(asked) == 1


async def test_a_flight_whose_caller_answers_closed_is_reported_to_be_aborted(
    nc: Any, subjects: Subjects
) -> None:
    """Cut off, the worker missed the abort its gateway sent (core NATS); the resync after
    the reconnect heard "closed" and only stopped re-sending, while the request went on
    generating for nobody until max_tokens or its deadline. The worker is told now."""
    closed: list[Flight] = []
    resync = Resync(subjects, "w0", 1 << 20, timeout_s=0.5, window_s=2.0, on_closed=closed.append)
    st, other = _flight(new_id()), _flight(new_id())

    async def answer(msg: Any) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        await msg.respond(ResumeReply(id=rid, closed=rid == st.request.id).to_bytes())

    for flight in (st, other):
        await nc.subscribe(subjects.resume(flight.request.id), cb=answer)
    await resync._resync(nc, st)
    await resync._resync(nc, other)
    assert closed == [st]


def test_streams_of_a_gateway_cut_off_past_the_orphan_threshold_wait_for_its_return(
    clock: Clock,
) -> None:
    """Cut off for 50 s, the gateway's requests were aborted here as orphans (their abort
    chunks lost). Forgotten after the 10 s window, they could not be resynced when it came
    back, and its clients waited for their deadlines; now they are kept while it stays
    quiet (up to quiet_keep_s), and a window past its return."""
    watch = GatewayWatch(orphan_after_s=10.0, clock=clock)
    resync = Resync(Subjects(), "w0", 1 << 20, origin_silent_s=watch.silent_s,
                    quiet_keep_s=watch.forget_after_s)  # fmt: skip
    nc = types.SimpleNamespace(stats={"reconnects": 0}, is_connected=True)
    t0 = clock.now
    watch.heard("gw-a", 0)
    clock.now = t0 + 10.5
    resync.finished(_flight("r0"))  # the reaper's abort chunk, published into the void
    _tick_until(resync, nc, clock, t0 + 50.0)
    assert [st.request.id for st in resync._flights([])] == ["r0"]
    assert watch.heard("gw-a", 0) is False  # a beat it queued while cut off
    _tick_until(resync, nc, clock, t0 + 51.0)
    assert watch.heard("gw-a", 1) is True  # back: the worker resyncs what it kept
    assert [st.request.id for st in resync._flights([])] == ["r0"]
    while clock.now < t0 + 62.0:
        watch.heard("gw-a", 1)
        _tick_until(resync, nc, clock, clock.now + 0.5)
    assert resync._flights([]) == []  # and forgets it once the gateway stays heard
    resync.finished(_flight("r1"))
    watch_silent_until = clock.now + watch.forget_after_s + 5
    _tick_until(resync, nc, clock, watch_silent_until)
    assert resync._flights([]) == []  # a gateway that never returns: bounded
