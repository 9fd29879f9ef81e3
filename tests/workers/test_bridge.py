"""EngineBridge: the engine on its own thread, commands in, deltas out, no busy spin."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.tokenizer import ByteTokenizer
from workers.bridge import (
    MAX_FAILED_STEPS,
    AddRequest,
    BridgeEvent,
    EngineBridge,
    RequestFailed,
)
from workers.engine.outputs import RequestDelta
from workers.engine.sampling_params import SamplingParams
from workers.sim import SimCost, SimEngine


def started(engine: SimEngine) -> tuple[EngineBridge, asyncio.Queue[BridgeEvent]]:
    """A started bridge over ``engine`` and the queue its events arrive on."""
    inbox: asyncio.Queue[BridgeEvent] = asyncio.Queue()

    def deliver(events: list[BridgeEvent]) -> None:
        for event in events:
            inbox.put_nowait(event)

    bridge = EngineBridge(engine, deliver, asyncio.get_running_loop())
    bridge.start()
    return bridge, inbox


async def run_to_end(
    bridge: EngineBridge, inbox: asyncio.Queue[BridgeEvent], rid: str
) -> list[int]:
    ids: list[int] = []
    while True:
        event = await asyncio.wait_for(inbox.get(), 5)
        assert isinstance(event, RequestDelta) and event.request_id == rid
        ids += event.token_ids
        if event.finished:
            return ids


async def test_a_resumed_text_prompt_continues_from_prompt_plus_the_delivered_tokens() -> None:
    engine = SimEngine(cost=SimCost(0, 0, 0), tokenizer=ByteTokenizer())
    bridge, inbox = started(engine)
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=4)
    bridge.add(AddRequest("full", params, prompt="résumé"))
    full = await run_to_end(bridge, inbox, "full")
    rest = SamplingParams(max_tokens=6, ignore_eos=True, seed=4)
    bridge.add(AddRequest("again", rest, prompt="résumé", resume_token_ids=tuple(full[:4])))
    assert await run_to_end(bridge, inbox, "again") == full[4:]
    await bridge.stop()


async def test_rejections_come_back_as_request_failed_and_an_idle_thread_sleeps() -> None:
    engine = SimEngine(cost=SimCost(0, 0, 0), max_seq_len=16)
    bridge, inbox = started(engine)
    bridge.add(AddRequest("long", SamplingParams(), prompt_token_ids=[1] * 16))
    failed = await asyncio.wait_for(inbox.get(), 5)
    assert isinstance(failed, RequestFailed) and failed.error.code == "context_length_exceeded"
    looks = 0
    real_has_unfinished = engine.has_unfinished

    def counted() -> bool:
        nonlocal looks
        looks += 1
        return real_has_unfinished()

    engine.has_unfinished = counted  # type: ignore[method-assign]
    await asyncio.sleep(0.5)
    assert looks <= 1  # waiting on the queue, not polling the engine
    assert bridge.set_batch_cap(100) == 16 and await bridge.call(lambda e: e.max_batch_size) == 16
    await bridge.stop()
    assert not bridge.alive


async def test_steps_the_loop_has_not_taken_yet_arrive_together_in_order() -> None:
    calls: list[list[BridgeEvent]] = []
    engine = SimEngine(cost=SimCost(0.002, 0, 0))
    bridge = EngineBridge(engine, calls.append, asyncio.get_running_loop())
    bridge.start()
    params = SamplingParams(max_tokens=20, ignore_eos=True, seed=1)
    bridge.add(AddRequest("busy", params, prompt_token_ids=[1, 2, 3]))
    # The loop is busy elsewhere (it does not yield) while the engine runs all 20 steps.
    deadline = time.monotonic() + 5
    while engine.has_unfinished() or not engine.num_steps:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)  # the last step's output is handed over
    await asyncio.sleep(0.05)
    # One wake-up of the loop for everything produced meanwhile, not one per step.
    assert len(calls) == 1
    deltas = [e for e in calls[0] if isinstance(e, RequestDelta)]
    assert [d.num_output_tokens for d in deltas] == list(range(1, 21))
    assert deltas[-1].finished
    await bridge.stop()


async def test_an_engine_failure_reaches_the_client_without_its_exception_text() -> None:
    """A failed add or step fails its requests with the exception's type only: its text
    (device names, memory figures, file paths) stays in the worker's log."""
    engine = SimEngine(cost=SimCost(0, 0, 0))
    secret = "CUDA out of memory on /srv/models/secret-model (GPU 0: 79.2 GiB)"

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(secret)

    engine.add_request = broken  # type: ignore[method-assign]
    bridge, inbox = started(engine)
    bridge.add(AddRequest("a", SamplingParams(max_tokens=4), prompt_token_ids=[1, 2, 3]))
    failed = await asyncio.wait_for(inbox.get(), 5)
    assert isinstance(failed, RequestFailed) and failed.error.http_status == 500
    assert "RuntimeError" in failed.error.message and "secret" not in failed.error.message
    await bridge.stop()


