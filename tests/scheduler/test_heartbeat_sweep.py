"""The leader takes the heartbeat keys of workers long gone out of the state bucket: killed
workers left theirs for good, clean stops a purge marker, and the scrape-targets tool read
every one of them on each pass."""

from __future__ import annotations

import json
import time

import common.nats as qnats
from common.config import NatsConfig
from scheduler.heartbeat_sweep import sweep_heartbeats


def beat(worker: str, age_s: float) -> bytes:
    return json.dumps({"worker": worker, "ts_ms": (time.time() - age_s) * 1000}).encode()


async def test_stale_and_purged_heartbeats_go_live_ones_and_other_keys_stay(
    nats_config: NatsConfig, js
) -> None:
    kv = await qnats.ensure_kv(js, nats_config)
    await kv.put("workers.live", beat("live", 1))
    await kv.put("workers.killed", beat("killed", 3600))
    await kv.put("workers.stopped", beat("stopped", 1))
    await kv.purge("workers.stopped")  # a clean stop leaves this marker
    await kv.put("workers.odd", b"not json")
    await kv.put("desired.short", b"{}")
    removed = await sweep_heartbeats(js, kv, nats_config.kv_bucket, 600.0, time.time() * 1000)
    assert removed == ["workers.killed", "workers.stopped"]
    info = await js.stream_info(f"KV_{nats_config.kv_bucket}", subjects_filter=">")
    left = sorted(s.split(".", 2)[2] for s in info.state.subjects or {})
    assert left == ["desired.short", "workers.live", "workers.odd"]
