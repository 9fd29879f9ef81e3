"""Prefix-cache namespaces: requests reuse cached prompt blocks only within their cache_salt,
on the engine and through a worker over real NATS."""

from __future__ import annotations

from typing import Any

from common.client import QosClient
from common.protocol import RequestParams
from workers.engine import EngineArgs, LLMEngine, SamplingParams

PROMPT = list(range(1, 50))  # three full 16-token blocks, then one token to compute


def _engine() -> LLMEngine:
    return LLMEngine(
        EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_batch_size=4,
                   max_seq_len=256, policy="continuous")
    )  # fmt: skip


def _run(engine: LLMEngine, request_id: str, salt: str) -> tuple[list[int], int]:
    """(output tokens, prompt tokens served from the prefix cache) of one greedy request."""
    engine.add_request(
        request_id, prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=4),
        cache_salt=salt,
    )  # fmt: skip
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished and delta.output is not None:
                out = delta.output
    return list(out.token_ids), out.num_cached_tokens


def test_requests_share_cached_prefixes_only_under_the_same_salt() -> None:
    engine = _engine()
    first, cached = _run(engine, "a1", "team-a")
    assert cached == 0
    other_team, cached_other = _run(engine, "b1", "team-b")
    unsalted, cached_unsalted = _run(engine, "u1", "")
    same_team, cached_same = _run(engine, "a2", "team-a")
    assert cached_other == 0 and cached_unsalted == 0  # computed again: nothing shared
    assert cached_same == 48  # the three full blocks team-a computed
    assert first == other_team == unsalted == same_team  # a namespace changes no output
    assert engine.stats().num_free_blocks == engine.stats().num_blocks  # nothing leaked


async def test_a_worker_keeps_namespaces_apart_for_direct_callers(
    start_worker: Any, client: QosClient
) -> None:
    await start_worker(engine=_engine())
    params = RequestParams(max_tokens=3, temperature=0)

    async def cached(salt: str) -> int:
        *_, final = await client.collect(
            group="short", prompt_token_ids=PROMPT, params=params, cache_salt=salt
        )
        assert final.usage is not None
        return final.usage.cached_tokens

    assert await cached("tenant-1") == 0
    assert await cached("tenant-2") == 0
    assert await cached("tenant-1") == 48
