"""The HTTP clients of ``bench/serve.py``: a streamed completion in, its timings out.

Both read the gateway's server-sent events the same way (:class:`EventClock`): TTFT is
the first event with text, ITL the gaps between text events, E2E the whole response,
the output token count the ``usage`` event's.

- ``httpx`` (the default): httpx's async client, in many small connection pools rather
  than one big one, because httpcore's pool does work quadratic in its connections on
  every request.
- ``raw``: HTTP/1.1 over asyncio streams with keep-alive connections and nothing else,
  about a tenth of httpx's CPU per request. At hundreds of requests a second the load
  generator shares the cores with what it measures, so its own cost must stay small.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

CLIENTS = ("httpx", "raw")
# Connections to the gateway: at most this many, in httpx pools of this size.
MAX_CONNECTIONS = 1024
POOL_CONNECTIONS = 16


@dataclass
class Result:
    """One request as the client saw it; times in seconds (``start`` from the run's start)."""

    start: float = 0.0
    scheduled: float = 0.0  # when the arrival process meant it to start
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


def token_events(model: str) -> dict[str, Any]:
    """Body fields that give every generated token an SSE event of its own: a ``dummy:*``
    model's byte tokenizer gives most tokens no text, and the gateway sends an event only
    for text (or logprobs), so most streams had no event to time a first token by."""
    return {"logprobs": 0} if model.startswith("dummy:") else {}


class EventClock:
    """Times one response's SSE events into its :class:`Result`."""

    def __init__(self, res: Result) -> None:
        self.res = res
        self.t0 = self.last = time.perf_counter()

    def data(self, payload: str) -> bool:
        """Take one ``data:`` payload; True when the stream is over."""
        res = self.res
        if payload == "[DONE]":
            res.ok = not res.error
            return True
        event = json.loads(payload)
        if "error" in event:
            res.error = str(event["error"].get("code"))
            return False
        if event.get("usage"):
            res.output_tokens = event["usage"]["completion_tokens"]
        choice = event["choices"][0] if event.get("choices") else {}
        if choice.get("text") or (choice.get("logprobs") or {}).get("tokens"):
            now = time.perf_counter()
            if res.ttft is None:
                res.ttft = now - self.t0
            else:
                res.itl.append(now - self.last)
            self.last = now
        return False

    def done(self) -> None:
        self.res.e2e = time.perf_counter() - self.t0


class Sender(Protocol):
    async def send(self, i: int, path: str, body: dict[str, Any], res: Result) -> None: ...


@contextlib.asynccontextmanager
async def open_sender(
    kind: str, base_url: str, max_concurrency: int | None
) -> AsyncIterator[Sender]:
    """The ``kind`` client for ``base_url``, closed when the block ends."""
    if kind == "raw":
        raw = RawSender(base_url)
        try:
            yield raw
        finally:
            raw.close()
        return
    shards = math.ceil((max_concurrency or MAX_CONNECTIONS) / POOL_CONNECTIONS)
    limits = httpx.Limits(
        max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS
    )
    # One TLS context for all the shards: httpx builds one per client (the CA bundle loaded
    # each time, ~20-40 ms of CPU), and 64 of them held the caller's event loop for 1-2.5 s,
    # so loads started side by side (bench.tracing_overhead) sent their first seconds of
    # arrivals in one burst.
    tls = httpx.create_ssl_context()
    async with contextlib.AsyncExitStack() as pools:
        clients = [
            await pools.enter_async_context(
                httpx.AsyncClient(base_url=base_url, limits=limits, timeout=300, verify=tls)
            )
            for _ in range(shards)
        ]
        yield HttpxSender(clients)


class HttpxSender:
    """Request ``i`` goes through pool ``i mod len(clients)``."""

    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        self.clients = clients

    async def send(self, i: int, path: str, body: dict[str, Any], res: Result) -> None:
        clock = EventClock(res)
        client = self.clients[i % len(self.clients)]
        try:
            async with client.stream("POST", path, json=body) as resp:
                res.status = resp.status_code
                if resp.status_code != 200:
                    res.error = (await resp.aread()).decode(errors="replace")[:200]
                    return
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and clock.data(line[6:]):
                        break
        except httpx.HTTPError as exc:
            res.error = type(exc).__name__
        finally:
            clock.done()


class RawSender:
    """HTTP/1.1 keep-alive connections, reused most-recent first; chunked SSE parsed here.

    A connection idle for ``IDLE_S`` is dropped before the server's keep-alive timeout
    (uvicorn: 5 s) closes it under us; one that was closed anyway, before a byte of the
    answer came back, is replaced and the request sent again (it never reached the app).
    """

    IDLE_S = 4.0

    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle.clear()

    def _reusable(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        now = time.monotonic()
        while self.idle:
            reader, writer, since = self.idle.pop()
            if now - since < self.IDLE_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    async def send(self, i: int, path: str, body: dict[str, Any], res: Result) -> None:
        clock = EventClock(res)
        payload = json.dumps(body).encode()
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        conn = self._reusable()
        try:
            for fresh in (conn is None, True):
                if fresh:
                    conn = await asyncio.open_connection(self.host, self.port)
                assert conn is not None
                reader, writer = conn
                writer.write(request)
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    break
                except (ConnectionError, asyncio.IncompleteReadError):
                    writer.close()
                    if fresh:
                        raise
            if await self._read(head, reader, res, clock):
                self.idle.append((reader, writer, time.monotonic()))
            else:
                writer.close()
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            res.error = type(exc).__name__
            if conn is not None:
                conn[1].close()
        finally:
            clock.done()

    async def _read(
        self, head: bytes, reader: asyncio.StreamReader, res: Result, clock: EventClock
    ) -> bool:
        """Read the rest of a response; True when the connection can serve another."""
        lines = head.decode("latin-1").split("\r\n")
        res.status = int(lines[0].split(" ", 2)[1])
        headers = dict(
            (k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in lines[1:] if h)
        )
        keep = headers.get("connection", "").lower() != "close"
        if res.status != 200 or headers.get("transfer-encoding", "").lower() != "chunked":
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            res.error = body.decode(errors="replace")[:200]
            return keep
        buffer = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)  # the data and its CRLF
            if size == 0:
                return keep
            buffer += chunk[:-2]
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    clock.data(event[6:].decode())
