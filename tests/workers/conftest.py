"""Worker fixtures: in-process replicas on a sim engine, subprocess replicas, a client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.client import QosClient
from common.config import Config, NatsConfig, WorkerConfig, default_groups
from common.subjects import Subjects
from workers.service import WorkerOptions, WorkerService
from workers.sim import SimCost, SimEngine, sim_token

ROOT = Path(__file__).resolve().parents[2]
FAST = SimCost(base_s=0.0, prefill_s_per_token=0.0, decode_s_per_seq=0.0)


def expected_tokens(prompt_len: int, n: int, seed: int = 0) -> list[int]:
    """What the sim engine generates after a prompt of ``prompt_len`` tokens."""
    return [sim_token(seed, prompt_len + i) for i in range(n)]


@pytest.fixture
def worker_config(nats_config: NatsConfig) -> Config:
    """Short ack_wait (redelivery tests), fast telemetry, a tiny `short` group."""
    groups = default_groups()
    groups["short"] = groups["short"].model_copy(update={"max_batch": 4, "max_seq_len": 256})
    return Config(
        nats=nats_config.model_copy(update={"ack_wait_s": 2.0}),
        groups=groups,
        worker=WorkerConfig(telemetry_interval_s=0.2, coalesce_ms=2.0),
    )


@pytest.fixture
async def start_worker(worker_config: Config) -> AsyncIterator[Callable[..., Any]]:
    """``await start_worker(engine=None, group="short", **options)`` → a started service."""
    started: list[WorkerService] = []

    async def start(
        engine: Any = None, group: str = "short", config: Config | None = None, **options: Any
    ) -> WorkerService:
        cfg = config or worker_config
        if engine is None:
            engine = SimEngine(
                max_batch_size=cfg.groups[group].max_batch, max_seq_len=256, cost=FAST
            )
        opts = WorkerOptions(
            group=group,
            worker_id=options.pop("worker_id", f"w{len(started)}"),
            fetch_timeout_s=0.25,  # stopping waits out one long-poll
        )
        for key, value in options.items():
            setattr(opts, key, value)
        service = WorkerService(cfg, engine, opts)
        await service.start()
        started.append(service)
        return service

    yield start
    await asyncio.gather(*(s.stop(grace_s=0) for s in started))


@pytest.fixture
async def client(worker_config: Config) -> AsyncIterator[QosClient]:
    async with await QosClient.connect(worker_config, "test-client") as c:
        yield c


@pytest.fixture
def subjects(worker_config: Config) -> Subjects:
    return Subjects(worker_config.nats.subject_prefix)


@pytest.fixture
def spawn_worker(
    worker_config: Config, tmp_path: Path
) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``spawn_worker(worker_id, *flags)`` runs ``python -m workers`` (sim engine) in a child."""
    config_file = tmp_path / "qos.yaml"
    config_file.write_text(yaml.safe_dump(worker_config.model_dump(mode="json")))
    children: list[subprocess.Popen[bytes]] = []

    def spawn(worker_id: str, *flags: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        log = (tmp_path / f"{worker_id}.log").open("wb")
        child = subprocess.Popen(
            [sys.executable, "-m", "workers", "--config", str(config_file), "--group", "short",
             "--engine", "sim", "--model", "dummy:tiny", "--worker-id", worker_id, *flags],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        children.append(child)
        return child

    yield spawn
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()


def new_id() -> str:
    return uuid.uuid4().hex
