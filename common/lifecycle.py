"""Running a service until SIGTERM/SIGINT: the one loop every qosserve process shares."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Protocol


class Service(Protocol):
    """What :func:`run_until_signalled` drives: the worker and scheduler services are one."""

    def request_stop(self) -> None: ...

    async def start(self) -> None: ...

    async def run(self) -> None: ...

    async def stop(self) -> None: ...


async def run_until_signalled(service: Service) -> int:
    """Start ``service``, run it until it returns (SIGTERM/SIGINT ask it to stop), stop it.
    Returns its ``exit_code`` (0 when it has none): a worker whose engine failed says 1."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.request_stop)
    try:
        await service.start()
        await service.run()
    finally:
        await service.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    return int(getattr(service, "exit_code", 0))
