"""The KV-tier benchmark's pieces: the break-even formula and one transport measurement."""

from __future__ import annotations

import pytest

from bench.kvtier import break_even_formula, tier_point, transport_point
from common.services import RedisServer
from kvstore.identity import KVLayout

SMALL = KVLayout(block_size=4, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)


def test_loading_never_pays_when_the_link_is_slower_than_prefill_produces_kv() -> None:
    out = break_even_formula({"link": 1.0}, fixed_ms=1.0)["link"]
    assert out["pays_below_prefill_tok_s"] == pytest.approx(1e9 / 131072)  # Llama-8B, bf16
    table = out["break_even_tokens_by_prefill_tok_s"]
    # 5k tok/s: 1 ms / (1/5000 - 131072/1e9) s per token = 14.6 tokens
    assert table["5000"] == pytest.approx(14.6, abs=0.1)
    assert table["10000"] is None and table["40000"] is None


def test_transport_and_tier_points_move_every_block(redis_server: RedisServer) -> None:
    point = transport_point(redis_server.url, redis_server.pid, SMALL, 2, 1 << 14, 1 << 18)
    assert point["blocks"] == (1 << 18) // SMALL.block_bytes
    for op in ("store", "load"):
        assert point[op]["gbps"] > 0 and point[op]["client_cpu_s_per_gb"] >= 0
    tier = tier_point(redis_server.url, redis_server.pid, SMALL, "crc32", 1 << 18)
    assert tier["load"]["ms_per_block"] > 0
