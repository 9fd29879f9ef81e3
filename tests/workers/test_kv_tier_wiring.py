"""The worker gives its engine the KV tiers the config asks for, and they carry a prefix."""

from __future__ import annotations

import torch

from common.config import Config, RedisConfig, WorkerConfig
from workers.__main__ import build_engine, build_kv_tier, build_parser
from workers.engine import SamplingParams


def test_no_tier_unless_asked() -> None:
    assert build_kv_tier(Config()) is None


def test_worker_engine_with_the_redis_tier_serves_a_prefix_a_twin_engine_stored(
    redis_config: RedisConfig,
) -> None:
    torch.set_num_threads(1)
    config = Config(
        redis=redis_config,
        worker=WorkerConfig(model="dummy:tiny", device="cpu", kv_redis=True, kv_cache_gib=0.05),
    )
    args = build_parser().parse_args(["--group", "short", "--engine", "real"])
    prompt = list(range(1, 70))  # four full blocks of 16 and a tail
    params = SamplingParams(temperature=0, max_tokens=4)
    first, second = build_engine(config, args), build_engine(config, args)
    try:
        assert first.kv_tier is not None
        first.add_request("a", prompt_token_ids=prompt, params=params)
        out_a = _run(first)
        first.kv_tier.flush(timeout_s=5.0)  # write-through is asynchronous
        second.add_request("b", prompt_token_ids=prompt, params=params)
        out_b = _run(second)
        assert out_b == out_a
        assert second.stats().kv_tier_hits >= 64  # the four full blocks came from Redis
        # What an operator sees of it (issue 5: bytes and latency per load/store, drops).
        families = _scrape(first, "store"), _scrape(second, "load")
        for samples, op in zip(families, ("store", "load"), strict=True):
            labels = {"group": "short", "model": "dummy:tiny", "tier": "redis", "op": op}
            assert (
                _value(samples, "qos_kv_tier_bytes_total", labels) >= 4 * first.kv_tier.block_bytes
            )
            assert _value(samples, "qos_kv_tier_operations_total", labels) >= 1
            assert _value(samples, "qos_kv_tier_seconds_total", labels) > 0
            tier = {"group": "short", "model": "dummy:tiny", "tier": "redis"}
            for name in ("dropped_blocks", "corrupt_values", "errors"):
                assert _value(samples, f"qos_kv_tier_{name}_total", tier) == 0
    finally:
        for engine in (first, second):
            engine.kv_tier.close()


def _run(engine) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.extend(delta.token_ids)
    return tokens


def _scrape(engine, op: str) -> list:  # type: ignore[no-untyped-def]
    """The engine's metric samples as a worker's /metrics gives them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from workers.metrics import EngineCollector, EngineView

    registry = CollectorRegistry()
    view = EngineView("short", engine.stats(), 4, 0.0, engine.kv_tier)
    registry.register(EngineCollector("dummy:tiny", lambda: view))
    text = generate_latest(registry).decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _value(samples: list, name: str, labels: dict[str, str]) -> float:  # type: ignore[type-arg]
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, [s for s in samples if s.name == name])
    return float(found[0])
