"""Admission: 429 when a group is full, 503 when nobody serves it, fallbacks, breakers."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import httpx
import msgpack
import pytest

from common.config import Config, NatsConfig, SchedulerConfig
from common.errors import ContextLengthExceededError, RateLimitError, ServiceUnavailableError
from common.nats import connect
from common.protocol import Telemetry
from gateway.admission import Admission, Route
from gateway.classifier import classify
from gateway.workers_view import BREAKER_STALE_S, WorkersView, decode_breaker
from scheduler.records import BREAKER_RENEW_S
from tests.gateway.conftest import MODEL, gateway_config, serve, until_live
from tests.gateway.fake_worker import echo_alphabet, running_worker

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 6}


def _report(
    group: str, worker: str = "w", state: str = "serving", max_seq_len: int | None = None
) -> Telemetry:
    return Telemetry(worker=worker, group=group, ts_ms=0, state=state, max_seq_len=max_seq_len)  # type: ignore[arg-type]


def _all_live(config: Config) -> WorkersView:
    """A view in which every group of ``config`` has a serving worker."""
    view = WorkersView(config.groups)
    for group in config.groups:
        view.on_telemetry(_report(group))
    return view


async def test_saturated_group_answers_429_with_retry_after(nats_config: NatsConfig):
    slow = functools.partial(echo_alphabet, delay_s=0.4)
    config = gateway_config(nats_config, short__max_pending=2)
    async with (
        serve(config) as gw,
        running_worker(nats_config, "short", behaviour=slow),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        # Else all three wait for its first report, and the third finds no waiting slot
        # with no worker live: a 503 (the slots are for admitted requests then).
        await until_live(http, "short")
        responses = await asyncio.gather(
            *(http.post("/v1/completions", json=BODY) for _ in range(3))
        )
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 200, 429]
        shed = next(r for r in responses if r.status_code == 429)
        assert shed.json()["error"]["type"] == "rate_limit_error"
        assert int(shed.headers["Retry-After"]) >= 1
        # Slots come back: the group admits again once the two finished.
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        health = (await http.get("/health")).json()
        assert health["groups"]["short"]["in_flight"] == 0


async def test_group_without_worker_answers_503_after_a_short_wait(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config), admission_wait_s=0.3) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        started = time.monotonic()
        response = await http.post("/v1/completions", json=BODY)
        waited = time.monotonic() - started
    assert response.status_code == 503 and "Retry-After" in response.headers
    assert response.json()["error"]["code"] == "service_unavailable"
    assert 0.25 <= waited < 2.0


async def test_a_wait_for_a_worker_cut_by_the_clients_deadline_is_a_504(nats_config: NatsConfig):
    """It was a 503, which the openai client retries automatically, into the same deadline
    each time; a 504 carries x-should-retry: false."""
    async with (
        serve(gateway_config(nats_config), admission_wait_s=2.0) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        response = await http.post(
            "/v1/completions", json=BODY, headers={"X-QoS-Deadline-Ms": "300"}
        )
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"


async def test_request_waits_for_a_worker_that_appears(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config), admission_wait_s=3.0) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        headers = {"X-QoS-Deadline-Ms": "5000"}
        pending = asyncio.create_task(http.post("/v1/completions", json=BODY, headers=headers))
        await asyncio.sleep(0.3)
        assert not pending.done()
        async with running_worker(nats_config, "short") as worker:
            response = await pending
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "abcdef"
    # The worker's deadline is what is left of the request's, not 5 s from the publish.
    sent = worker.jobs[0].request
    assert sent.deadline_ms is not None and sent.deadline_ms - sent.created_ms <= 5000 - 250


async def test_fallback_serves_a_group_without_workers(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as short,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        response = await http.post("/v1/realtime/completions", json=BODY)
        metrics = (await http.get("/metrics")).text
    assert response.status_code == 200
    assert response.headers["X-QoS-Group"] == "short"
    assert response.headers["X-QoS-Fallback-From"] == "realtime"
    assert len(short.jobs) == 1 and short.jobs[0].request.group == "short"
    assert (
        'qos_gateway_fallbacks_total{from_group="realtime",reason="no_worker",to_group="short"} 1.0'
        in metrics
    )


async def test_open_breaker_sends_new_requests_to_the_fallback(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as short,
        running_worker(nats_config, "long") as long,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        nc = await connect(nats_config, "test-scheduler")
        kv = await nc.jetstream().key_value(nats_config.kv_bucket)
        try:
            await kv.put("breaker.short", json.dumps({"state": "open", "reason": "p99"}).encode())
            await _until(lambda: gw.app.state.gateway.view.breaker("short") == "open")
            opened = await http.post("/v1/completions", json=BODY)
            await kv.put("breaker.long", msgpack.packb({"state": "open"}))
            await _until(lambda: gw.app.state.gateway.view.breaker("long") == "open")
            nowhere = await http.post("/v1/completions", json=BODY)
            await kv.delete("breaker.short")
            await _until(lambda: gw.app.state.gateway.view.breaker("short") == "closed")
            closed = await http.post("/v1/completions", json=BODY)
        finally:
            await nc.close()
    assert opened.status_code == 200 and opened.headers["X-QoS-Group"] == "long"
    assert opened.headers["X-QoS-Fallback-From"] == "short"
    assert nowhere.status_code == 503  # short open, its fallback long open too
    assert closed.status_code == 200 and closed.headers["X-QoS-Group"] == "short"
    assert (len(short.jobs), len(long.jobs)) == (1, 1)


async def test_a_missing_request_stream_is_503_with_retry_after(nats_config: NatsConfig):
    """JetStream restarting (or the stream deleted) answers "no stream" to a publish: a 503
    the client retries, not a 500."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short"),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await _until(lambda: gw.app.state.gateway.view.live_workers("short") == 1)
        nc = await connect(nats_config, "test-ops")
        try:
            await nc.jetstream().delete_stream(nats_config.stream)
            response = await http.post("/v1/completions", json=BODY)
        finally:
            await nc.close()
    assert response.status_code == 503, response.text
    assert "Retry-After" in response.headers
    assert "queue" in response.json()["error"]["message"]


