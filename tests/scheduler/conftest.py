"""Scheduler fixtures: a fast config, in-process sim workers and schedulers, steady load.

Timings are shortened so an incident plays out in seconds: workers report every 0.2 s,
the scheduler ticks every 0.25 s, breakers judge 5 samples and wait 2 s open. A worker's
own latency window stays 10 s (``workers.telemetry.WINDOW_S``), which bounds how soon a
healed group looks healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

import common.nats as qnats
from common.client import QosClient
from common.config import (
    BreakerConfig,
    Config,
    GroupConfig,
    NatsConfig,
    SchedulerConfig,
    WorkerConfig,
)
from common.protocol import Control, RequestParams
from common.tasks import cancel_and_wait
from scheduler.service import SchedulerService
from workers.service import WorkerOptions, WorkerService
from workers.sim import SimCost, SimEngine

MAX_TOKENS = 8
QUICK = SimCost(base_s=0.002, prefill_s_per_token=0.0, decode_s_per_seq=0.0)


def make_config(nats: NatsConfig, **scheduler: Any) -> Config:
    """Groups short (batch 8, breaker at 400 ms) and long (batch 2), fast timings."""
    breaker = BreakerConfig(
        window_samples=5, min_samples=3, p99_threshold_ms=400, wait_open_s=2.0,
        close_after_healthy=3, open_batch_cap=4,
    )  # fmt: skip
    groups = {
        "short": GroupConfig(max_batch=8, max_seq_len=256, slo_ttft_ms=200, slo_e2e_p99_ms=400,
                             fallback="long", breaker=breaker),
        "long": GroupConfig(max_batch=2, max_seq_len=256, slo_ttft_ms=5000,
                            slo_e2e_p99_ms=60000, rank=1),
    }  # fmt: skip
    sched = {
        "tick_interval_s": 0.25,
        "rebalance_interval_s": 0.5,
        "worker_silent_s": 1.5,
        "lease_ttl_s": 1.5,
        "lease_renew_s": 0.3,
        "metrics_port": 0,
        "move_after_ticks": 2,
        "move_cooldown_s": 30.0,
        **scheduler,
    }
    return Config(
        nats=nats,
        groups=groups,
        worker=WorkerConfig(telemetry_interval_s=0.2, coalesce_ms=2.0),
        scheduler=SchedulerConfig(**sched),
    )


@pytest.fixture
def config(nats_config: NatsConfig) -> Config:
    return make_config(nats_config)


@pytest.fixture
async def start_worker(config: Config) -> AsyncIterator[Callable[..., Awaitable[WorkerService]]]:
    """``await start_worker(worker_id, group, cost=QUICK)`` → a serving in-process replica."""
    started: list[WorkerService] = []

    async def start(worker_id: str, group: str = "short", cost: SimCost = QUICK) -> WorkerService:
        engine = SimEngine(max_batch_size=config.groups[group].max_batch, max_seq_len=256,
                           cost=cost)  # fmt: skip
        opts = WorkerOptions(group=group, worker_id=worker_id, fetch_timeout_s=0.25)
        service = WorkerService(config, engine, opts)
        await service.start()
        started.append(service)
        return service

    yield start
    await asyncio.gather(*(s.stop(grace_s=0) for s in started))


@pytest.fixture
async def start_scheduler(
    config: Config,
) -> AsyncIterator[Callable[..., Awaitable[SchedulerService]]]:
    """``await start_scheduler(scheduler_id, config=None)`` → a started scheduler."""
    started: list[SchedulerService] = []

    async def start(scheduler_id: str, cfg: Config | None = None) -> SchedulerService:
        service = SchedulerService(cfg or config, scheduler_id=scheduler_id)
        await service.start()
        started.append(service)
        return service

    yield start
    for s in started:
        await s.stop()


@pytest.fixture
async def client(config: Config) -> AsyncIterator[QosClient]:
    async with await QosClient.connect(config, "test-client") as c:
        yield c


@pytest.fixture
async def observer(config: Config) -> AsyncIterator[Observer]:
    """Records every control message and every ``breaker.*`` value, as they happen."""
    nc = await qnats.connect(config.nats, "test-observer")
    kv = await qnats.ensure_kv(nc.jetstream(), config.nats)
    obs = Observer(nc, kv)
    await obs.start(config.nats.subject_prefix)
    yield obs
    await obs.stop()


@dataclass
class Observer:
    nc: Client
    kv: KeyValue
    controls: list[tuple[str, Control]] = field(default_factory=list)
    breakers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (key, value)
    _task: asyncio.Task[None] | None = None

    async def start(self, prefix: str) -> None:
        async def on_control(msg: Msg) -> None:
            self.controls.append((msg.subject, Control.from_bytes(msg.data)))

        await self.nc.subscribe(f"{prefix}.ctl.>", cb=on_control)
        watcher = await self.kv.watch("breaker.*", include_history=False)

        async def follow() -> None:
            async for entry in watcher:
                if entry is not None and entry.value:
                    self.breakers.append((entry.key, json.loads(entry.value)))

        self._task = asyncio.create_task(follow())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], what="observer watch")
        await self.nc.close()

    def states(self, group: str) -> list[str]:
        """The breaker states written for ``group``, in order, repeats collapsed."""
        out: list[str] = []
        for key, value in self.breakers:
            if key == f"breaker.{group}" and (not out or out[-1] != value["state"]):
                out.append(value["state"])
        return out

    def state(self, group: str) -> str:
        states = self.states(group)
        return states[-1] if states else "closed"


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Wait for ``predicate``; returns the seconds it took; fails naming ``what``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


class Load:
    """Steady requests through :class:`QosClient`; :meth:`finish` returns every outcome."""

    def __init__(self, client: QosClient, group: str, per_s: float) -> None:
        self.client, self.group, self.per_s = client, group, per_s
        self.requests: list[asyncio.Task[int]] = []
        self._pacer: asyncio.Task[None] | None = None

    def start(self) -> Load:
        self._pacer = asyncio.create_task(self._pace())
        return self

    async def _pace(self) -> None:
        while True:
            self.requests.append(asyncio.create_task(self._one()))
            await asyncio.sleep(1 / self.per_s)

    async def _one(self) -> int:
        ids, _, final = await self.client.collect(
            group=self.group, prompt_token_ids=[1, 2, 3, 4],
            params=RequestParams(max_tokens=MAX_TOKENS, seed=len(self.requests)), timeout_s=90,
        )  # fmt: skip
        assert final.finish_reason == "length"
        return len(ids)

    async def finish(self) -> list[int | BaseException]:
        if self._pacer is not None:
            self._pacer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pacer
        return await asyncio.gather(*self.requests, return_exceptions=True)

    async def abort(self) -> None:
        """Cancel what is still running and read every outcome (a failed test's leftovers
        would otherwise log "exception was never retrieved" into a later test)."""
        tasks = [t for t in [self._pacer, *self.requests] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def start_load(client: QosClient) -> AsyncIterator[Callable[[str, float], Load]]:
    """``start_load(group, per_s)``: a started :class:`Load`, aborted at teardown."""
    loads: list[Load] = []

    def start(group: str, per_s: float) -> Load:
        loads.append(Load(client, group, per_s).start())
        return loads[-1]

    yield start
    for load in loads:
        await load.abort()


@contextlib.asynccontextmanager
async def hand_driven(config: Config) -> AsyncIterator[tuple[SchedulerService, list[float]]]:
    """A started leader whose ticks and rebalances only the test runs, on a clock the test
    moves (``now[0]``)."""
    now = [1000.0]
    service = SchedulerService(config, scheduler_id="s", clock=lambda: now[0])
    await service.start()
    try:
        for task in service._tasks:
            task.cancel()
        await asyncio.gather(*service._tasks, return_exceptions=True)
        yield service, now
    finally:
        await service.stop()
