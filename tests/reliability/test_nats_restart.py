"""``nats-server`` killed (SIGKILL) and restarted under traffic.

Services reconnect on their own; requests waiting in the work queue survive in the
JetStream file store; a stream that was generating when the server died finishes exactly
(the worker re-sends what the outage swallowed, :mod:`workers.resync`); a request sent
while the server is down finishes after the restart or fails with an explicit error.
Nothing is ever silently dropped.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import httpx

from common.services import NatsServer
from common.tokenizer import BaseTokenizer
from tests.reliability.conftest import StackFactory
from tests.reliability.harness import body, completion, expected_text, group, same_text, tally

MAX_TOKENS = 40  # 0.8 s of 20 ms steps: many streams are mid-generation at the kill
DEADLINE = {"X-QoS-Deadline-Ms": "30000"}  # a hang would show as a 30 s error, not a pass


def queued_messages(server: NatsServer, stream: str) -> int:
    """Messages in ``stream`` now (queued or unacked), from the monitoring endpoint."""
    host, port = server.monitor_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    try:
        conn.request("GET", "/jsz?accounts=true&streams=true")
        info = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    for account in info.get("account_details", []):
        for detail in account.get("stream_detail", []):
            if detail["name"] == stream:
                return int(detail["state"]["messages"])
    return 0


async def test_nats_restart_mid_traffic_every_request_completes_or_fails_clearly(
    private_nats: NatsServer, make_stack: StackFactory, tokenizer: BaseTokenizer
) -> None:
    stack = make_stack(
        private_nats.url, {"short": group(4)}, {"short": 2}, nats_overrides={"ack_wait_s": 2.0}
    )
    url = f"{stack.base_url}/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        # 24 streams on 8 slots: 8 generating, 16 waiting in the work queue.
        before = [
            asyncio.create_task(completion(http, url, body(stack.model, seed), DEADLINE))
            for seed in range(24)
        ]
        for _ in range(200):  # until the waiting ones are in the work queue
            queued = queued_messages(private_nats, stack.config.nats.stream)
            if queued >= 8:
                break
            await asyncio.sleep(0.05)
        private_nats.kill()
        killed_at = time.monotonic()
        during = [
            asyncio.create_task(completion(http, url, body(stack.model, seed), DEADLINE))
            for seed in range(100, 104)
        ]
        await asyncio.sleep(1.0)
        private_nats.start()
        first = await asyncio.gather(*before)
        second = await asyncio.gather(*during)
        # Back to normal: a new request is served promptly.
        after = await completion(http, url, body(stack.model, 999), DEADLINE)
        recovered_s = time.monotonic() - killed_at

    assert queued >= 8, f"only {queued} requests were in the stream when NATS died"
    assert tally(first) == {"complete": 24, "error": 0, "lost": 0}, [o.detail for o in first]
    for seed, outcome in enumerate(first):
        assert same_text(outcome.text, expected_text(tokenizer, MAX_TOKENS, seed)), f"seed {seed}"
        assert outcome.completion_tokens == MAX_TOKENS, f"seed {seed}: {outcome}"
    counts = tally(second)
    assert counts["lost"] == 0, [o.detail for o in second]
    for seed, outcome in enumerate(second, start=100):
        if outcome.kind == "error":  # refused while the queue was unreachable: retry later
            assert outcome.status == 503 and "retry-after" in outcome.headers, outcome
        else:
            assert same_text(outcome.text, expected_text(tokenizer, MAX_TOKENS, seed))
    assert after.kind == "complete"
    assert same_text(after.text, expected_text(tokenizer, MAX_TOKENS, 999))
    assert recovered_s < 10, f"took {recovered_s:.1f}s from the kill to a served request"
    health = httpx.get(f"{stack.url}/health", timeout=5).json()
    assert health["nats"] is True and health["groups"]["short"]["in_flight"] == 0
