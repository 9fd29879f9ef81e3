"""Shared fixtures: real ``nats-server`` / ``redis-server`` processes and configs for them.

- ``nats_server`` / ``redis_server``: one per session, for tests that leave them running.
- ``fresh_nats_server`` / ``fresh_redis_server``: factories for tests that kill or
  restart a server; each call starts a new one, stopped at the end of the test.
- ``nats_config``: a :class:`NatsConfig` for the session server with a subject prefix,
  stream and KV bucket of its own, so tests never see each other's messages; the stream
  and bucket are deleted afterwards. Point it at a fresh server with
  ``nats_config.model_copy(update={"url": server.url})``.
- ``nc`` / ``js``: a connected client (closed afterwards) and its JetStream context.
- ``redis_config``: a :class:`RedisConfig` for the session server, database flushed first.
- every test leaves the root logger's handlers and level as it found them.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
import redis
from nats.aio.client import Client
from nats.js import JetStreamContext

import common.nats as qnats
from common.config import NatsConfig, RedisConfig
from common.services import NatsServer, RedisServer


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A test that runs a service's ``main()`` installs the service's log handler on the
    root logger, writing to the stream pytest captured for that test: put the root logger
    back afterwards, or later tests log into a closed stream ("Logging error")."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A JetStream-enabled nats-server shared by the whole session."""
    with NatsServer(store_dir=tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server (no persistence) shared by the whole session."""
    with RedisServer(state_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def fresh_nats_server(tmp_path: Path) -> Iterator[Callable[..., NatsServer]]:
    """``fresh_nats_server(**kwargs)`` starts a private nats-server (NatsServer kwargs)."""
    started: list[NatsServer] = []

    def start(**kwargs: Any) -> NatsServer:
        kwargs.setdefault("store_dir", tmp_path / f"nats{len(started)}")
        server = NatsServer(**kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.close()


@pytest.fixture
def fresh_redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``fresh_redis_server(**kwargs)`` starts a private redis-server (RedisServer kwargs)."""
    started: list[RedisServer] = []

    def start(**kwargs: Any) -> RedisServer:
        kwargs.setdefault("state_dir", tmp_path / f"redis{len(started)}")
        server = RedisServer(**kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.close()


@pytest.fixture
async def nats_config(nats_server: NatsServer) -> AsyncIterator[NatsConfig]:
    """A config with names of its own on the session server; its stream/bucket go after."""
    tag = uuid.uuid4().hex[:10]
    cfg = NatsConfig(
        url=nats_server.url,
        subject_prefix=f"t{tag}",
        stream=f"QOS_REQ_{tag}",
        kv_bucket=f"qos_state_{tag}",
        connect_timeout_s=2.0,
        reconnect_wait_s=0.1,
    )
    yield cfg
    if not nats_server.running:
        return
    nc = await qnats.connect(cfg, "conftest-cleanup")
    js = nc.jetstream()
    for stream in (cfg.stream, f"KV_{cfg.kv_bucket}"):
        with contextlib.suppress(nats.js.errors.NotFoundError):  # never created
            await js.delete_stream(stream)
    await nc.close()


@pytest.fixture
async def nc(nats_config: NatsConfig, request: pytest.FixtureRequest) -> AsyncIterator[Client]:
    """A client connected with ``nats_config``, named after the test."""
    client = await qnats.connect(nats_config, request.node.name[:64])
    yield client
    await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    """The JetStream context of ``nc``."""
    return nc.jetstream()


@pytest.fixture
def redis_config(redis_server: RedisServer) -> RedisConfig:
    """A config for the session Redis, with its database emptied first."""
    client = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    client.flushdb()
    client.close()
    return RedisConfig(url=redis_server.url, password=redis_server.password)
