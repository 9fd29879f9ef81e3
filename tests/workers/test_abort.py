"""A client abort reaches the real engine: the request stops and its KV blocks are freed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common.client import QosClient
from common.protocol import RequestParams
from workers.engine import EngineArgs, LLMEngine
from workers.engine.outputs import EngineStats


async def test_client_abort_stops_the_request_and_frees_its_kv_blocks(
    start_worker: Any, client: QosClient
) -> None:
    engine = LLMEngine(
        EngineArgs(
            model="dummy:tiny", device="cpu", num_kv_blocks=64, max_batch_size=4, max_seq_len=512,
            policy="continuous",
        )
    )  # fmt: skip
    service = await start_worker(engine=engine)
    params = RequestParams(max_tokens=400, ignore_eos=True, temperature=0)
    stream = client.generate(group="short", prompt_token_ids=list(range(1, 40)), params=params)
    received = 0
    async for chunk in stream:
        received += len(chunk.token_ids)
        if received >= 3:
            break
    busy: EngineStats = await service.bridge.call(lambda e: e.stats())
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks
    await stream.aclose()  # leaving the stream publishes the abort on the group's control subject

    deadline = time.monotonic() + 10
    while True:
        stats: EngineStats = await service.bridge.call(lambda e: e.stats())
        if stats.num_running == 0 and not service.inflight_ids:
            break
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_generation_tokens < 100  # stopped long before its 400 tokens
