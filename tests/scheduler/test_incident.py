"""A latency incident end to end: real nats-server, sim workers, the scheduler in process.

The group's workers are slowed (``SimEngine.set_slowdown``) under steady load through
:class:`QosClient`; the breaker must open (KV says so for the gateways, the workers run at
the open cap), then half-open and close once the slowdown is gone, with every request of
the incident answered in full.
"""

from __future__ import annotations

import http.server
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

from gateway.workers_view import decode_breaker
from scheduler.service import TERM_START_REASON
from tests.scheduler.conftest import MAX_TOKENS, make_config, until

SLOWDOWN_S = 0.15  # per step: 8 tokens take > 1 s against a 400 ms threshold


class _Hook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict]]]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Hook)
    received: ClassVar[list[dict]] = []
    _Hook.received = received
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/alert", received
    server.shutdown()
    server.server_close()


async def test_latency_spike_opens_then_recovery_closes_with_nothing_lost_and_one_leader(
    nats_config, start_worker, start_scheduler, start_load, observer, webhook
):
    url, posts = webhook
    config = make_config(nats_config, alert_webhook_url=url)
    workers = [await start_worker("w1"), await start_worker("w2")]
    first = await start_scheduler("sched-a", config)
    second = await start_scheduler("sched-b", config)
    await until(lambda: first.is_leader or second.is_leader, 5, "a leader")
    load = start_load("short", 6)
    await until(lambda: first.windows.replicas("short") == 2, 5, "both workers reporting")
    await until(lambda: len(load.requests) >= 8, 5, "some healthy traffic")
    assert observer.state("short") == "closed"

    for w in workers:
        w.engine.set_slowdown(SLOWDOWN_S)
    to_open = await until(lambda: observer.state("short") == "open", 15, "the breaker to open")
    # Workers obey the open cap; the KV value is what a gateway reads to divert.
    await until(lambda: all(w.bridge.batch_cap == 4 for w in workers), 2, "batch cap 4")
    entry = await observer.kv.get("breaker.short")
    assert decode_breaker(entry.value) == "open"
    record = json.loads(entry.value)
    assert record["fallback"] == "long" and record["batch_cap"] == 4 and "p99" in record["reason"]

    for w in workers:
        w.engine.set_slowdown(0.0)
    healed = time.monotonic()
    await until(lambda: observer.state("short") == "closed", 30, "the breaker to close")
    recovery_s = time.monotonic() - healed
    await until(lambda: all(w.bridge.batch_cap == 8 for w in workers), 2, "batch cap restored")

    results = await load.finish()
    assert [r for r in results if r != MAX_TOKENS] == []  # every request answered in full
    assert len(results) >= 30
    states = observer.states("short")
    assert states[0] == "open" and "half_open" in states and states[-1] == "closed"
    for a, b in itertools.pairwise(states):
        assert (a, b) in {("open", "half_open"), ("half_open", "open"), ("half_open", "closed")}
    print(f"open after {to_open:.1f}s of slowness; closed {recovery_s:.1f}s after healing")
    assert recovery_s < 30

    # Exactly one replica acted: one cap order per open/close, one alert per transition.
    leader, standby = (first, second) if first.acted else (second, first)
    assert not standby.acted
    await until(lambda: standby.breakers["short"].state == "closed", 2, "the standby to follow")
    acted = [(t.source, t.target) for t in leader.acted if t.group == "short"]
    assert len(acted) == len(states)
    caps = [  # each term also begins with the group's cap (its fence for the workers)
        c.batch_cap
        for s, c in observer.controls
        if s.endswith(".ctl.group.short")
        and c.action == "set_batch_cap"
        and c.reason != TERM_START_REASON
    ]
    assert caps == [4 if t == "open" else 8 for _, t in acted if t in ("open", "closed")]
    await until(lambda: len(posts) >= len(acted), 5, "the webhook alerts")
    assert [(p["from"], p["to"]) for p in posts if p["group"] == "short"] == acted
    assert {p["scheduler"] for p in posts} == {leader.id}
