"""EngineBridge: the engine on its own thread, commands in, deltas out, no busy spin."""

from __future__ import annotations

import asyncio
import time

from common.tokenizer import ByteTokenizer
from workers.bridge import AddRequest, BridgeEvent, EngineBridge, RequestFailed
from workers.engine.outputs import RequestDelta
from workers.engine.sampling_params import SamplingParams
from workers.sim import SimCost, SimEngine


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
    inbox: asyncio.Queue[BridgeEvent] = asyncio.Queue()
    engine = SimEngine(cost=SimCost(0, 0, 0), tokenizer=ByteTokenizer())
    bridge = EngineBridge(
        engine, lambda evs: [inbox.put_nowait(e) for e in evs], asyncio.get_running_loop()
    )
    bridge.start()
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=4)
    bridge.add(AddRequest("full", params, prompt="résumé"))
    full = await run_to_end(bridge, inbox, "full")
    rest = SamplingParams(max_tokens=6, ignore_eos=True, seed=4)
    bridge.add(AddRequest("again", rest, prompt="résumé", resume_token_ids=tuple(full[:4])))
    assert await run_to_end(bridge, inbox, "again") == full[4:]
    await bridge.stop()


async def test_rejections_come_back_as_request_failed_and_an_idle_thread_sleeps() -> None:
    inbox: asyncio.Queue[BridgeEvent] = asyncio.Queue()
    engine = SimEngine(cost=SimCost(0, 0, 0), max_seq_len=16)
    bridge = EngineBridge(
        engine, lambda evs: [inbox.put_nowait(e) for e in evs], asyncio.get_running_loop()
    )
    bridge.start()
    bridge.add(AddRequest("long", SamplingParams(), prompt_token_ids=[1] * 16))
    failed = await asyncio.wait_for(inbox.get(), 5)
    assert isinstance(failed, RequestFailed) and failed.error.code == "context_length_exceeded"
    cpu = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - cpu < 0.1  # waiting on the queue, not polling
    assert bridge.set_batch_cap(100) == 16 and await bridge.call(lambda e: e.max_batch_size) == 16
    await bridge.stop()
    assert not bridge.alive
