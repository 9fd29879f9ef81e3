"""A service whose NATS connection ends for good exits 1, for its supervisor to restart it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.config import NatsConfig
from common.services import NatsServer
from scheduler.service import SchedulerService
from tests.scheduler.conftest import make_config


async def test_a_scheduler_whose_nats_connection_ends_for_good_exits_1(
    fresh_nats_server: Callable[..., NatsServer], nats_config: NatsConfig
) -> None:
    """nats-py gives up for good on an authorization error (a credentials rotation) or
    once max_reconnect_attempts are spent: the scheduler went on looping, acting on
    nothing, while /metrics kept its probes green. It now stops with exit code 1."""
    server = fresh_nats_server()
    nats = nats_config.model_copy(update={"url": server.url, "max_reconnect_attempts": 1})
    service = SchedulerService(make_config(nats), scheduler_id="s-closed")
    await service.start()
    try:
        server.stop()
        await asyncio.wait_for(service._stop_requested.wait(), 15)
        assert service.exit_code == 1
    finally:
        await service.stop()


async def test_a_scheduler_stopped_on_purpose_exits_0(
    fresh_nats_server: Callable[..., NatsServer], nats_config: NatsConfig
) -> None:
    server = fresh_nats_server()
    service = SchedulerService(make_config(nats_config.model_copy(update={"url": server.url})),
                               scheduler_id="s-stopped")  # fmt: skip
    await service.start()
    await service.stop()  # its own close() closes the connection too: not "for good"
    assert service.exit_code == 0


async def test_a_worker_whose_nats_connection_ends_for_good_exits_1(
    fresh_nats_server: Callable[..., NatsServer], nats_config: NatsConfig
) -> None:
    from workers.service import WorkerOptions, WorkerService
    from workers.sim import SimEngine

    server = fresh_nats_server()
    nats = nats_config.model_copy(update={"url": server.url, "max_reconnect_attempts": 1})
    worker = WorkerService(make_config(nats), SimEngine(max_seq_len=256),
                           WorkerOptions(group="short", worker_id="w-closed"))  # fmt: skip
    await worker.start()
    try:
        server.stop()
        await asyncio.wait_for(worker._stop_requested.wait(), 15)
        assert worker.exit_code == 1
    finally:
        await worker.stop(grace_s=0)
