"""The scheduler killed (SIGKILL) in the middle of an incident: the data path does not need
it. Gateways and workers keep serving on the last state it left in the bucket (here: the
``short`` breaker open, so ``short`` traffic goes to its fallback ``long``), and nothing
that arrives while it is gone fails. Its own recovery (taking over from the bucket) is in
``tests/scheduler/test_restart.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from common.config import BreakerConfig, SchedulerConfig
from common.services import NatsServer
from common.tokenizer import BaseTokenizer
from tests.reliability.conftest import StackFactory
from tests.reliability.harness import (
    Outcome,
    Process,
    body,
    completion,
    expected_text,
    group,
    write_config,
)

QUICK_BREAKER = BreakerConfig(
    window_samples=5, min_samples=3, p99_threshold_ms=300, wait_open_s=60.0, min_requests=1
)  # fmt: skip
SCHEDULER = SchedulerConfig(
    tick_interval_s=0.25, rebalance_interval_s=0.5, worker_silent_s=1.5, lease_ttl_s=1.5,
    lease_renew_s=0.3, metrics_port=0, move_replicas=False,
)  # fmt: skip


async def breaker_state(http: httpx.AsyncClient, url: str, group_name: str) -> str:
    return str((await http.get(f"{url}/health")).json()["groups"][group_name]["breaker"])


async def test_scheduler_killed_mid_incident_the_data_path_keeps_serving_on_the_last_state(
    private_nats: NatsServer, make_stack: StackFactory, tokenizer: BaseTokenizer, tmp_path: Path
) -> None:
    groups = {
        "short": group(4, fallback="long", breaker=QUICK_BREAKER, slo_e2e_p99_ms=300),
        "long": group(4, rank=1),
    }
    stack = make_stack(private_nats.url, groups, {"short": 1, "long": 1}, step_s=0.005)
    config = stack.config.model_copy(update={"scheduler": SCHEDULER})
    file = write_config(config, tmp_path / "qos.yaml")
    scheduler = Process("scheduler", ["-m", "scheduler", "--config", str(file)], tmp_path).start()
    url = f"{stack.base_url}/completions"
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            # An incident: short's steps slow down until the scheduler opens its breaker.
            await stack.acall(stack.workers["short-0"].set_slowdown(0.05))
            deadline = time.monotonic() + 30
            load: list[asyncio.Task[Outcome]] = []
            while await breaker_state(http, stack.url, "short") != "open":
                assert time.monotonic() < deadline, scheduler.log()[-2000:]
                assert scheduler.alive, scheduler.log()[-2000:]
                load.append(asyncio.create_task(completion(http, url, body(stack.model, 1, 8))))
                await asyncio.sleep(0.1)
            scheduler.kill()
            await asyncio.gather(*load)
            # Nobody runs the breakers now. Traffic keeps flowing on the last known state.
            during = await asyncio.gather(
                *(completion(http, url, body(stack.model, seed, 8)) for seed in range(20))
            )
            await asyncio.sleep(2.0)  # longer than a scheduler tick, lease and silence window
            later = await asyncio.gather(
                *(completion(http, url, body(stack.model, seed, 8)) for seed in range(20, 30))
            )
            assert await breaker_state(http, stack.url, "short") == "open"
            health = (await http.get(f"{stack.url}/health")).json()
    finally:
        scheduler.kill()
    for seed, outcome in enumerate(during + later):
        assert outcome.kind == "complete", outcome
        assert outcome.text == expected_text(tokenizer, 8, seed)
        assert outcome.headers["x-qos-group"] == "long"
        assert outcome.headers["x-qos-fallback-from"] == "short"
    assert health["groups"]["short"]["live_workers"] == 1  # workers' heartbeats need no scheduler
    assert health["groups"]["long"]["live_workers"] == 1