async def test_worker_that_stops_reporting_is_no_longer_live(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config), live_window_s=0.5, admission_wait_s=0.2) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        async with running_worker(nats_config, "short", telemetry_s=0.1):
            await _until(lambda: gw.app.state.gateway.view.live_workers("short") == 1)
            health = (await http.get("/health")).json()
        await asyncio.sleep(0.7)
        response = await http.post("/v1/completions", json=BODY)
    assert health["status"] == "ok" and health["groups"]["short"]["live_workers"] == 1
    assert response.status_code == 503


# -- without NATS: the decision itself ------------------------------------------------------


async def test_draining_worker_takes_no_new_requests():
    view = WorkersView(["short"])
    view.on_telemetry(_report("short"))
    assert view.is_live("short")
    view.on_telemetry(_report("short", state="draining"))
    assert not view.is_live("short")


async def test_workers_silent_for_many_windows_are_forgotten():
    """A crashed worker sends no last report: it stayed in the view for good, walked by
    every request's liveness check."""
    from gateway.workers_view import FORGET_AFTER_WINDOWS

    now = [0.0]
    view = WorkersView(["short"], live_window_s=1.0, clock=lambda: now[0])
    view.on_telemetry(_report("short", worker="crashed", max_seq_len=64))
    now[0] = FORGET_AFTER_WINDOWS + 1.0
    view.on_telemetry(_report("short", worker="alive"))
    assert list(view._serving["short"]) == ["alive"] and "crashed" not in view._seq_lens["short"]
    assert view.live_workers("short") == 1


async def test_half_open_breaker_admits_its_share_and_passes_the_rest_on():
    config = Config()
    view = _all_live(config)
    view.set_breaker("short", "half_open")  # default half_open_share = 0.25
    admission = Admission(config, view)
    routes = [await admission.admit("short", 10, 1.0) for _ in range(8)]
    assert [r.group for r in routes].count("short") == 2
    assert {r.reason for r in routes if r.is_fallback} == {"breaker_half_open"}


async def test_a_half_open_group_with_nowhere_to_fall_back_admits_only_its_share():
    """Asked again after the wait for a live worker (which returns at once: the group is
    live), the request must not take a second turn: the probe share would double."""
    config = Config()
    view = _all_live(config)
    view.set_breaker("long", "half_open")  # long has no fallback; share 0.25
    admission = Admission(config, view, wait_s=0.01)
    admitted = 0
    for _ in range(8):
        try:
            route = await admission.admit("long", 10, 1.0)
        except ServiceUnavailableError:
            continue
        admitted += 1
        admission.release(route)
    assert admitted == 2


async def test_requests_the_half_open_group_could_not_serve_spend_none_of_its_turns():
    config = Config()
    view = _all_live(config)
    view.set_breaker("short", "half_open")
    view.set_breaker("realtime", "open")
    admission = Admission(config, view)
    too_long = config.groups["short"].max_seq_len + 1  # served by the long fallback
    for _ in range(3):  # realtime falls back to short, then long: too long for short
        route = await admission.admit("realtime", too_long, 1.0)
        assert route.group == "long"
        admission.release(route)
    routes = [await admission.admit("short", 10, 1.0) for _ in range(4)]
    # Its turns start where they would have: the fourth of its own requests (share 0.25).
    assert [r.group == "short" for r in routes] == [False, False, False, True]


