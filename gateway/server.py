"""uvicorn's server, told when a shutdown begins: streams still open near the end of the
graceful period end with an error the client can act on, not a cut connection.

On SIGTERM uvicorn stops accepting, waits ``timeout_graceful_shutdown`` for open requests,
then cancels them: a streaming client saw its body end mid-chunk (no error event, no
``[DONE]``), a waiting one a plain-text 500. Here the gateway ends every stream still open
:data:`CUT_MARGIN_S` before that deadline with a 503 ``service_unavailable`` (``Retry-After:
1``): an error event then ``[DONE]`` mid-stream, the JSON error otherwise; the requests are
aborted on the workers as for any stream the gateway ends itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from common.config import Config
from common.errors import ServiceUnavailableError
from gateway.http_protocol import bounded_head_protocol
from gateway.streams import Dispatcher

log = logging.getLogger(__name__)

CUT_MARGIN_S = 1.0  # for the error to be written and the handlers to finish


def uvicorn_config(app: Any, config: Config, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for the gateway: requests' heads bounded in size and time
    (:mod:`gateway.http_protocol`), open connections capped (uvicorn answers 503 past
    ``gateway.max_connections``), our logging, the graceful period of ``shutdown_grace_s``."""
    gateway = config.gateway
    # The gateway app's own metrics count what the protocol refuses before the app runs.
    state = getattr(getattr(app, "state", None), "gateway", None)
    metrics = getattr(state, "metrics", None)
    on_refused = None if metrics is None else functools.partial(metrics.finished, "-")
    settings: dict[str, Any] = {
        "host": gateway.host,
        "port": gateway.port,
        "loop": "uvloop",
        "http": bounded_head_protocol(
            gateway.max_header_bytes, gateway.header_timeout_s, on_refused
        ),
        "limit_concurrency": gateway.max_connections,
        "log_level": config.log.level,
        "log_config": None,  # our handlers (common.logging), not uvicorn's
        "access_log": False,  # ours (gateway.observe) has the group and request id
        "timeout_graceful_shutdown": max(1, round(gateway.shutdown_grace_s)),
    }
    return uvicorn.Config(app, **(settings | overrides))


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` that ends the dispatcher's streams before its graceful timeout."""

    def __init__(self, config: uvicorn.Config, dispatcher: DispatcherRef) -> None:
        super().__init__(config)
        self._dispatcher = dispatcher
        self._cut: asyncio.Task[None] | None = None
        self.exit_code = 0
        dispatcher.on_broken = self._broken

    def _broken(self, what: str) -> None:
        """A loop the gateway needs died: stop (gracefully) and exit 1. Alive but broken,
        it answered 503 to every health check for good: Kubernetes' TCP liveness probe and
        docker's restart policy both saw a live process."""
        log.error("%s: stopping the gateway (exit 1) to be restarted", what)
        self.exit_code = 1
        if not self.should_exit:
            self.begin_shutdown()
            self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's signal handler: in the main thread, between the loop's callbacks.
        if not self.should_exit:
            self.begin_shutdown()
        super().handle_exit(sig, frame)

    def begin_shutdown(self) -> None:
        """Plan the end of the streams still open (the server stops on ``should_exit``)."""
        if self._dispatcher.loop is not None:
            self._dispatcher.loop.call_soon_threadsafe(self._start_cut)

    def _start_cut(self) -> None:
        self._cut = asyncio.get_running_loop().create_task(self._cut_streams(), name="cut")

    async def _cut_streams(self) -> None:
        grace = self.config.timeout_graceful_shutdown or 0
        await asyncio.sleep(max(0.0, grace - CUT_MARGIN_S))
        dispatcher = self._dispatcher.dispatcher
        if dispatcher is not None and dispatcher.open_streams:
            log.warning("shutting down: ending %d open streams", dispatcher.open_streams)
            dispatcher.fail_all(
                ServiceUnavailableError("the gateway is shutting down", retry_after_s=1)
            )


class DispatcherRef:
    """Where the app's lifespan puts its dispatcher and loop once connected."""

    dispatcher: Dispatcher | None = None
    loop: asyncio.AbstractEventLoop | None = None
    on_broken: Callable[[str], None] | None = None  # the server's: a needed loop died
