"""Redis hung (SIGSTOP) or dead (SIGKILL) under a serving worker: the worker service keeps
answering, token for token what it answers without any tier, at the cost of recomputing
prefixes, never an error or a stall. The engine-level view is in
``tests/kvstore/test_engine_tiers.py``; here it goes through NATS and the worker service.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch

from common.client import QosClient
from common.config import Config, NatsConfig, RedisConfig, WorkerConfig
from common.protocol import RequestParams
from common.services import RedisServer
from kvstore.redis_tier import CircuitBreaker
from kvstore.tiers import KVTiers
from tests.engine.tiny_checkpoints import checkpoint
from tests.reliability.harness import group
from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.service import WorkerOptions, WorkerService

BS = 4
MAX_TOKENS = 6


def prompt(seed: int, n: int = 5 * BS + 2) -> list[int]:
    return [(seed * 31 + 7 * i) % 290 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return checkpoint("llama", str(tmp_path_factory.mktemp("rel-ckpt")))


def engine(model: Path, tier: KVTiers | None = None, **kw: object) -> LLMEngine:
    args = dict(dtype="float32", block_size=BS, num_kv_blocks=64, max_batch_size=4) | kw
    return LLMEngine(EngineArgs(str(model), **args), kv_tier=tier)  # type: ignore[arg-type]


def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens without any tier or prefix cache."""
    eng = engine(model, enable_prefix_caching=False)
    outs = []
    for i, p in enumerate(prompts):
        eng.add_request(f"ref{i}", prompt_token_ids=p,
                        params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))  # fmt: skip
        tokens: list[int] = []
        while eng.has_unfinished():
            for delta in eng.step():
                tokens += delta.token_ids
        outs.append(tokens)
    return outs


@pytest.fixture
async def tiered_worker(
    tiny_llama: Path, fresh_redis_server: Callable[..., RedisServer], nats_config: NatsConfig
) -> AsyncIterator[tuple[WorkerService, KVTiers, RedisServer, QosClient]]:
    server = fresh_redis_server()
    redis = RedisConfig(url=server.url, socket_timeout_s=0.2)
    config = Config(
        nats=nats_config, redis=redis, groups={"short": group(4)},
        worker=WorkerConfig(telemetry_interval_s=0.2),
    )  # fmt: skip
    tier = KVTiers(redis, breaker=CircuitBreaker(failures_to_open=1, open_s=0.3))
    service = WorkerService(
        config, engine(tiny_llama, tier), WorkerOptions(group="short", worker_id="tiered")
    )
    await service.start()
    client = await QosClient.connect(config, "redis-faults")
    try:
        yield service, tier, server, client
    finally:
        await client.close()
        await service.stop(grace_s=0)
        tier.close()
        with_pid = server.pid
        if with_pid is not None:  # never leave it stopped: SIGKILL needs no CONT, close does
            os.kill(with_pid, signal.SIGCONT)


async def serve(client: QosClient, prompts: list[list[int]]) -> list[list[int]]:
    async def one(p: list[int]) -> list[int]:
        ids, _, final = await client.collect(
            group="short", prompt_token_ids=p, timeout_s=30,
            params=RequestParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        )  # fmt: skip
        assert final.finish_reason == "length"
        return ids

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def test_redis_hung_then_killed_under_the_worker_costs_recompute_never_a_request(
    tiered_worker: tuple[WorkerService, KVTiers, RedisServer, QosClient], tiny_llama: Path
) -> None:
    service, tier, server, client = tiered_worker
    warm, hung, dead = (
        [prompt(s) for s in (1, 2, 3)],
        [prompt(s) for s in (4, 5, 6)],
        [prompt(s) for s in (7, 8, 9)],
    )
    expected = reference(tiny_llama, warm + hung + dead)

    assert await serve(client, warm) == expected[:3]
    assert await asyncio.to_thread(tier.flush)
    assert tier.stats().redis.store_blocks > 0  # the tier was in use

    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)  # hung: connections open, no answers
    started = time.monotonic()
    assert await serve(client, hung) == expected[3:6]
    hung_s = time.monotonic() - started
    os.kill(server.pid, signal.SIGCONT)

    server.kill()
    assert await serve(client, dead) == expected[6:]
    stats = tier.stats()
    assert stats.redis.errors >= 1 and stats.breaker_opens >= 1
    assert hung_s < 5, f"a hung Redis stalled the worker {hung_s:.1f}s"
    assert service.state == "serving" and service.bridge is not None and service.bridge.alive
