"""A worker told to stop while it loads its model exits at once, holding nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest

import workers.__main__ as worker_main
from common.config import Config


async def test_sigterm_during_the_model_load_exits_with_128_plus_the_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loading, release = threading.Event(), threading.Event()
    exits: list[int] = []

    def slow_build(config: Config, args: Any) -> Any:
        loading.set()
        release.wait(10)
        raise RuntimeError("the load was not cut short")

    monkeypatch.setattr(worker_main, "build_engine", slow_build)
    monkeypatch.setattr(os, "_exit", exits.append)  # the real one would end pytest
    args = worker_main.build_parser().parse_args(["--group", "short", "--engine", "sim"])
    serving = asyncio.create_task(worker_main.serve(Config(), args))
    loop = asyncio.get_running_loop()
    try:
        await asyncio.to_thread(loading.wait, 5)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if exits:
                break
            await asyncio.sleep(0.02)
        assert exits == [128 + signal.SIGTERM]
    finally:
        release.set()
        with pytest.raises(RuntimeError):
            await serving
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
