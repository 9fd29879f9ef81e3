"""Two engines in separate processes share one Redis: a prefix computed on node A is loaded,
not recomputed, on node B, and B's tokens are the ones it computes without the tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common.config import RedisConfig

BS = 4
ROOT = Path(__file__).resolve().parents[2]


def node(model: Path, redis: RedisConfig, prompt: list[int], *extra: str) -> list[dict]:
    argv = [str(model), redis.url, str(BS), json.dumps(prompt), *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kvstore.node", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_node_b_computes_only_the_tail_that_node_a_did_not_store(
    tiny_llama: Path, redis_config: RedisConfig
) -> None:
    prompt = [(7 * i) % 290 + 3 for i in range(6 * BS + 3)]  # 6 full blocks, then 3 tokens
    (a,) = node(tiny_llama, redis_config, prompt)
    assert a["tier_hits"] == 0 and a["prompt_tokens_computed"] == len(prompt)
    # 27 prompt + 7 fed-back generated tokens: 8 full blocks, generated ones included.
    assert a["redis"]["store_blocks"] == 8

    off, on = node(tiny_llama, redis_config, prompt, "--also-without-tier")
    assert off["prompt_tokens_computed"] == len(prompt)
    assert on["tier_hits"] == 6 * BS
    assert on["prompt_tokens_computed"] == 3  # the tail after the last full block
    assert on["redis"]["hit_tokens"] == 6 * BS and on["redis"]["corrupt"] == 0
    assert on["tokens"] == off["tokens"] == a["tokens"]
