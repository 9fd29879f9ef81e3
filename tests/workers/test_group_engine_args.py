"""The worker builds its engine from its group's settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import Config, WorkerConfig, default_groups
from tests.engine.tiny_checkpoints import checkpoint
from workers.__main__ import _apply_flags, build_engine, build_parser


def test_the_groups_policy_batch_and_prefill_delay_reach_the_engine() -> None:
    torch.set_num_threads(1)
    groups = default_groups()
    groups["short"] = groups["short"].model_copy(
        update={"policy": "continuous", "prefill_delay_factor": 1.5}
    )
    config = Config(
        groups=groups, worker=WorkerConfig(model="dummy:tiny", device="cpu", kv_cache_gib=0.05)
    )
    engine = build_engine(config, build_parser().parse_args(["--group", "short"]))
    assert engine.batcher.policy == "continuous"
    assert engine.batcher.prefill_delay_factor == 1.5
    assert engine.batcher.max_batch_size == groups["short"].max_batch


def test_a_sliding_window_model_serves_a_long_group_up_to_its_window(tmp_path: Path) -> None:
    """Mistral-7B-v0.1 windows at 4096 with 32k positions; the long group asks 131072. The
    worker must cap at the window (where full attention is exact), not die at start."""
    torch.set_num_threads(1)
    folder = checkpoint("mistral", str(tmp_path))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(sliding_window=64, max_position_embeddings=512)
    (folder / "config.json").write_text(json.dumps(cfg))
    config = Config(worker=WorkerConfig(model=str(folder), device="cpu", kv_cache_gib=0.05))
    assert config.groups["long"].max_seq_len > 64
    engine = build_engine(config, build_parser().parse_args(["--group", "long"]))
    assert engine.max_seq_len == 64


def test_a_worker_sizes_its_kv_cache_for_its_device_unless_told() -> None:
    """No kv_cache_gib: the CPU default (on a GPU, the profiled share); the share flag
    reaches the engine."""
    from workers.engine.args import DEFAULT_CPU_KV_CACHE_GIB

    torch.set_num_threads(1)
    config = Config(worker=WorkerConfig(model="dummy:tiny", device="cpu"))
    assert config.worker.kv_cache_gib is None
    args = build_parser().parse_args(["--group", "short", "--gpu-memory-utilization", "0.4"])
    engine = build_engine(_apply_flags(config, args), args)
    assert engine.args.gpu_memory_utilization == 0.4
    per_block = engine.runner.bytes_per_block()
    assert engine.pool.num_blocks == int(DEFAULT_CPU_KV_CACHE_GIB * (1 << 30) // per_block)


def test_a_kv_cache_shorter_than_the_longest_group_serves_what_it_holds() -> None:
    """Built for every group, a worker whose cache cannot hold the longest group's limit
    refused to start; it now serves what the cache holds (and says so in its telemetry)."""
    torch.set_num_threads(1)
    config = Config(worker=WorkerConfig(model="dummy:tiny", device="cpu", kv_cache_gib=0.0005))
    engine = build_engine(config, build_parser().parse_args(["--group", "short"]))
    capacity = (engine.pool.num_blocks - engine.pool.watermark_blocks) * engine.pool.block_size
    assert engine.max_seq_len == capacity < max(g.max_seq_len for g in config.groups.values())


async def test_a_replica_moved_to_another_group_takes_its_batcher_settings() -> None:
    """Priority preemption and the prefill delay were read once, from the first group: a
    replica the rebalancer moved served its new group by the old one's settings."""
    import asyncio

    from workers.bridge import EngineBridge

    torch.set_num_threads(1)
    config = Config(worker=WorkerConfig(model="dummy:tiny", device="cpu", kv_cache_gib=0.05))
    short = config.groups["short"].model_copy(update={"priority_aging_s": 30.0})
    config = config.model_copy(update={"groups": {**config.groups, "short": short}})
    engine = build_engine(config, build_parser().parse_args(["--group", "short"]))
    b = engine.batcher
    assert (b.priority_preemption, b.prefill_delay_factor, b.priority_aging_s) == (True, 1.0, 30.0)
    bridge = EngineBridge(engine, lambda events: None, asyncio.get_running_loop())
    bridge.start()
    try:
        # What WorkerService._apply_group_limits sends.
        bridge.set_group_scheduling(False, 0.0, 0.0)
        settings = await bridge.call(
            lambda e: (
                e.batcher.priority_preemption,
                e.batcher.prefill_delay_factor,
                e.batcher.priority_aging_s,
            )
        )
    finally:
        await bridge.stop()
    assert settings == (False, 0.0, 0.0)


def test_a_max_batch_over_the_groups_is_said_not_silently_capped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine was built for --max-batch 16, then the long group's limit of 2 capped what
    ran, and nothing said so: the README read as if the flag overrode it."""
    import logging

    import workers.__main__ as worker_main

    def started(coro: Any) -> int:
        coro.close()  # not run: the warning comes before the service starts
        return 0

    monkeypatch.setattr(worker_main.runtime, "run", started)
    monkeypatch.setattr(worker_main, "init_tracing", lambda *a, **k: None)
    monkeypatch.setattr(worker_main, "setup_logging", lambda *a, **k: None)
    with caplog.at_level(logging.WARNING, logger="workers"):
        assert worker_main.main(["--group", "long", "--max-batch", "16", "--engine", "sim",
                                 "--model", "dummy:tiny"]) == 0  # fmt: skip
    assert any("groups.long.max_batch" in r.getMessage() for r in caplog.records)
