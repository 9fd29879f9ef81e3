"""Gateway fixtures: a small config, the app served by uvicorn on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from common.config import Config, GatewayConfig, NatsConfig, default_groups
from common.services import free_port
from common.tokenizer import BaseTokenizer, ByteTokenizer
from gateway.app import create_app
from gateway.server import uvicorn_config

MODEL = "dummy:tiny"


def gateway_config(nats_config: NatsConfig, **overrides: Any) -> Config:
    """Three groups with small limits; ``short__max_pending=2`` style overrides per group."""
    groups = default_groups()
    limits = {"realtime": 64, "short": 256, "long": 2048}
    for name, limit in limits.items():
        groups[name] = groups[name].model_copy(update={"max_seq_len": limit})
    gateway_kwargs: dict[str, Any] = {}
    for key, value in overrides.items():
        if "__" in key:
            group, field = key.split("__", 1)
            groups[group] = groups[group].model_copy(update={field: value})
        else:
            gateway_kwargs[key] = value
    return Config(
        nats=nats_config,
        groups=groups,
        gateway=GatewayConfig(default_max_tokens=16, max_body_bytes=64 * 1024, **gateway_kwargs),
    )


@dataclass
class Served:
    app: FastAPI
    url: str
    config: Config

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@contextlib.asynccontextmanager
async def serve(
    config: Config, tokenizer: BaseTokenizer | None = None, **app_kwargs: Any
) -> AsyncIterator[Served]:
    """Run the gateway with uvicorn in this event loop until the block ends."""
    app_kwargs.setdefault("admission_wait_s", 0.3)
    app_kwargs.setdefault("model", MODEL)
    app = create_app(config, tokenizer or ByteTokenizer(), **app_kwargs)
    port = free_port()
    server = uvicorn.Server(
        uvicorn_config(app, config, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 30
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn exited before it started")
        if time.monotonic() > deadline:
            server.force_exit = server.should_exit = True
            raise RuntimeError("the gateway did not start within 30 s")
        await asyncio.sleep(0.01)
    try:
        yield Served(app, f"http://127.0.0.1:{port}", config)
    finally:
        server.should_exit = True
        try:
            # A graceful stop waits for open connections; never let teardown hang a run.
            await asyncio.wait_for(asyncio.shield(task), 15)
        except TimeoutError:
            server.force_exit = True
            await asyncio.wait_for(task, 15)


@pytest.fixture
async def gateway(nats_config: NatsConfig) -> AsyncIterator[Served]:
    """The gateway with the default test config."""
    async with serve(gateway_config(nats_config)) as served:
        yield served


async def until_live(http: Any, group: str, timeout_s: float = 10.0) -> None:
    """Wait for the gateway (``http``: an httpx client on it) to count a live worker in
    ``group``: requests sent before its first report would wait for it, or answer 503."""
    deadline = time.monotonic() + timeout_s
    while (await http.get("/health")).json()["groups"][group]["live_workers"] < 1:
        if time.monotonic() > deadline:
            raise AssertionError(f"no live worker of {group!r} after {timeout_s} s")
        await asyncio.sleep(0.02)
