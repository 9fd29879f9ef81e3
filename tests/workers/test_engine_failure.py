"""A replica whose engine hangs hands its requests to another replica and exits 1, instead
of holding them (in_progress keeps JetStream from redelivering) until their deadlines."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from common.client import QosClient
from common.lifecycle import run_until_signalled
from common.protocol import RequestParams
from tests.workers.conftest import FAST, expected_tokens
from workers.sim import SimEngine


class HangingEngine(SimEngine):
    """Its first step with work blocks until released: a hung device."""

    def __init__(self) -> None:
        super().__init__(max_batch_size=4, max_seq_len=256, cost=FAST)
        self.release = threading.Event()
        self.hung = threading.Event()

    def step(self):  # type: ignore[no-untyped-def]
        if self.has_unfinished():
            self.hung.set()
            self.release.wait(30)
        return super().step()


async def test_a_hung_engine_hands_its_requests_to_another_replica_and_exits_1(
    start_worker: Any, client: QosClient
) -> None:
    engine = HangingEngine()
    hung = await start_worker(engine=engine, worker_id="hung", engine_stuck_s=0.5)
    running = asyncio.create_task(hung.run())  # what run_until_signalled awaits
    params = RequestParams(max_tokens=3, seed=1)
    answer = asyncio.create_task(
        client.collect(group="short", prompt_token_ids=[1, 2], params=params, timeout_s=20)
    )
    try:
        await asyncio.to_thread(engine.hung.wait, 5)
        assert engine.hung.is_set()
        await start_worker(worker_id="healthy")
        ids, _, final = await asyncio.wait_for(answer, 15)
        assert ids == expected_tokens(2, 3, seed=1), (ids, final)
        # Handed back, not held to its deadline (20 s: wait_for above would have failed).
        assert final.worker == "healthy" and final.attempt >= 2, final
        await asyncio.wait_for(running, 15)  # it stopped by itself
        assert hung.state == "stopped" and hung.exit_code == 1
    finally:
        engine.release.set()


async def test_run_until_signalled_returns_the_services_exit_code() -> None:
    class Failing:
        exit_code = 1

        def request_stop(self) -> None: ...

        async def start(self) -> None: ...

        async def run(self) -> None: ...

        async def stop(self) -> None: ...

    assert await run_until_signalled(Failing()) == 1


async def test_a_worker_whose_loop_dies_hands_its_requests_back_and_exits_1(
    start_worker: Any, client: QosClient
) -> None:
    """A loop the worker needs (pump, ticker, telemetry, intake) ending by an exception: it
    used to die without a word, the worker staying up, broken (no chunk out from a dead
    pump, until each request's deadline), and its stop dropped the exception."""
    engine = HangingEngine()  # holds the request, so the worker has one to hand back
    broken = await start_worker(engine=engine, worker_id="broken")
    running = asyncio.create_task(broken.run())
    params = RequestParams(max_tokens=3, seed=2)
    answer = asyncio.create_task(
        client.collect(group="short", prompt_token_ids=[1, 2], params=params, timeout_s=20)
    )
    try:
        await asyncio.to_thread(engine.hung.wait, 5)
        assert engine.hung.is_set()  # it holds the request: the hand-back is what is tested

        def bug() -> None:
            raise RuntimeError("a bug in the telemetry loop")

        broken._lapse_unrenewed_cap = bug  # its next tick raises
        await asyncio.wait_for(running, 10)  # it stopped by itself
        assert broken.state == "stopped" and broken.exit_code == 1
        await start_worker(worker_id="healthy")
        ids, _, final = await asyncio.wait_for(answer, 15)
        assert ids == expected_tokens(2, 3, seed=2) and final.worker == "healthy", final
    finally:
        engine.release.set()


async def test_an_engine_that_hangs_while_the_worker_drains_hands_back_at_once(
    start_worker: Any, client: QosClient
) -> None:
    """A stop (SIGTERM) already draining when the engine hung kept waiting out its whole
    grace (30 s) for requests that could no longer finish, in_progress holding them."""
    engine = HangingEngine()
    hung = await start_worker(engine=engine, worker_id="hung", engine_stuck_s=0.5, grace_s=30)
    params = RequestParams(max_tokens=3, seed=3)
    answer = asyncio.create_task(
        client.collect(group="short", prompt_token_ids=[1, 2], params=params, timeout_s=25)
    )
    try:
        await asyncio.to_thread(engine.hung.wait, 5)
        assert engine.hung.is_set()
        stopping = asyncio.create_task(hung.stop())  # draining, with 30 s of grace
        await start_worker(worker_id="healthy")
        ids, _, final = await asyncio.wait_for(answer, 10)
        assert ids == expected_tokens(2, 3, seed=3) and final.worker == "healthy", final
        await asyncio.wait_for(stopping, 10)
        assert hung.exit_code == 1
    finally:
        engine.release.set()


class BrokenDeviceEngine(SimEngine):
    """Every step raises at once once ``broken`` is set: a sticky device error."""

    def __init__(self) -> None:
        super().__init__(max_batch_size=1, max_seq_len=256, cost=FAST)
        self.broken = False

    def step(self):  # type: ignore[no-untyped-def]
        if self.broken and self.has_unfinished():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()


async def test_an_engine_whose_every_step_fails_stops_taking_work_and_exits_1(
    start_worker: Any, client: QosClient
) -> None:
    """Each failed step answered its requests with a 500 and freed their slots for more: a
    broken device turned the replica into a black hole for its group's traffic, its thread
    alive and its steps quick, so no watchdog fired."""
    engine = BrokenDeviceEngine()
    broken = await start_worker(engine=engine, worker_id="broken")
    running = asyncio.create_task(broken.run())
    engine.broken = True
    params = RequestParams(max_tokens=3, seed=4)
    answers = [
        asyncio.create_task(
            client.collect(group="short", prompt_token_ids=[1, i], params=params, timeout_s=20)
        )
        for i in range(2, 6)
    ]
    await asyncio.wait_for(running, 10)  # it stopped by itself, after a few failed steps
    assert broken.state == "stopped" and broken.exit_code == 1
    await start_worker(worker_id="healthy")
    done = await asyncio.gather(*answers)
    # Every one served by another replica: those of the failed steps retried, the rest
    # handed back.
    assert all(final.worker == "healthy" for _, _, final in done), done


async def test_a_request_the_engine_fails_on_ends_alone_with_a_500(
    start_worker: Any, client: QosClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settling one request's token raised out of the engine's step (a tokenizer's decode,
    the grammar library): the bridge failed every running request with a 500. Now that
    request ends alone, after the tokens it had, and its neighbour answers in full."""
    from common.errors import InternalError
    from common.models import demo_model_path
    from workers.engine import LLMEngine
    from workers.engine import engine as engine_module
    from workers.engine.args import EngineArgs

    settle = engine_module.settle_token
    victim: list[str] = []

    def fails_once(req: Any, *args: Any, **kwargs: Any) -> Any:
        if req.num_output_tokens == 3 and not victim:
            victim.append(req.request_id)
            raise RuntimeError("decode failed")
        return settle(req, *args, **kwargs)

    monkeypatch.setattr(engine_module, "settle_token", fails_once)
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu", max_batch_size=4))
    await start_worker(engine=engine)
    params = RequestParams(max_tokens=8, ignore_eos=True, temperature=0.0)

    async def one(prompt: list[int]) -> tuple[list[int], BaseException | None]:
        got: list[int] = []
        try:
            async for chunk in client.generate(
                group="short", prompt_token_ids=prompt, params=params
            ):
                got += chunk.token_ids
        except Exception as exc:
            return got, exc
        return got, None

    results = await asyncio.gather(one([10, 11, 12]), one([20, 21, 22, 23]))
    failed = [(got, exc) for got, exc in results if exc is not None]
    served = [got for got, exc in results if exc is None]
    assert len(failed) == 1 and len(served) == 1 and len(served[0]) == 8
    got, exc = failed[0]
    assert isinstance(exc, InternalError) and "engine failed on this request" in exc.message
    assert len(got) == 2  # the tokens before the one that failed went out
