"""``/livez``: proof that a service's event loop still runs.

A worker's and the scheduler's ``/metrics`` are served from prometheus_client's own thread,
so they answer while the event loop that does the service's work is wedged (a blocking
call, a busy callback): a liveness probe on ``/metrics`` stays green and the pod is never
restarted, and the worker's engine watchdog, which runs on that loop, is stopped with it.
:class:`LoopBeat` is a task on the loop that notes the time every ``interval_s``;
``/livez`` (on the same port as ``/metrics``) answers 503 once the last note is older than
``stale_s``. Before the loop's first beat (a model still loading) it answers 200: the
startup probe judges that phase.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

LIVE_PATH = "/livez"
BEAT_INTERVAL_S = 1.0
# A loop that did not run for this long is wedged: nothing the services do on their loop
# takes seconds (their slow work runs in threads), and a probe's own period adds to it.
STALE_S = 30.0


class LoopBeat:
    """Notes, from the event loop, that it runs; read from any thread."""

    def __init__(
        self,
        interval_s: float = BEAT_INTERVAL_S,
        stale_s: float = STALE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < interval_s < stale_s:
            raise ValueError("LoopBeat: need 0 < interval_s < stale_s")
        self.interval_s = interval_s
        self.stale_s = stale_s
        self._clock = clock
        self._last: float | None = None  # a float store: atomic to a reader thread

    async def run(self) -> None:
        """Beat until cancelled."""
        while True:
            self._last = self._clock()
            await asyncio.sleep(self.interval_s)

    def problem(self) -> str | None:
        """Why the loop reads as dead; None while it beats (or has not begun to)."""
        last = self._last
        if last is None:
            return None
        silent = self._clock() - last
        if silent < self.stale_s:
            return None
        return f"event loop has not run for {silent:.1f} s (limit {self.stale_s:.0f} s)"


def with_liveness(app: Any, beat: LoopBeat | None) -> Any:
    """``app`` (a WSGI app) with ``/livez`` answered from ``beat`` (always 200 without one)."""

    def serve(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != LIVE_PATH:
            return app(environ, start_response)
        problem = beat.problem() if beat is not None else None
        status = "200 OK" if problem is None else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{problem or 'ok'}\n".encode()]

    return serve
