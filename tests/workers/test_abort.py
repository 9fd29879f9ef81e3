"""A client abort reaches the real engine: the request stops and its KV blocks are freed."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from common.client import QosClient
from common.errors import QosError
from common.protocol import Control, RequestParams
from workers.engine import EngineArgs, LLMEngine
from workers.engine.outputs import EngineStats, RequestDelta
from workers.sim import SimCost, SimEngine


class HeldEngine(LLMEngine):
    """Steps freely until ``hold_at`` tokens are out, then holds its next step until
    ``release``: the request cannot outrun its abort, however fast the engine (a tiny
    model unthrottled could finish its 400 tokens before the abort came)."""

    def __init__(self, args: EngineArgs, hold_at: int) -> None:
        super().__init__(args)
        self.hold_at = hold_at
        self.holding = threading.Event()
        self.release = threading.Event()
        self.held: EngineStats | None = None  # what it held with

    def step(self) -> list[RequestDelta]:
        stats = self.stats()
        if stats.num_generation_tokens >= self.hold_at and not self.release.is_set():
            self.held = stats
            self.holding.set()
            self.release.wait(10)  # bounded: a test that fails must not hang the thread
        return super().step()


async def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_client_abort_stops_the_request_and_frees_its_kv_blocks(
    start_worker: Any, client: QosClient
) -> None:
    hold_at = 8
    engine = HeldEngine(
        EngineArgs(
            model="dummy:tiny", device="cpu", num_kv_blocks=64, max_batch_size=4, max_seq_len=512,
            policy="continuous",
        ),
        hold_at,
    )  # fmt: skip
    service = await start_worker(engine=engine)
    try:
        params = RequestParams(max_tokens=400, ignore_eos=True, temperature=0)
        stream = client.generate(group="short", prompt_token_ids=list(range(1, 40)), params=params)
        received = 0
        async for chunk in stream:
            received += len(chunk.token_ids)
            if received >= 3:
                break
        assert await asyncio.to_thread(engine.holding.wait, 10)
        (rid,) = service.inflight_ids
        busy = engine.held
        assert busy is not None
        assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks
        # Leaving the stream publishes the abort on the group's control subject.
        await stream.aclose()
        # The worker took the abort (and queued it for the engine, behind the held step).
        await _until(lambda: rid in service._aborted)
    finally:
        engine.release.set()
    await _drained(service)
    stats: EngineStats = await service.bridge.call(lambda e: e.stats())
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    # Stopped at the step it was held in: the abort came before any other.
    assert stats.num_generation_tokens == busy.num_generation_tokens + 1


def _total(registry: Any, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _first_tokens(stream: Any, n: int) -> None:
    received = 0
    async for chunk in stream:
        received += len(chunk.token_ids)
        if received >= n:
            return


async def _drained(service: Any) -> None:
    deadline = time.monotonic() + 10
    while service.inflight_ids:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_a_cancelled_request_counts_by_outcome_only_and_its_ttft_when_it_came(
    start_worker: Any, client: QosClient
) -> None:
    """A request its caller cancelled is no success latency and no breaker sample (it read
    as a success with its cut-short lifetime); its first token's TTFT was observed when the
    token came, not at the end."""
    engine = SimEngine(max_batch_size=4, max_seq_len=1024, cost=SimCost(base_s=0.005))
    service = await start_worker(engine=engine)
    registry = service.observer.registry
    params = RequestParams(max_tokens=400, ignore_eos=True, temperature=0)
    stream = client.generate(group="short", prompt_token_ids=list(range(1, 20)), params=params)
    await _first_tokens(stream, 3)
    assert _total(registry, "qos_time_to_first_token_seconds_count", group="short") == 1
    assert _total(registry, "qos_e2e_request_latency_seconds_count", group="short") == 0
    await stream.aclose()
    await _drained(service)
    assert _total(registry, "qos_request_success_total", finished_reason="abort") == 1
    assert _total(registry, "qos_e2e_request_latency_seconds_count", group="short") == 0
    assert (service.telemetry.requests_done, service.telemetry.errors) == (0, 0)


@pytest.mark.parametrize("budget_ms", [700, 300])
async def test_an_abort_after_the_deadline_is_a_deadline_error(
    start_worker: Any, client: QosClient, budget_ms: int
) -> None:
    """The gateway answers 504 at the deadline and aborts: the worker, whose own deadline
    check runs every half second, counted that abort as a success. A deadline its caller
    set under the group's latency bar (short's 500 ms) is the caller's choice: an error in
    the metrics, none for the breakers (one tenant's 150 ms deadlines opened them)."""
    engine = SimEngine(max_batch_size=4, max_seq_len=1024, cost=SimCost(base_s=0.005))
    service = await start_worker(engine=engine)
    registry = service.observer.registry
    deadline_ms = int(time.time() * 1000) + budget_ms
    params = RequestParams(max_tokens=400, ignore_eos=True, temperature=0)
    stream = client.generate(
        group="short", prompt_token_ids=list(range(1, 20)), params=params, deadline_ms=deadline_ms
    )
    await _first_tokens(stream, 1)
    (rid,) = service.inflight_ids
    await asyncio.sleep(max(0.0, deadline_ms / 1000 - time.time()) + 0.01)
    control = Control(action="abort", request_id=rid)
    await service._on_control(types.SimpleNamespace(data=control.to_bytes(), subject="ctl"))
    await _drained(service)
    await stream.aclose()
    assert _total(registry, "qos_request_errors_total", code="deadline_exceeded") == 1
    assert _total(registry, "qos_request_success_total") == 0
    # Under the bar it still ended (a replica of such requests must not read as stalled).
    expected = (0, 1) if budget_ms > 500 else (1, 0)
    assert (service.telemetry.requests_done, service.telemetry.errors) == expected
    assert service.telemetry.e2e.percentiles_ms()[2] == 0  # and gave no latency sample


async def test_a_request_s_own_mistake_is_not_counted_against_the_group(
    start_worker: Any, client: QosClient
) -> None:
    """A client sending bad parameters (a NATS caller: the gateway refuses them first) or a
    prompt over a worker's limit made the group's error rate, which opens its breaker, and
    re-opened a half-open one on a single such answer among its probes."""
    service = await start_worker(engine=SimEngine(max_batch_size=4, max_seq_len=64,
                                                  cost=SimCost(0, 0, 0)))  # fmt: skip
    bad = [RequestParams(max_tokens=4, top_p=5.0), RequestParams(max_tokens=4)]
    prompts = [[1, 2, 3], list(range(1, 200))]  # a bad parameter, a prompt over 64 tokens
    for params, prompt in zip(bad, prompts, strict=True):
        with pytest.raises(QosError) as refused:
            await client.collect(group="short", prompt_token_ids=prompt, params=params,
                                 timeout_s=10)  # fmt: skip
        assert refused.value.http_status == 400
    await client.collect(group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=2))
    await _drained(service)
    assert (service.telemetry.requests_done, service.telemetry.errors) == (1, 0)
