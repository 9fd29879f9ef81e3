"""``/livez`` beside ``/metrics``: 503 once the service's event loop stops running."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from common.liveness import LoopBeat
from common.metrics import MetricsServer
from common.services import free_port
from scheduler.metrics import SchedulerMetrics


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_livez_fails_while_the_loop_is_blocked_and_recovers_after() -> None:
    """/metrics is served from a thread of its own, so it answered while the loop was
    wedged: a liveness probe on it never restarted such a pod."""
    beat = LoopBeat(interval_s=0.02, stale_s=0.3)
    server = MetricsServer(CollectorRegistry(), 0, host="127.0.0.1", beat=beat)
    task = asyncio.create_task(beat.run())
    try:
        await asyncio.sleep(0.05)
        assert await asyncio.to_thread(get, server.port, "/livez") == (200, "ok\n")
        seen: list[tuple[int, str]] = []

        def probe_later() -> None:
            time.sleep(0.5)
            seen.append(get(server.port, "/livez"))
            seen.append(get(server.port, "/metrics"))

        prober = threading.Thread(target=probe_later)
        prober.start()
        time.sleep(0.8)  # the loop blocked, as a wedged callback would
        prober.join()
        (status, body), (metrics_status, _) = seen
        assert status == 503 and "event loop has not run" in body
        assert metrics_status == 200  # what the probes used to read
        await asyncio.sleep(0.05)
        assert (await asyncio.to_thread(get, server.port, "/livez"))[0] == 200
    finally:
        task.cancel()
        server.close()


def test_livez_answers_200_before_the_first_beat_and_without_a_beat() -> None:
    """A worker loading its model has not started beating: the startup probe judges that."""
    server = MetricsServer(CollectorRegistry(), 0, host="127.0.0.1", beat=LoopBeat())
    bare = MetricsServer(CollectorRegistry(), 0, host="127.0.0.1")
    try:
        assert get(server.port, "/livez") == (200, "ok\n")
        assert get(bare.port, "/livez") == (200, "ok\n")
    finally:
        server.close()
        bare.close()


async def test_the_scheduler_serves_livez_from_its_beat() -> None:
    metrics, port = SchedulerMetrics(), free_port()
    beat = LoopBeat(interval_s=0.02, stale_s=1.0)
    metrics.serve(port, beat)
    task = asyncio.create_task(beat.run())
    try:
        await asyncio.sleep(0.05)
        assert (await asyncio.to_thread(get, port, "/livez"))[0] == 200
        task.cancel()
        await asyncio.sleep(1.5)  # no beat since: what a wedged loop looks like from outside
        assert (await asyncio.to_thread(get, port, "/livez"))[0] == 503
        assert (await asyncio.to_thread(get, port, "/metrics"))[0] == 200
    finally:
        task.cancel()
        metrics.close()


def test_a_beat_must_come_more_often_than_its_limit() -> None:
    with pytest.raises(ValueError):
        LoopBeat(interval_s=5, stale_s=5)