async def test_waiting_requests_count_against_max_pending():
    config = gateway_config(NatsConfig(), short__max_pending=1)
    admission = Admission(config, WorkersView(config.groups), wait_s=2.0)
    waiting = asyncio.create_task(admission.admit("short", 10, 5.0))
    await asyncio.sleep(0.05)
    assert admission.in_flight("short") == 1  # the waiter holds its slot
    # Refused at once, not queued behind it; no worker is the news (503), not a full group.
    started = time.monotonic()
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("short", 10, 5.0)
    assert time.monotonic() - started < 1.0  # not after a wait of its own (wait_s 2.0)
    with pytest.raises(ServiceUnavailableError):
        await waiting
    assert admission.in_flight("short") == 0


async def test_a_breaker_that_closes_while_a_request_waits_serves_it_at_the_wait_s_end():
    """Only workers coming live wake a wait: short's breaker closing meanwhile (its
    fallback, long, has no worker) left the request to a 503 when its wait ran out."""
    config = gateway_config(NatsConfig())
    view = WorkersView(config.groups)
    view.on_telemetry(_report("short"))
    view.set_breaker("short", "open")
    admission = Admission(config, view, wait_s=0.4)
    waiting = asyncio.create_task(admission.admit("short", 10, 5.0))
    await asyncio.sleep(0.1)
    view.set_breaker("short", "closed")
    route = await waiting
    assert route.group == "short" and admission.in_flight("short") == 1


async def test_a_full_group_that_cannot_serve_the_request_is_a_503_not_a_429():
    """A 429 says "come back shortly": not for a request no live group takes at its length
    (short's workers serve 100 tokens now, long has none), which no retry would change."""
    config = gateway_config(NatsConfig(), short__max_pending=1)
    view = WorkersView(config.groups)
    view.on_telemetry(_report("short", max_seq_len=100))
    admission = Admission(config, view, wait_s=0.1)
    held = await admission.admit("short", 10, 5.0)  # short is full now
    assert held.group == "short"
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("short", 200, 5.0)


async def test_a_waiter_does_not_count_against_its_own_half_open_probe():
    """Waiting, a request holds a slot of its group: when the group came back half-open
    with one slot left, that slot was the request's own, and the group read as full."""
    config = gateway_config(NatsConfig(), short__max_pending=2)
    share = config.groups["short"].breaker.model_copy(update={"half_open_share": 1.0})
    config.groups["short"] = config.groups["short"].model_copy(update={"breaker": share})
    view = WorkersView(config.groups)
    view.set_breaker("short", "half_open")
    admission = Admission(config, view, wait_s=2.0)
    admission._in_flight["short"] = 1  # another request of short's, in flight
    waiting = asyncio.create_task(admission.admit("short", 10, 5.0))
    await asyncio.sleep(0.1)
    view.on_telemetry(_report("short"))  # its worker is back, the breaker half-open
    route = await asyncio.wait_for(waiting, 1.0)
    assert route.group == "short"


@pytest.mark.parametrize(
    ("value", "state"),
    [
        (b'{"state": "open"}', "open"),
        (msgpack.packb({"state": "half_open", "since": 1}), "half_open"),
        (b'{"state": "melted"}', "closed"),
        (b"\xc1garbage", "closed"),
        (None, "closed"),
    ],
)
def test_breaker_values_decode_and_anything_unreadable_is_closed(value, state):
    assert decode_breaker(value) == state


