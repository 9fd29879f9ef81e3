"""The chaos soak's stack (``bench/chaos.py``): nats-server, redis-server, the scheduler, sim
workers and a gateway as child processes it can kill and restart one by one, with their
state on disk so a restarted server finds its streams."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.serve_stack import write_word_tokenizer
from common.config import (
    Config,
    GatewayConfig,
    GroupConfig,
    NatsConfig,
    RedisConfig,
    SchedulerConfig,
    WorkerConfig,
)
from common.services import NatsServer, RedisServer, die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]


class Child:
    """One service process, restartable, its output appended to a log file."""

    def __init__(self, name: str, argv: list[str], logs: Path) -> None:
        self.name, self.argv, self.log_path = name, argv, logs / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.argv], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(os.getpid()),
            )  # fmt: skip

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


class ChaosStack:
    """nats, redis, scheduler, sim workers and a gateway, all restartable."""

    def __init__(self, state: Path, workers: int, step_ms: float) -> None:
        self.state = state
        self.logs = state / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model_dir = write_word_tokenizer(state / "words")
        self.nats = NatsServer(store_dir=state / "nats")
        self.redis = RedisServer(state_dir=state / "redis")
        self.port = free_port()
        self.config_file = state / "qos.yaml"
        cfg = ["--config", str(self.config_file)]
        self.scheduler = Child("scheduler", ["-m", "scheduler", *cfg], self.logs)
        self.gateway = Child(
            "gateway", ["-m", "gateway", *cfg, "--model", str(self.model_dir), "--port",
                        str(self.port)], self.logs,
        )  # fmt: skip
        self.workers = [
            Child(f"worker-{i}", ["-m", "workers", *cfg, "--group", "short", "--engine", "sim",
                                  "--model", str(self.model_dir), "--worker-id", f"chaos-{i}",
                                  "--sim-base-ms", str(step_ms), "--sim-prefill-us-per-token",
                                  "0", "--sim-decode-us-per-seq", "0", "--grace-s", "2"],
                  self.logs)
            for i in range(workers)
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.model_dir.name

    def write_config(self) -> None:
        config = Config(
            nats=NatsConfig(url=self.nats.url, ack_wait_s=3.0, reconnect_wait_s=0.1,
                            connect_timeout_s=5.0),
            redis=RedisConfig(url=self.redis.url),
            groups={"short": GroupConfig(max_batch=8, max_seq_len=512, slo_ttft_ms=2000,
                                         slo_e2e_p99_ms=20_000, max_pending=128)},
            gateway=GatewayConfig(default_max_tokens=16),
            worker=WorkerConfig(telemetry_interval_s=0.5),
            scheduler=SchedulerConfig(metrics_port=0, move_replicas=False),
        )  # fmt: skip
        data = {**config.model_dump(mode="json"), "groups_replace_defaults": True}
        self.config_file.write_text(yaml.safe_dump(data))

    async def start(self) -> None:
        self.nats.start()
        self.redis.start()
        self.write_config()
        self.gateway.start()  # first: it creates the stream, consumers and bucket
        await self.wait_health(lambda h: h.get("nats") is True, 60)
        self.scheduler.start()
        for worker in self.workers:
            worker.start()
        n = len(self.workers)
        await self.wait_health(lambda h: h["groups"]["short"]["live_workers"] >= n, 120)

    async def wait_health(self, ok: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    if ok((await http.get(f"{self.url}/health")).json()):
                        return
                await asyncio.sleep(0.2)
        raise TimeoutError(f"stack not ready; see {self.logs}")

    def children(self) -> list[Child]:
        return [self.gateway, *self.workers, self.scheduler]

    def close(self) -> None:
        for child in self.children():
            child.stop()
        self.nats.close()
        self.redis.close()


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None
