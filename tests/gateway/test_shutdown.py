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
    try:
        while not server.started:
            assert not serving.done()
            await asyncio.sleep(0.01)
        lines, took, aborts, request_id = await _stream_then_stop(nats_config, port, server)
        await asyncio.wait_for(serving, 10)
    finally:
        server.should_exit = server.force_exit = True
        await asyncio.wait_for(serving, 10)
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
    assert took > 0.5  # at the graceful timeout less the margin, not at once
    assert [a.request_id for a in aborts] == [request_id]  # the worker stops


async def _stream_then_stop(
    nats_config: NatsConfig, port: int, server: GatewayServer
) -> tuple[list[str], float, list[Control], str]:
    """Stream one request; once its first token is out, stop the server as SIGTERM does.
    Returns the stream's data lines, how long it ran on after, the aborts seen, its id."""
    aborts: list[Control] = []
    async with running_worker(nats_config, "short", behaviour=_one_token_then_silence) as worker:
        nc = Client()
        await nc.connect(nats_config.url)
        try:
            subjects = Subjects(nats_config.subject_prefix)

            async def on_abort(msg: Msg) -> None:
                aborts.append(Control.from_bytes(msg.data))

            await nc.subscribe(subjects.abort("short"), cb=on_abort)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}
            lines: list[str] = []
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
                http.stream("POST", "/v1/completions", json=body) as response,
            ):
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1:  # the first token is out: SIGTERM now
                            started = time.monotonic()
                            # What its SIGTERM handler does (called here: uvicorn would
                            # raise the signal again once stopped).
                            server.begin_shutdown()
                            server.should_exit = True
            took = time.monotonic() - started
            for _ in range(100):  # the abort follows the stream's end
                if aborts:
                    break
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
        return lines, took, aborts, worker.jobs[0].request.id
