"""A TCP forwarder a test can cut: one service's link to a server fails, the others' do not.

``cut()`` drops every forwarded connection and turns new ones away until ``restore()``;
the server itself stays up, so only what connects through the proxy notices. ``stall()``
keeps the connections open but forwards nothing (a node gone dark, no close), until
``restore()``. ``throttle(bytes_per_s)`` forwards server-to-client bytes in small pieces at
that rate (a congested or throttled link: slow, yet never silent long enough to time out).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from common.services import free_port


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._open = True
        self._stalled = False
        self._rate = 0.0  # server-to-client bytes/s; 0 = unthrottled
        self._piece = 1024  # bytes sent at a time under a throttle
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tcp-proxy", daemon=True
        )

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def cut(self) -> None:
        """Drop every forwarded connection now and refuse new ones."""
        self._call(self._cut())

    def stall(self) -> None:
        """Forward nothing more, in either direction, and close nothing."""
        self._stalled = True

    def throttle(self, bytes_per_s: float, piece: int = 1024) -> None:
        """Server-to-client bytes at ``bytes_per_s``, ``piece`` bytes at a time (small
        pieces trickle: every read gets something within any socket timeout)."""
        self._rate, self._piece = bytes_per_s, piece

    def restore(self) -> None:
        self._stalled = False
        self._rate = 0.0
        self._call(self._set_open(True))

    def close(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro) -> None:  # type: ignore[no-untyped-def]
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _set_open(self, value: bool) -> None:
        self._open = value

    async def _cut(self) -> None:
        self._open = False
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _close(self) -> None:
        await self._cut()
        if self._server is not None:
            self._server.close()
        # The connections' pipes end with their transports; wait for them, so the loop
        # stops with no task pending (asyncio warns of each one destroyed).
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._open:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer),
            self._pipe(up_reader, writer, downstream=True),
            return_exceptions=True,
        )
        self._writers -= {writer, up_writer}

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, downstream: bool = False
    ) -> None:
        try:
            while data := await reader.read(65536):
                if self._stalled:
                    continue  # lost on the way
                if downstream and self._rate:
                    piece = self._piece
                    for i in range(0, len(data), piece):
                        writer.write(data[i : i + piece])
                        await writer.drain()
                        await asyncio.sleep(piece / self._rate)
                    continue
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.transport.abort()
