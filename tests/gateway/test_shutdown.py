"""A gateway told to stop ends the streams still open with an error the client can act on,
just before uvicorn's graceful timeout would cut them mid-body."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import uvicorn
from nats.aio.client import Client
from nats.aio.msg import Msg

from common.config import NatsConfig
from common.protocol import Control
from common.services import free_port
from common.subjects import Subjects
from common.tokenizer import ByteTokenizer
from gateway.app import create_app
from gateway.server import GatewayServer
from tests.gateway.conftest import MODEL, gateway_config
from tests.gateway.fake_worker import Job, alphabet_tokens, running_worker


async def _one_token_then_silence(job: Job) -> None:
    await job.send(0, alphabet_tokens(1))
    await asyncio.sleep(3600)


async def test_open_streams_end_with_a_503_event_before_the_graceful_timeout(
    nats_config: NatsConfig,
):
    config = gateway_config(nats_config)
    app = create_app(config, ByteTokenizer(), model=MODEL, admission_wait_s=0.3)
    port = free_port()
    uv = {"host": "127.0.0.1", "port": port, "log_level": "warning", "lifespan": "on"}
    server = GatewayServer(
        uvicorn.Config(app, timeout_graceful_shutdown=2, **uv),
        app.state.gateway.dispatch,
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done()
        await asyncio.sleep(0.01)
    aborts: list[Control] = []
    async with running_worker(nats_config, "short", behaviour=_one_token_then_silence) as worker:
        nc = Client()
        await nc.connect(nats_config.url)
        subjects = Subjects(nats_config.subject_prefix)

        async def on_abort(msg: Msg) -> None:
            aborts.append(Control.from_bytes(msg.data))

        await nc.subscribe(subjects.abort("short"), cb=on_abort)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            lines: list[str] = []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1:  # the first token is out: SIGTERM now
                            started = time.monotonic()
                            # What its SIGTERM handler does (called here, uvicorn
                            # would raise the signal again once stopped).
                            server.begin_shutdown()
                            server.should_exit = True
            took = time.monotonic() - started
        await asyncio.wait_for(serving, 10)
        await asyncio.sleep(0.2)
        await nc.close()
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
    assert 0.5 < took < 2.0  # at the graceful timeout less the margin, not at once
    assert [a.request_id for a in aborts] == [worker.jobs[0].request.id]  # the worker stops