async def test_a_failed_step_fails_its_requests_without_the_exception_text() -> None:
    engine = SimEngine(cost=SimCost(0, 0, 0))
    step = engine.step

    def broken() -> list[RequestDelta]:
        step()  # scheduled, then the device fails
        raise RuntimeError("illegal memory access in /opt/triton/cache/kernel.py")

    engine.step = broken  # type: ignore[method-assign]
    bridge, inbox = started(engine)
    bridge.add(AddRequest("a", SamplingParams(max_tokens=4), prompt_token_ids=[1, 2, 3]))
    failed = await asyncio.wait_for(inbox.get(), 5)
    assert isinstance(failed, RequestFailed) and failed.request_id == "a"
    assert "RuntimeError" in failed.error.message and "/opt" not in failed.error.message
    await bridge.stop()


async def test_a_step_failing_after_a_request_finished_does_not_fail_that_request() -> None:
    """The step read back a request's last token (it finished, the engine let it go),
    then failed: the bridge failed it as lost, a completed answer ending in a 500, while
    the engine reported its finish on the next step."""
    from workers.engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=32))
    real_run = engine._run_step
    failed_once: list[bool] = []

    def run_then_fail(deltas: list[RequestDelta]) -> None:
        real_run(deltas)
        if any(d.finished for d in deltas) and not failed_once:
            failed_once.append(True)
            raise RuntimeError("write-through export failed")

    engine._run_step = run_then_fail  # type: ignore[method-assign]
    bridge, inbox = started(engine)
    bridge.add(
        AddRequest("r", SamplingParams(max_tokens=3, temperature=0), prompt_token_ids=[5, 6])
    )
    events = []
    while True:
        event = await asyncio.wait_for(inbox.get(), 10)
        events.append(event)
        if isinstance(event, RequestFailed) or (event.request_id == "r" and event.finished):
            break
    await bridge.stop()
    assert failed_once
    assert not any(isinstance(e, RequestFailed) for e in events), events
    assert events[-1].finish_reason == "length"


async def test_a_stop_hands_the_engines_pending_kv_copies_over_before_the_tier_closes() -> None:
    """Blocks copied off the device for the KV tiers are handed over at a later step; a
    stop takes no further step, and they were lost (neither stored nor counted)."""

    class Flushing(SimEngine):
        flushed = 0

        def flush_exports(self) -> None:
            self.flushed += 1

    engine = Flushing(cost=SimCost(0, 0, 0))
    bridge, _ = started(engine)
    await bridge.stop()
    assert engine.flushed == 1


async def test_a_call_after_the_engine_thread_ended_raises_instead_of_waiting_for_good() -> None:
    """Nothing reads the command queue once the thread has ended (stopped, or its engine
    broke after MAX_FAILED_STEPS): a call queued then, or behind the stop, never resolved."""
    engine = SimEngine(cost=SimCost(0, 0, 0))

    def broken() -> list[RequestDelta]:
        raise RuntimeError("the device is gone")

    engine.step = broken  # type: ignore[method-assign]
    bridge, _inbox = started(engine)
    for i in range(MAX_FAILED_STEPS):  # each failed step fails its request: add another
        bridge.add(AddRequest(f"r{i}", SamplingParams(max_tokens=4), prompt_token_ids=[1, 2]))
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 5
    while bridge.alive and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not bridge.alive
    with pytest.raises(RuntimeError, match="engine thread has ended"):
        await asyncio.wait_for(bridge.call(lambda e: 1), 2)

    stopping, _ = started(SimEngine(cost=SimCost(0, 0, 0)))
    assert await asyncio.wait_for(stopping.call(lambda e: 2), 2) == 2
    stopping._queue.put(("stop", None))  # a stop, then a call behind it, before the thread runs
    behind = asyncio.ensure_future(stopping.call(lambda e: 3))
    await stopping.stop()
    with pytest.raises(RuntimeError, match="engine thread has ended"):
        await asyncio.wait_for(behind, 2)
