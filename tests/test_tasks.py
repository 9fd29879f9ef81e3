"""``cancel_and_wait`` stops tasks that swallow a cancellation, and never hangs; ``watch``
reports a loop that dies."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from common.tasks import cancel_and_wait, watch


async def _swallows_once(log: list[str]) -> None:
    """Like a retry loop that took a cancellation inside ``wait_for`` for a timeout."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if swallowed:
                log.append("stopped")
                raise
            swallowed = True
            log.append("swallowed")


async def test_a_task_that_swallows_the_first_cancel_is_cancelled_again() -> None:
    log: list[str] = []
    task = asyncio.create_task(_swallows_once(log))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task]), 2)
    assert task.cancelled() and log == ["swallowed", "stopped"]


async def test_a_task_that_never_stops_is_left_behind_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn(), name="stubborn-loop")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="common.tasks"):
        await asyncio.wait_for(cancel_and_wait([task], timeout_s=0.3, what="loops"), 2)
    assert not task.done()
    assert "1 loops did not stop" in caplog.text and "stubborn-loop" in caplog.text
    release.set()
    task.cancel()  # the loop sees the flag and ends, so the test leaves nothing running
    await asyncio.wait_for(task, 2)


async def test_failed_and_finished_tasks_are_fine(caplog: pytest.LogCaptureFixture) -> None:
    async def boom() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(boom())
    done = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    gc.collect()  # an earlier test's unread task must not be collected into this log
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        await cancel_and_wait([failed, done])  # no raise
        del failed, done  # a task whose exception nobody read says so as it is collected
        gc.collect()
    assert "boom" not in caplog.text


async def test_a_watched_task_that_raises_is_logged_and_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reports: list[str] = []

    async def dies() -> None:
        await asyncio.sleep(0)
        raise ValueError("bug")

    async def returns() -> None:
        await asyncio.sleep(0)

    failing = watch(asyncio.create_task(dies(), name="loop-a"), reports.append)
    fine = watch(asyncio.create_task(returns(), name="loop-b"), reports.append)
    cancelled = watch(asyncio.create_task(asyncio.sleep(10), name="loop-c"), reports.append)
    cancelled.cancel()
    with caplog.at_level(logging.ERROR, logger="common.tasks"):
        await asyncio.wait([failing, fine, cancelled])
        await asyncio.sleep(0)  # done callbacks run on the next turn
    assert reports == ["task loop-a died: ValueError('bug')"]
    assert "task loop-a died" in caplog.text and "ValueError: bug" in caplog.text
