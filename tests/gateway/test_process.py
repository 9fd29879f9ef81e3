"""The gateway as it runs in production: its own process, and NATS going away and back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from common.config import NatsConfig
from common.services import NatsServer, free_port
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import running_worker


async def _wait_health(http: httpx.AsyncClient, status: int, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = await http.get("/health")
            if response.status_code == status:
                return response.json()
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"/health never answered {status}")
        await asyncio.sleep(0.05)


async def test_python_m_gateway_serves_and_stops_cleanly_on_sigterm(nats_config: NatsConfig):
    port = free_port()
    env = {
        **os.environ,
        "QOS_NATS__URL": nats_config.url,
        "QOS_NATS__SUBJECT_PREFIX": nats_config.subject_prefix,
        "QOS_NATS__STREAM": nats_config.stream,
        "QOS_NATS__KV_BUCKET": nats_config.kv_bucket,
    }
    argv = [sys.executable, "-m", "gateway", "--model", MODEL, "--port", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=2) as http:
            health = await _wait_health(http, 200)
            models = (await http.get("/v1/models")).json()
        assert set(health["groups"]) == {"realtime", "short", "long"}
        assert models["data"][0]["id"] == MODEL
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=15)[0].decode()
    # uvicorn re-raises the signal once it has shut down gracefully, as servers should.
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    assert "no API keys configured" in output


def test_python_m_gateway_without_nats_says_so_in_one_line() -> None:
    env = {**os.environ, "QOS_NATS__URL": f"nats://127.0.0.1:{free_port()}",
           "QOS_NATS__CONNECT_TIMEOUT_S": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "gateway", "--model", MODEL, "--port", str(free_port())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "qosserve-gateway:" in done.stderr and "Traceback" not in done.stderr


async def test_health_follows_the_nats_connection_and_serving_resumes_after_a_restart(
    nats_config: NatsConfig, fresh_nats_server: Callable[..., NatsServer]
):
    server = fresh_nats_server()
    config = gateway_config(nats_config.model_copy(update={"url": server.url}))
    async with (
        serve(config) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=5) as http,
    ):
        await _wait_health(http, 200)
        server.stop()
        down = await _wait_health(http, 503)
        server.start()
        await _wait_health(http, 200)
        async with running_worker(config.nats, "short"):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
            response = await http.post("/v1/completions", json=body)
    assert down["nats"] is False
    assert response.status_code == 200 and '"text":"abc"' in response.text
