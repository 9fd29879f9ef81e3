"""A real serving stack on loopback: the gateway under uvicorn and workers over nats-server.

:class:`Stack` runs on an event loop of its own in a background thread, so a test reaches
it only as a client would (HTTP), from sync or async code alike, while the stack keeps
serving when the test blocks in a sync ``openai`` call. Workers run either in-process
(:meth:`Stack.add_worker`: a :class:`WorkerService` whose engine the test can inspect) or
as ``python -m workers`` children (:meth:`Stack.spawn_worker`: they can be ``kill -9``-ed).
Every chunk any worker publishes is recorded by request id (:attr:`Stack.chunks`), so a
test can tell which worker served a request and that no token went out twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import nats.js.errors
import uvicorn
import yaml
from nats.aio.client import Client
from nats.aio.msg import Msg

import common.nats as qnats
from common.config import Config
from common.protocol import Chunk
from common.services import die_with_parent, free_port
from common.tokenizer import BaseTokenizer
from gateway.app import create_app
from workers.engine.outputs import EngineStats
from workers.service import WorkerOptions, WorkerService

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class Stack:
    """Gateway + workers for ``config``; :meth:`start`, then :meth:`close` (or ``with``)."""

    def __init__(
        self,
        config: Config,
        tokenizer: BaseTokenizer,
        model: str,
        workdir: Path,
        *,
        admission_wait_s: float = 0.5,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        self.workdir = workdir
        self.admission_wait_s = admission_wait_s
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="e2e-stack", daemon=True)
        self.workers: dict[str, WorkerService] = {}
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.chunks: dict[str, list[Chunk]] = defaultdict(list)
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Future[None] | None = None
        self._nc: Client | None = None
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return f"{self.url}/v1"

    # --- running things on the stack's loop -----------------------------------------------

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run ``coro`` on the stack's loop and wait for it here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the stack's loop, awaiting it from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> Stack:
        self._thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        # The gateway's settings, so its inbox too (a secured server allows no other).
        self._nc = await qnats.connect(self.config.nats, "e2e-snoop", service="gateway")
        await self._nc.subscribe(f"{self.config.nats.subject_prefix}.out.*", cb=self._record)
        await qnats.barrier(self._nc)  # flush() may overtake the SUB
        app = create_app(
            self.config, self.tokenizer, model=self.model, admission_wait_s=self.admission_wait_s
        )
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._serve_task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise RuntimeError("uvicorn exited before it started")
            await asyncio.sleep(0.01)

    async def _record(self, msg: Msg) -> None:
        chunk = Chunk.from_bytes(msg.data, self.config.nats.max_payload_bytes)
        self.chunks[chunk.id].append(chunk)

    def close(self) -> None:
        """Stop children, workers and the gateway; delete this stack's stream and bucket."""
        for child in self.children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        with contextlib.suppress(Exception):
            self.call(self._stop(), timeout_s=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        await asyncio.gather(*(w.stop(grace_s=0) for w in self.workers.values()))
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            await self._serve_task
        if self._nc is not None:
            js = self._nc.jetstream()
            for stream in (self.config.nats.stream, f"KV_{self.config.nats.kv_bucket}"):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(stream)
            await self._nc.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- workers --------------------------------------------------------------------------

    def add_worker(self, worker_id: str, group: str, engine: Any) -> WorkerService:
        """Start an in-process replica of ``group`` on ``engine`` (LLMEngine or SimEngine)."""
        options = WorkerOptions(group=group, worker_id=worker_id, fetch_timeout_s=0.25)
        service = WorkerService(self.config, engine, options)
        self.call(service.start())
        self.workers[worker_id] = service
        return service

    def spawn_worker(self, worker_id: str, group: str, *flags: str) -> subprocess.Popen[bytes]:
        """Start ``python -m workers`` for ``group`` with this stack's config and ``flags``."""
        config_file = self.workdir / "qos.yaml"
        if not config_file.exists():
            config_file.write_text(yaml.safe_dump(self.config.model_dump(mode="json")))
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = (self.workdir / f"{worker_id}.log").open("wb")
        on_main = threading.current_thread() is threading.main_thread()
        child = subprocess.Popen(
            [sys.executable, "-m", "workers", "--config", str(config_file), "--group", group,
             "--worker-id", worker_id, *flags],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(os.getpid()) if on_main else None,
        )  # fmt: skip
        log.close()
        self.children[worker_id] = child
        return child

    def worker_log(self, worker_id: str) -> str:
        path = self.workdir / f"{worker_id}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def wait_live(self, want: dict[str, int], timeout_s: float = 60.0) -> None:
        """Until the gateway's ``/health`` counts ``want[group]`` live workers per group."""
        deadline = time.monotonic() + timeout_s
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            for worker_id, child in self.children.items():
                if child.poll() is not None:
                    raise RuntimeError(f"worker {worker_id} exited:\n{self.worker_log(worker_id)}")
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"{self.url}/health", timeout=2).json()
                live = {g: info["live_workers"] for g, info in health["groups"].items()}
                if all(live.get(g, 0) >= n for g, n in want.items()):
                    return
            time.sleep(0.05)
        raise TimeoutError(f"workers not live after {timeout_s}s: {health}")

    def engine_stats(self, worker_id: str) -> EngineStats:
        """A fresh stats snapshot from the worker's engine thread."""
        bridge = self.workers[worker_id].bridge
        assert bridge is not None
        return self.call(bridge.call(lambda engine: engine.stats()))

    def final_chunk(self, request_id: str, timeout_s: float = 5.0) -> Chunk:
        """The request's last chunk, once recorded: the client may have its answer first."""
        deadline = time.monotonic() + timeout_s
        while True:
            chunks = self.chunks.get(request_id, [])
            if chunks and chunks[-1].finish_reason is not None:
                return chunks[-1]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no final chunk of {request_id} recorded: {chunks}")
            time.sleep(0.01)

    def served_by(self, request_id: str) -> set[str]:
        """The workers that sent chunks for ``request_id``."""
        return {c.worker for c in self.chunks.get(request_id, [])}
