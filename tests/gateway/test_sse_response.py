"""SseResponse notices a client hanging up, whatever the server's receive() says first."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.streams import SseResponse


async def test_a_late_body_message_does_not_stop_the_disconnect_watch() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    release = asyncio.Event()
    sent: list[dict[str, Any]] = []
    hung_up: list[bool] = []
    closed: list[bool] = []

    async def events() -> Any:
        yield b"data: 1\n\n"
        await release.wait()  # the generator waits for tokens; the client leaves meanwhile
        yield b"data: 2\n\n"

    async def receive() -> dict[str, Any]:
        return await messages.get()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    def on_disconnect() -> None:
        hung_up.append(True)
        release.set()

    response = SseResponse(
        events(),
        headers={},
        on_disconnect=on_disconnect,
        on_close=lambda status: closed.append(True),
    )
    serving = asyncio.ensure_future(response({"type": "http"}, receive, send))
    await messages.put({"type": "http.request", "body": b"", "more_body": False})
    await asyncio.sleep(0.01)
    assert not hung_up
    await messages.put({"type": "http.disconnect"})
    await asyncio.wait_for(serving, 2)
    assert hung_up == [True] and closed == [True]
    assert [m["type"] for m in sent][:2] == ["http.response.start", "http.response.body"]


async def test_a_client_that_reads_nothing_is_cut_off_long_before_its_deadline() -> None:
    """Its deadline is its own to choose (up to a day): a client that kept the connection
    open and stopped reading held an admission slot until then. A send() that waits
    write_stall_s now ends the response."""
    sent: list[dict[str, Any]] = []
    closed: list[int] = []
    forever = asyncio.Event()

    async def events() -> Any:
        for i in range(100):
            yield f"data: {i}\n\n".encode()

    async def receive() -> dict[str, Any]:
        await forever.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if len(sent) >= 3:
            await forever.wait()  # the socket is full: the client reads nothing
        sent.append(message)

    response = SseResponse(
        events(), headers={}, on_disconnect=lambda: None, on_close=closed.append,
        deadline=None, write_stall_s=0.2,
    )  # fmt: skip
    await asyncio.wait_for(response({"type": "http"}, receive, send), 2)
    assert closed == [504] and len(sent) == 3


async def test_a_slow_reader_still_gets_what_came_before_the_deadline() -> None:
    """The deadline check ran before the deliveries already in: a client reading slower
    than its worker produced lost the end of an answer finished in time, to a 504."""
    import time
    import types

    from gateway.generate import Generator
    from tests.gateway.test_streams import _chunk, _stream

    stream = _stream()
    stream.feed(_chunk(0, "ab"))
    stream.feed(_chunk(2, "c", finish_reason="stop"))
    flight = types.SimpleNamespace(
        deadline=time.monotonic() - 1.0, stream=stream, first_token_at=1.0, completion_tokens=0,
        worker_usage=None, finish_reason=None, disconnect_check_at=0.0, scores_only=False,
    )  # fmt: skip
    first = await Generator._next(None, flight, None)  # type: ignore[arg-type]
    last = await Generator._next(None, flight, None)  # type: ignore[arg-type]
    assert (first.text, last.text, last.finish_reason) == ("ab", "c", "stop")
