"""Stopping background tasks for sure.

A plain ``task.cancel(); await task`` can hang forever: on Python 3.11 a cancellation that
lands inside ``asyncio.wait_for`` (nats-py's request and fetch use it) can surface as
``TimeoutError``, and a loop that retries on timeouts then swallows the cancellation and
runs on. :func:`cancel_and_wait` cancels again until the tasks are gone, and gives up
loudly after ``timeout_s`` instead of hanging a shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

RECANCEL_EVERY_S = 0.2


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[object]], *, timeout_s: float = 5.0, what: str = "tasks"
) -> None:
    """Cancel ``tasks`` and wait for them to end; re-cancel any that swallow it.

    Exceptions the tasks end with are dropped (the caller is stopping them). Tasks still
    running after ``timeout_s`` are logged and left behind rather than blocking the caller.
    """
    every = list(tasks)
    pending = {t for t in every if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            names = sorted(t.get_name() for t in pending)
            log.warning("%d %s did not stop within %.1fs: %s", len(pending), what, timeout_s, names)
            return
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_EVERY_S, left))
    for task in every:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" noise


def watch(task: asyncio.Task[None], on_failure: Callable[[str], None]) -> asyncio.Task[None]:
    """Report ``task``, a loop its service depends on, if it ends by raising: the traceback
    is logged and ``on_failure`` gets a line naming it. Unwatched, such a loop died without
    a word and the service stayed up, broken (a worker that fetched and generated but sent
    no chunk), until it was stopped, when :func:`cancel_and_wait` dropped the exception."""

    def ended(t: asyncio.Task[None]) -> None:
        if t.cancelled() or t.exception() is None:
            return
        exc = t.exception()
        log.error("task %s died", t.get_name(), exc_info=exc)
        on_failure(f"task {t.get_name()} died: {exc!r}")

    task.add_done_callback(ended)
    return task
