"""Prometheus file-SD targets from the workers' heartbeats in the state bucket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from common.config import NatsConfig
from common.nats import ensure_kv
from workers.scrape_targets import scrape_targets


async def test_live_workers_with_a_port_are_targets_and_the_rest_are_not(
    js: JetStreamContext, nats_config: NatsConfig
) -> None:
    kv = await ensure_kv(js, nats_config)
    now_ms = int(time.time() * 1000)

    def beat(worker: str, **kw: object) -> bytes:
        base = {"worker": worker, "group": "short", "host": "h", "metrics_port": 9400,
                "state": "serving", "ts_ms": now_ms}  # fmt: skip
        return json.dumps({**base, **kw}).encode()

    await kv.put("workers.a", beat("a"))
    await kv.put("workers.b", beat("b", metrics_port=0))  # no /metrics port
    await kv.put("workers.c", beat("c", state="stopped"))
    await kv.put("workers.d", beat("d", ts_ms=now_ms - 60_000))  # silent for a minute
    await kv.put("workers.e", beat("e", group="long", metrics_port=9401))
    await kv.put("workers.f", beat("f"))
    await kv.delete("workers.f")  # gone: its delete marker is still a subject
    await kv.put("breaker.short", b'{"state": "open"}')  # not a heartbeat
    # Heartbeats of other shapes: skipped, the rest still listed.
    await kv.put("workers.g", b"[1, 2]")
    await kv.put("workers.h", beat("h", metrics_port="nine"))
    await kv.put("workers.i", beat("i", ts_ms=None))
    await kv.put(
        "workers.j", json.dumps({"host": "h", "metrics_port": 1, "ts_ms": now_ms}).encode()
    )
    targets = await scrape_targets(js, nats_config.kv_bucket)
    assert targets == [
        {"targets": ["h:9400"], "labels": {"group": "short", "worker": "a"}},
        {"targets": ["h:9401"], "labels": {"group": "long", "worker": "e"}},
    ]


async def test_a_container_stop_sigterm_ends_the_loop_at_once(
    nats_config: NatsConfig, tmp_path: Path
) -> None:
    """It runs as PID 1 in the compose stack, where SIGTERM has no default action: docker
    waited its 10 s, then killed it. SIGTERM now ends it like Ctrl-C, with status 0."""
    out = tmp_path / "targets.json"
    env = {**os.environ, "QOS_NATS__URL": nats_config.url,
           "QOS_NATS__KV_BUCKET": nats_config.kv_bucket}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.scrape_targets", "--out", str(out), "--interval-s", "0.2"],
        env=env,
    )
    try:
        deadline = time.monotonic() + 20
        while not out.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
        proc.wait()


async def test_a_round_that_fails_leaves_the_file_and_the_next_one_writes_it(
    nats_config: NatsConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout reading the bucket ended the process: the file froze where nothing
    restarts it, and new workers were never scraped."""
    import workers.scrape_targets as module

    calls = 0
    real = module.scrape_targets

    async def flaky(*args: object) -> list[dict[str, object]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TimeoutError("nats: timeout")
        if calls == 3:
            raise asyncio.CancelledError  # ends the loop for the test
        return await real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "scrape_targets", flaky)
    monkeypatch.setenv("QOS_NATS__URL", nats_config.url)
    monkeypatch.setenv("QOS_NATS__KV_BUCKET", nats_config.kv_bucket)
    out = tmp_path / "targets.json"
    with pytest.raises(asyncio.CancelledError):
        await module.run(None, out, interval_s=0.01, max_age_s=30)
    assert calls == 3 and json.loads(out.read_text()) == []
