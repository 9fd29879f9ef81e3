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
