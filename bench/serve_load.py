"""What ``bench/serve.py`` sends, and when: workloads, arrivals, and the runs that pace them.

Prompts are random token ids (exact input lengths); outputs run to ``max_tokens``
(``ignore_eos``). Each completion is streamed and timed by a client of
:mod:`bench.serve_http`. Two baselines send the same requests at the same times:
NATS-natively with :class:`QosClient` (the message plane without HTTP), and into a
zero-cost sim engine in this process through the worker's own engine bridge (neither
HTTP nor NATS).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from bench.serve_http import Result, open_sender, token_events
from common.client import QosClient
from common.config import NatsConfig
from common.errors import QosError
from common.protocol import RequestParams


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    output_len: int


# --- workload -----------------------------------------------------------------------------


def make_workload(n: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[Req]:
    """Random token-id prompts (ids 4..249: inside any real vocabulary and ByteTokenizer's)."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))

    prompts = [[rng.randrange(4, 250) for _ in range(length(input_len))] for _ in range(n)]
    return [Req(prompt, length(output_len)) for prompt in prompts]


# --- runners ------------------------------------------------------------------------------


async def paced(
    offsets: list[float],
    one: Callable[[int, float], Coroutine[Any, Any, None]],
    results: list[Result] | None = None,
) -> float:
    """Start ``one(i, start)`` at ``start + offsets[i]``; wait for all; the run's duration.
    Each result keeps its offset as ``scheduled``: its ``start`` past that is the load
    generator's lag (a loop behind, a concurrency cap), which its latency does not show."""
    for res, at in zip(results or (), offsets, strict=results is not None):
        res.scheduled = at
    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    for i, at in enumerate(offsets):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, start)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - start


async def run_load(
    base_url: str,
    path: str,
    model: str,
    work: list[Req],
    offsets: list[float],
    max_concurrency: int | None,
    client: str = "httpx",
) -> tuple[list[Result], float]:
    """Send ``work`` to the gateway at ``offsets``; the results and the run's duration."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [Result() for _ in work]
    async with open_sender(client, base_url, max_concurrency) as sender:

        async def one(i: int, start: float) -> None:
            body = {
                "model": model,
                "prompt": work[i].prompt,
                "max_tokens": work[i].output_len,
                "temperature": 0,
                "ignore_eos": True,  # every request produces its whole output
                "stream": True,
                "stream_options": {"include_usage": True},
                **token_events(model),
            }
            async with gate or contextlib.nullcontext():
                results[i].start = time.perf_counter() - start
                await sender.send(i, path, body, results[i])

        duration = await paced(offsets, one, results)
    return results, duration


async def run_nats(
    nats: NatsConfig, group: str, work: list[Req], offsets: list[float]
) -> tuple[list[Result], float]:
    """The same requests NATS-natively (:class:`QosClient`): the message plane, no HTTP."""
    results = [Result() for _ in work]
    async with await QosClient.connect(nats, "bench-serve") as client:

        async def one(i: int, start: float) -> None:
            res, req = results[i], work[i]
            params = RequestParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            res.start, last = t0 - start, t0
            try:
                async for chunk in client.generate(
                    group=group, prompt_token_ids=req.prompt, params=params, timeout_s=60
                ):
                    now = time.perf_counter()
                    if chunk.token_ids:
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                    res.output_tokens += len(chunk.token_ids)
                res.ok, res.status = True, 200
            except QosError as exc:
                res.status, res.error = exc.http_status, exc.code
            res.e2e = time.perf_counter() - t0

        duration = await paced(offsets, one, results)
    return results, duration


async def run_in_process(
    work: list[Req], offsets: list[float], max_batch: int, tokenizer: Any | None = None
) -> tuple[list[Result], float]:
    """The same requests into a zero-cost sim engine through the worker's engine bridge,
    detokenizing with ``tokenizer`` as the stack's sim workers do (else the detokenizer's
    CPU was charged to the message plane)."""
    from workers.bridge import AddRequest, BridgeEvent, EngineBridge, RequestFailed
    from workers.engine.sampling_params import SamplingParams
    from workers.sim import SimCost, SimEngine

    loop = asyncio.get_running_loop()
    results = [Result() for _ in work]
    t0s = [0.0] * len(work)
    finished = [loop.create_future() for _ in work]

    def on_events(events: list[BridgeEvent]) -> None:
        now = time.perf_counter()
        for event in events:
            i = int(event.request_id)
            res = results[i]
            if isinstance(event, RequestFailed):  # failed, as the other two runs count it
                res.e2e, res.ok = now - t0s[i], False
                res.status, res.error = event.error.http_status, event.error.code
                finished[i].set_result(None)
                continue
            if event.token_ids and res.ttft is None:
                res.ttft = now - t0s[i]
            res.output_tokens += len(event.token_ids)
            if event.finished:
                res.e2e = now - t0s[i]
                res.ok = event.finish_reason not in ("abort", "error")
                res.status = 200 if res.ok else 503
                res.error = "" if res.ok else f"finish_reason {event.finish_reason}"
                finished[i].set_result(None)

    engine = SimEngine(
        max_batch_size=max_batch, max_seq_len=4096, cost=SimCost(0.0, 0.0, 0.0),
        tokenizer=tokenizer,
    )  # fmt: skip
    bridge = EngineBridge(engine, on_events, loop, name="bench-inproc")
    bridge.start()

    async def one(i: int, start: float) -> None:
        t0s[i] = time.perf_counter()
        results[i].start = t0s[i] - start
        params = SamplingParams(max_tokens=work[i].output_len, temperature=0.0, ignore_eos=True)
        bridge.add(AddRequest(str(i), params, prompt_token_ids=work[i].prompt))
        await finished[i]

    duration = await paced(offsets, one, results)
    await bridge.stop()
    return results, duration