async def _until(condition, timeout_s: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def test_an_open_breaker_no_scheduler_renews_reads_as_closed_until_written_again(caplog):
    """A scheduler that died with a breaker open must not keep the group out of service: the
    leader rewrites open records every BREAKER_RENEW_S, so one unrenewed for the stale limit
    was left behind."""
    now = [0.0]
    view = WorkersView(["long"], breaker_stale_s=30.0, clock=lambda: now[0])
    view.set_breaker("long", "open")
    now[0] = 30.0
    assert view.breaker("long") == "open"
    now[0] = 30.5
    assert view.breaker("long") == "closed" and view.breakers() == {"long": "closed"}
    assert "not renewed" in caplog.text
    view.set_breaker("long", "open")  # a scheduler is back and rewrites it
    assert view.breaker("long") == "open"
    view.set_breaker("long", "closed")
    now[0] = 1e6
    assert view.breaker("long") == "closed"


def test_the_stale_limit_leaves_room_for_renewals_and_a_leader_handover():
    assert 3 * BREAKER_RENEW_S + SchedulerConfig().lease_ttl_s <= BREAKER_STALE_S


def test_a_replayed_open_record_ages_from_when_the_server_stored_it() -> None:
    """A gateway that starts long after the scheduler died replays the record it left: it
    must be stale at once, not open for another 30 s from the replay."""
    import datetime

    now = 1_000_000.0
    view = WorkersView(["long"], breaker_stale_s=30.0, clock=lambda: 50.0, wall=lambda: now)
    value = json.dumps({"state": "open"}).encode()
    stored = datetime.datetime.fromtimestamp(now - 3600, datetime.UTC)
    view.on_breaker_entry("breaker.long", value, None, stored)
    assert view.breaker("long") == "closed"
    recent = datetime.datetime.fromtimestamp(now - 5, datetime.UTC)
    view.on_breaker_entry("breaker.long", value, None, recent)
    assert view.breaker("long") == "open"


def test_a_deposed_leaders_write_stored_late_is_as_old_as_its_decision() -> None:
    """A scheduler cut off queued its breaker write (nats-py buffers while reconnecting);
    stored when it got back, long after a new leader had closed the breaker, the record
    read as fresh from the server's timestamp and diverted traffic for 30 s."""
    import datetime

    now = 1_000_000.0
    view = WorkersView(["long"], breaker_stale_s=30.0, clock=lambda: 50.0, wall=lambda: now)
    stored_now = datetime.datetime.fromtimestamp(now - 1, datetime.UTC)
    replayed = json.dumps({"state": "open", "written_ms": int((now - 90) * 1000)}).encode()
    view.on_breaker_entry("breaker.long", replayed, None, stored_now)
    assert view.breaker("long") == "closed"
    current = json.dumps({"state": "open", "written_ms": int((now - 2) * 1000)}).encode()
    view.on_breaker_entry("breaker.long", current, None, stored_now)
    assert view.breaker("long") == "open"


async def test_a_groups_limit_is_what_its_live_workers_serve_when_that_is_less():
    """The demo model's context is 2,048 tokens while short's config says 4,096 and long's
    128k: the gateway queued requests its workers then refused (each a group error for the
    breaker) or cut short. It now takes the least its live workers report."""
    config = Config()
    clock = [0.0]
    view = WorkersView(config.groups, clock=lambda: clock[0])
    admission = Admission(config, view)
    assert admission.seq_limit("short") == 4096  # nobody has said anything yet
    view.on_telemetry(_report("short", "a", max_seq_len=2048))
    view.on_telemetry(_report("short", "b", max_seq_len=8192))
    view.on_telemetry(_report("long", "c", max_seq_len=2048))
    assert admission.seq_limit("short") == 2048 and admission.seq_limit("long") == 2048
    routed = classify(config, prompt_tokens=1900, max_tokens=100, seq_limit=admission.seq_limit)
    assert routed.group == "short"
    with pytest.raises(ContextLengthExceededError):  # fits the config, not the workers
        classify(config, prompt_tokens=1900, max_tokens=1000, seq_limit=admission.seq_limit)
    clock[0] += 60  # "a" and "c" stop reporting: the configured limits again
    view.on_telemetry(_report("short", "b", max_seq_len=8192))
    assert admission.seq_limit("short") == 4096 and admission.seq_limit("long") == 131072


async def test_a_fallback_outside_the_keys_groups_is_not_taken():
    config = Config()
    view = _all_live(config)
    view.set_breaker("short", "open")  # short falls back to long ...
    admission = Admission(config, view, wait_s=0.01)
    route = await admission.admit("short", 10, 1.0)
    assert route.group == "long"
    admission.release(route)
    with pytest.raises(ServiceUnavailableError):  # ... but not for a key kept to short
        await admission.admit("short", 10, 1.0, allowed={"short"})


# -- from the admission review ---------------------------------------------------------------


async def test_the_wait_rides_out_a_blip_of_the_only_group_a_key_may_use():
    """A key bound to realtime, realtime's replica restarting, short live: the wait for a
    live worker returned at once (short, which this key may not use, was live) and the
    request got a 503 instead of waiting for realtime to come back."""
    config = Config()
    view = WorkersView(config.groups)
    view.on_telemetry(_report("short"))
    admission = Admission(config, view, wait_s=2.0)
    asyncio.get_running_loop().call_later(0.3, view.on_telemetry, _report("short", "w2"))
    asyncio.get_running_loop().call_later(0.6, view.on_telemetry, _report("realtime"))
    started = time.monotonic()
    route = await admission.admit("realtime", 10, 5.0, allowed={"realtime"})
    assert route.group == "realtime" and time.monotonic() - started > 0.5


async def test_a_group_that_came_live_serving_less_is_checked_again():
    """Classified under short's configured 4096 while no worker reported, the request was
    routed to a worker that came live serving 2048, which cut its answer short."""
    config = Config()
    view = WorkersView(config.groups)
    admission = Admission(config, view, wait_s=1.0)
    asyncio.get_running_loop().call_later(
        0.1, view.on_telemetry, _report("short", max_seq_len=2048)
    )
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("short", 3000, 5.0, allowed={"short"})
    assert view.is_live("short") and admission.seq_limit("short") == 2048  # live, too short
    assert (await admission.admit("short", 2000, 5.0, allowed={"short"})).group == "short"


async def test_a_full_half_open_group_passes_its_probe_on_instead_of_refusing_it():
    config = Config()
    view = _all_live(config)
    view.set_breaker("short", "half_open")
    admission = Admission(config, view)
    for _ in range(config.groups["short"].max_pending):
        admission._take("short")  # full of requests from before
    routes = [await admission.admit("short", 10, 1.0) for _ in range(8)]
    assert {r.group for r in routes} == {"long"}  # no 429s: long had room


async def test_a_dead_group_full_of_stuck_requests_answers_503_not_429():
    config = Config()
    view = WorkersView(config.groups)
    admission = Admission(config, view, wait_s=0.05)
    for _ in range(config.groups["long"].max_pending):
        admission._take("long")
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("long", 10, 1.0)
    view.on_telemetry(_report("long"))  # served, and full: come back shortly
    with pytest.raises(RateLimitError):
        await admission.admit("long", 10, 1.0)


async def test_a_full_group_is_429_only_when_a_group_the_key_may_use_serves():
    """Full short, its workers gone, long live: a key bound to short got 429 "at its limit"
    (retry in 1 s) although nothing it may use serves; so did anyone when the live group's
    breaker was open."""
    config = Config()
    view = WorkersView(config.groups)
    admission = Admission(config, view, wait_s=0.05)
    for _ in range(config.groups["short"].max_pending):
        admission._take("short")
    view.on_telemetry(_report("long"))
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("short", 10, 1.0, allowed={"short"})
    view.set_breaker("long", "open")
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("short", 10, 1.0)


def test_min_tokens_is_never_settled_below_itself():
    """Without max_tokens a request got the default 256 and its min_tokens 1000 was cut to
    it, silently."""
    from gateway.classifier import classify

    config = Config()
    got = classify(config, prompt_tokens=10, max_tokens=None, min_tokens=1000)
    assert got.max_tokens >= 1000 and got.group == "short"
    with pytest.raises(ContextLengthExceededError):
        classify(config, prompt_tokens=10, max_tokens=None, min_tokens=1020, path_group="realtime")


def test_a_record_of_an_earlier_scheduler_term_is_ignored() -> None:
    """A deposed leader's write stored after today's leader wrote (its fence is lower, its
    decision older): the gateway kept diverting on it until it went stale."""
    now = 1_000_000.0
    view = WorkersView(["long"], breaker_stale_s=30.0, clock=lambda: 50.0, wall=lambda: now)

    def record(state: str, fence: int, age_s: float) -> bytes:
        written_ms = int((now - age_s) * 1000)
        return json.dumps({"state": state, "written_ms": written_ms, "fence": fence}).encode()

    view.on_breaker_entry("breaker.long", record("closed", 20, 1), None)
    view.on_breaker_entry("breaker.long", record("open", 10, 4), None)  # the old leader's
    assert view.breaker("long") == "closed"
    view.on_breaker_entry("breaker.long", record("open", 20, 0), None)  # today's leader
    assert view.breaker("long") == "open"


async def test_waiters_for_a_dead_fallback_leave_a_half_open_group_its_probes():
    """Waiters held slots of their own group: requests not on a half-open group's turn,
    waiting for a fallback with no worker, filled it, so it counted as full, spent no turn
    and answered 429, and the breaker got no probe to close on."""
    config = gateway_config(NatsConfig(), short__max_pending=2)
    view = WorkersView(config.groups)
    view.on_telemetry(_report("short"))  # long, its fallback: no worker
    view.set_breaker("short", "half_open")  # share 0.25
    admission = Admission(config, view, wait_s=0.3)
    tasks = [asyncio.create_task(admission.admit("short", 10, 5.0)) for _ in range(8)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    served = [r for r in results if not isinstance(r, BaseException)]
    assert [r.group for r in served] == ["short", "short"]  # the 4th and the 8th
    assert admission.in_flight("short") == 2  # the two admitted; the waiters let go


async def test_a_503_for_open_breakers_says_when_they_probe():
    """Every 503 said Retry-After 2 s: with a group's breaker open for 10 s (doubling to
    120 s on each re-open), clients came back into the same 503 over and over."""
    import datetime

    now = 1_000_000.0
    config = gateway_config(NatsConfig())
    view = WorkersView(config.groups, wall=lambda: now)
    for group in config.groups:
        view.on_telemetry(_report(group))

    def record(probe_in_s: float) -> bytes:
        return json.dumps({"state": "open", "written_ms": int(now * 1000),
                           "probe_at_ms": int((now + probe_in_s) * 1000)}).encode()  # fmt: skip

    stored = datetime.datetime.fromtimestamp(now, datetime.UTC)
    view.on_breaker_entry("breaker.short", record(30), None, stored)
    view.on_breaker_entry("breaker.long", record(45), None, stored)
    admission = Admission(config, view, wait_s=0.2)
    with pytest.raises(ServiceUnavailableError) as refused:
        await admission.admit("short", 10, 5.0)
    assert refused.value.headers()["Retry-After"] == "30"  # short's chain probes first in 30 s
    view.on_breaker_entry("breaker.long", record(600), None, stored)
    with pytest.raises(ServiceUnavailableError) as capped:
        await admission.admit("long", 10, 5.0)
    assert capped.value.headers()["Retry-After"] == "60"  # the most the openai client waits


async def test_slots_taken_together_go_to_one_group_and_need_a_half_open_turn_each():
    """A response's choices are admitted at once: a half-open group takes all or none, and
    only with a turn for each (one turn let a batch of hundreds into a recovering group)."""
    config = Config()
    view = _all_live(config)
    view.set_breaker("short", "half_open")  # default half_open_share = 0.25
    admission = Admission(config, view)
    routes = [await admission.admit("short", 10, 1.0, count=3) for _ in range(4)]
    assert [r.group for r in routes] == ["long"] * 4
    assert {r.reason for r in routes} == {"breaker_half_open"}
    assert admission.in_flight("short") == 0 and admission.in_flight("long") == 12
    # Single requests still get their share: 12 turns went by, the 16th is one.
    singles = [await admission.admit("short", 10, 1.0) for _ in range(4)]
    assert [r.group for r in singles] == ["long", "long", "long", "short"]
    short = config.groups["short"]
    share = short.breaker.model_copy(update={"half_open_share": 1.0})
    groups = {**config.groups, "short": short.model_copy(update={"breaker": share})}
    full_share = Admission(config.model_copy(update={"groups": groups}), view)
    assert (await full_share.admit("short", 10, 1.0, count=3)).group == "short"
    full_share.release(Route("short", "short"), 3)
    assert full_share.in_flight("short") == 0


async def test_more_slots_than_a_fallback_ever_holds_pass_it_over():
    """Its 429 would never clear: a batch for a group whose breaker is open skips a
    fallback too small for it, and with nowhere else to go it is a 503."""
    config = gateway_config(NatsConfig(), long__max_pending=2)
    view = _all_live(config)
    view.set_breaker("short", "open")
    admission = Admission(config, view, wait_s=0.01)
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("short", 10, 1.0, count=3)
    route = await admission.admit("short", 10, 1.0, count=2)
    assert (route.group, route.reason) == ("long", "breaker_open")


async def test_slots_taken_together_need_room_for_all_of_them():
    config = gateway_config(NatsConfig(), short__max_pending=4)
    admission = Admission(config, _all_live(config))
    await admission.admit("short", 10, 1.0, count=3)
    with pytest.raises(RateLimitError):
        await admission.admit("short", 10, 1.0, count=2)
    assert admission.in_flight("short") == 3
    await admission.admit("short", 10, 1.0)
    assert admission.in_flight("short") == 4


async def test_a_503_says_when_a_group_the_key_may_use_probes():
    """Retry-After looked at the whole chain: a key bound to short, whose breaker probes in
    40 s, was told 2 s because long (closed, not the key's) says nothing, and came back
    into the same 503 twenty times."""
    import datetime

    now = 1_000_000.0
    config = gateway_config(NatsConfig())
    view = WorkersView(config.groups, wall=lambda: now)
    for group in config.groups:
        view.on_telemetry(_report(group))
    record = json.dumps({"state": "open", "written_ms": int(now * 1000),
                         "probe_at_ms": int((now + 40) * 1000)}).encode()  # fmt: skip
    view.on_breaker_entry(
        "breaker.short", record, None, datetime.datetime.fromtimestamp(now, datetime.UTC)
    )
    admission = Admission(config, view, wait_s=0.05)
    with pytest.raises(ServiceUnavailableError) as refused:
        await admission.admit("short", 10, 5.0, allowed={"short"})
    assert refused.value.headers()["Retry-After"] == "40"


async def test_a_full_half_open_group_with_nowhere_else_to_go_is_429_not_503():
    """Passed over because it was full (its probes need room), the half-open group left the
    request with no route: it got 503 "no worker is available" while the group served."""
    config = gateway_config(NatsConfig(), short__max_pending=2)
    view = _all_live(config)
    view.set_breaker("short", "half_open")
    admission = Admission(config, view, wait_s=0.05)
    admission._take("short", count=2)
    with pytest.raises(RateLimitError) as refused:
        await admission.admit("short", 10, 5.0, allowed={"short"})
    assert "at its limit of 2 pending" in refused.value.message
    assert admission.in_flight("short") == 2  # the refusal took nothing
    view.set_breaker("short", "open")  # shut, not full: nobody serves it
    with pytest.raises(ServiceUnavailableError):
        await admission.admit("short", 10, 5.0, allowed={"short"})


async def test_a_full_waiting_room_says_so():
    config = gateway_config(NatsConfig(), short__max_pending=1)
    view = WorkersView(config.groups)
    view.on_telemetry(_report("long"))  # short: no worker, long: its live fallback
    view.set_breaker("long", "half_open")
    admission = Admission(config, view, wait_s=0.3)
    admission._take("short", admission._waiting)
    with pytest.raises(RateLimitError) as refused:
        await admission.admit("short", 10, 5.0, count=1)
    assert "waiting for a worker" in refused.value.message


async def test_a_key_holds_at_most_its_share_of_the_slots(nats_config: NatsConfig):
    """The rate limit bounded arrivals only: one key's long streams, or one batch of
    prompts x n, filled a group's max_pending and every other team got 429s until they
    finished. With api_key_max_in_flight a key holds at most that many; others are served."""
    from gateway.auth import key_digest

    slow = functools.partial(echo_alphabet, delay_s=0.4)
    config = gateway_config(
        nats_config,
        api_key_sha256=[key_digest("sk-greedy"), key_digest("sk-other")],
        api_key_max_in_flight=2,
    )
    greedy = {"Authorization": "Bearer sk-greedy"}
    other = {"Authorization": "Bearer sk-other"}
    async with (
        serve(config) as gw,
        running_worker(nats_config, "short", behaviour=slow),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await until_live(http, "short")
        responses = await asyncio.gather(
            *(http.post("/v1/completions", json=BODY, headers=greedy) for _ in range(3)),
            http.post("/v1/completions", json=BODY, headers=other),
        )
        statuses = [r.status_code for r in responses]
        assert sorted(statuses[:3]) == [200, 200, 429] and statuses[3] == 200
        shed = next(r for r in responses if r.status_code == 429)
        assert shed.json()["error"]["code"] == "rate_limit_exceeded"
        assert "its limit is 2" in shed.json()["error"]["message"]
        assert int(shed.headers["Retry-After"]) >= 1
        # More choices than the key may ever hold: a 400, not a 429 to retry for ever.
        wide = await http.post("/v1/completions", json={**BODY, "n": 3}, headers=greedy)
        assert wide.status_code == 400 and wide.json()["error"]["param"] == "n"
        # Its slots came back, on every path: two choices fit again.
        again = await http.post("/v1/completions", json={**BODY, "n": 2}, headers=greedy)
        assert again.status_code == 200 and len(again.json()["choices"]) == 2
        assert (await http.get("/health")).json()["groups"]["short"]["in_flight"] == 0


async def test_a_request_no_group_could_take_is_shed_before_it_is_tokenized():
    """Under a flood with every group full, each request had its template rendered and its
    prompt tokenized before the 429 that was sure to come."""
    config = gateway_config(NatsConfig(), realtime__max_pending=1, short__max_pending=1,
                            long__max_pending=1)  # fmt: skip
    view = _all_live(config)
    admission = Admission(config, view)
    admission.shed_if_all_full()  # room everywhere: nothing said
    for group in ("realtime", "short"):
        admission._take(group)
    admission.shed_if_all_full()  # long has room: the request may be classified there
    with pytest.raises(RateLimitError):
        admission.shed_if_all_full(allowed={"realtime", "short"})  # not for this key
    admission._take("long")
    with pytest.raises(RateLimitError) as shed:
        admission.shed_if_all_full()
    assert shed.value.headers()["Retry-After"] == "1"
    view.set_breaker("long", "open")  # not full: shut, which the full path answers
    admission.shed_if_all_full()
    assert [admission.in_flight(g) for g in ("realtime", "short", "long")] == [1, 1, 1]


async def test_requests_sure_to_be_refused_are_refused_before_their_prompt_is_tokenized(
    nats_config: NatsConfig,
):
    """Every group full, or the key at its in-flight cap: the 429 came only after the chat
    template was rendered and the prompt tokenized, which a flood paid for each refusal."""
    from common.tokenizer import ByteTokenizer
    from gateway.auth import key_digest

    class Counting(ByteTokenizer):
        encodes = 0

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            Counting.encodes += 1
            return super().encode(text, add_special_tokens)

    config = gateway_config(nats_config, api_key_sha256=[key_digest("sk-a")],
                            api_key_max_in_flight=1)  # fmt: skip
    headers = {"Authorization": "Bearer sk-a"}
    async with (
        serve(config, Counting()) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        state = gw.app.state.gateway
        for group in config.groups:
            state.view.on_telemetry(_report(group))
            state.admission._take(group, count=config.groups[group].max_pending)
        Counting.encodes = 0
        full = await http.post("/v1/completions", json=BODY, headers=headers)
        assert full.status_code == 429 and Counting.encodes == 0
        for group in config.groups:
            state.admission.release(Route(group, group), config.groups[group].max_pending)
        (grant,) = state.keys._grants
        grant.slots.take(1)  # the key's one request in flight
        capped = await http.post("/v1/completions", json=BODY, headers=headers)
        assert capped.status_code == 429 and Counting.encodes == 0
        assert "its limit is 1" in capped.json()["error"]["message"]
        grant.slots.give_back(1)
        # Admitted now (no worker really serves: its deadline ends it).
        short = {**headers, "X-QoS-Deadline-Ms": "300"}
        served = await http.post("/v1/completions", json=BODY, headers=short)
        assert served.status_code == 504 and Counting.encodes == 1  # tokenized, then on


def test_a_response_wider_than_the_keys_cap_is_a_400_even_while_the_key_is_busy() -> None:
    """Checked early, the key's busy 429 came first: a request that can never be served was
    told to come back."""
    from common.errors import InvalidRequestError
    from gateway.auth import KeySlots

    slots = KeySlots(2)
    slots.take(2)
    with pytest.raises(InvalidRequestError):
        slots.shed_if_full(3)
    with pytest.raises(RateLimitError):
        slots.shed_if_full(1)
    assert slots.held == 2  # nothing taken


async def test_each_keys_requests_tokens_and_refusals_are_counted_under_its_name(
    nats_config: NatsConfig,
):
    """Serving many teams, the operator saw per-group figures only: nothing said which
    team used the capacity, or was being refused for its own limits."""
    from gateway.auth import key_digest

    slow = functools.partial(echo_alphabet, delay_s=0.3)
    team = key_digest("sk-team-a")
    other = key_digest("sk-other")
    config = gateway_config(
        nats_config, api_key_sha256=[team, other], api_key_names={team: "team-a"},
        api_key_max_in_flight=1, api_key_rate_limit_rps=0.2, api_key_rate_limit_burst=3,
    )  # fmt: skip
    a = {"Authorization": "Bearer sk-team-a"}
    b = {"Authorization": "Bearer sk-other"}
    async with (
        serve(config) as gw,
        running_worker(nats_config, "short", behaviour=slow),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await until_live(http, "short")
        both = await asyncio.gather(*(http.post("/v1/completions", json=BODY, headers=a)
                                      for _ in range(2)))  # fmt: skip
        assert sorted(r.status_code for r in both) == [200, 429]  # one in flight at a time
        assert (
            await http.post("/v1/completions", json={**BODY, "n": 1}, headers=b)
        ).status_code == 200
        assert (await http.post("/v1/completions", json=BODY, headers=a)).status_code == 200
        assert (await http.post("/v1/completions", json=BODY, headers=a)).status_code == 429  # rate
        metrics = (await http.get("/metrics")).text

    def value(name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        line = next((x for x in metrics.splitlines() if x.startswith(f"{name}{{{want}}}")), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    prompt = 1 + len("hi")  # ByteTokenizer: BOS + a token per byte
    assert value("qos_gateway_key_requests_total", key="team-a", status="200") == 2
    assert value("qos_gateway_key_tokens_total", key="team-a", kind="prompt") == 2 * prompt
    assert value("qos_gateway_key_tokens_total", key="team-a", kind="completion") == 2 * 6
    assert value("qos_gateway_key_refused_total", key="team-a", reason="in_flight") == 1
    assert value("qos_gateway_key_refused_total", key="team-a", reason="rate") == 1
    unnamed = other[:8]  # an unnamed key: its digest's first 8 hex digits
    assert value("qos_gateway_key_requests_total", key=unnamed, status="200") == 1


def test_the_early_cap_check_counts_every_prompt_of_a_batch() -> None:
    """It counted n only: a batch of 64 prompts against a cap of 8 was told to come back
    (429) while the key was busy, and tokenized in full when it was idle."""
    from common.errors import InvalidRequestError
    from gateway.auth import KeySlots

    slots = KeySlots(8)
    with pytest.raises(InvalidRequestError):
        slots.shed_if_full(64)
    slots.take(6)
    with pytest.raises(RateLimitError):
        slots.shed_if_full(3)  # 6 held + 3 > 8: it would be refused
    slots.shed_if_full(2)
