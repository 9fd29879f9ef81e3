"""One serving "node" for the cross-process tests: an engine, optionally with the Redis tier.

``python -m tests.kvstore.node MODEL REDIS_URL BLOCK_SIZE PROMPT_JSON [--also-without-tier]``
serves one greedy request and prints one JSON line per run: the tokens, the prompt tokens
the engine computed, the tokens it loaded from the tier, and the tier's Redis counters.
"""

from __future__ import annotations

import json
import sys

import torch

from common.config import RedisConfig
from kvstore.tiers import KVTiers
from workers.engine import EngineArgs, LLMEngine, SamplingParams


def serve(model: str, block_size: int, prompt: list[int], tier: KVTiers | None) -> dict:
    args = EngineArgs(model, dtype="float32", block_size=block_size, num_kv_blocks=128)
    engine = LLMEngine(args, kv_tier=tier)
    engine.add_request(
        "r", prompt_token_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=8)
    )
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.token_ids
    stats = engine.stats()
    out = {
        "tokens": tokens,
        "prompt_tokens_computed": stats.num_prompt_tokens_computed,
        "tier_hits": stats.kv_tier_hits,
    }
    if tier is not None:
        tier.flush()
        out["redis"] = tier.stats().as_dict()["redis"]
    return out


def main() -> None:
    torch.set_num_threads(1)  # two cores shared with other jobs
    model, url, block_size, prompt_json = sys.argv[1:5]
    prompt = json.loads(prompt_json)
    if "--also-without-tier" in sys.argv:
        print(json.dumps({"tier": False, **serve(model, int(block_size), prompt, None)}))
    with KVTiers(RedisConfig(url=url)) as tier:
        print(json.dumps({"tier": True, **serve(model, int(block_size), prompt, tier)}))


if __name__ == "__main__":
    main()
