"""The other side of the wire contract: a worker written with nats-py, for gateway tests.

It pulls ``GenerateRequest``s from the group's durable consumer, reports telemetry, and
answers each request through ``behaviour`` (default: :func:`echo_alphabet`). It is not a
mock of NATS: every message goes through a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg

import common.nats as qnats
from common.config import NatsConfig
from common.protocol import (
    Chunk,
    ErrorInfo,
    GenerateRequest,
    Telemetry,
    TopLogprobs,
    Usage,
)
from common.subjects import Subjects
from common.tasks import cancel_and_wait

ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
CACHED_TOKENS = 2


@dataclass
class Job:
    """One request as the worker received it, and a way to answer it."""

    request: GenerateRequest
    headers: dict[str, str]
    msg: Msg
    worker: FakeWorker

    async def send(self, seq: int, token_ids: list[int], **kwargs: object) -> None:
        chunk = Chunk(
            id=self.request.id,
            seq=seq,
            token_ids=token_ids,
            text=bytes(t for t in token_ids if t < 256).decode(),
            worker=self.worker.worker_id,
            **kwargs,  # type: ignore[arg-type]
        )
        await self.worker.nc.publish(self.request.reply, chunk.to_bytes())

    def usage(self, completion: int) -> Usage:
        return Usage(len(self.request.prompt_token_ids), completion, CACHED_TOKENS)


Behaviour = Callable[[Job], Awaitable[None]]


def alphabet_tokens(n: int) -> list[int]:
    """The deterministic reply: the alphabet (bytes = ByteTokenizer ids), cycling."""
    return [ALPHABET[i % len(ALPHABET)] for i in range(n)]


def expected_reply(max_tokens: int, length: int = len(ALPHABET)) -> tuple[str, str]:
    """(text, finish_reason) :func:`echo_alphabet` produces for ``max_tokens``."""
    n = min(max_tokens, length)
    return bytes(alphabet_tokens(n)).decode(), "length" if max_tokens <= length else "stop"


async def echo_alphabet(job: Job, *, chunk_size: int = 3, delay_s: float = 0.0) -> None:
    """Send up to 26 letters in chunks of ``chunk_size``; logprobs when asked."""
    max_tokens = job.request.params.max_tokens
    ids = alphabet_tokens(min(max_tokens, len(ALPHABET)))
    finish = "length" if max_tokens <= len(ALPHABET) else "stop"
    k = job.request.params.logprobs
    for start in range(0, len(ids), chunk_size):
        if delay_s:
            await asyncio.sleep(delay_s)
        part = ids[start : start + chunk_size]
        last = start + chunk_size >= len(ids)
        extra: dict[str, object] = {}
        if k is not None:
            extra["logprobs"] = [-0.5] * len(part)
            extra["top_logprobs"] = [
                TopLogprobs(
                    token_ids=[t, ord("?")][: max(k, 0)], logprobs=[-0.5, -1.5][: max(k, 0)]
                )
                for t in part
            ]
        if last:
            extra["finish_reason"] = finish
            extra["usage"] = job.usage(len(ids))
        asked = job.request.params.prompt_logprobs
        if start == 0 and asked is not None:  # prompt token j scores -j / 4
            prompt = job.request.prompt_token_ids
            extra["prompt_logprobs"] = [-j / 4 for j in range(1, len(prompt))]
            if asked:
                extra["prompt_top_logprobs"] = [
                    TopLogprobs([ord("?")], [-9.0]) for _ in range(1, len(prompt))
                ]
        await job.send(start, part, **extra)


def answers(text: str, cut: int = 2) -> Behaviour:
    """Send ``text`` (bytes = ByteTokenizer ids) in two chunks, the first 1/``cut`` of it;
    with logprobs when asked, token i scoring -i / 100 (its alternatives: itself)."""

    async def behaviour(job: Job) -> None:
        ids = list(text.encode())
        at = len(ids) // cut
        k = job.request.params.logprobs

        def scores(start: int, part: list[int]) -> dict[str, object]:
            if k is None:
                return {}
            values = [-(start + i) / 100 for i in range(len(part))]
            tops = [TopLogprobs([t][:k], [v][:k]) for t, v in zip(part, values, strict=True)]
            return {"logprobs": values, "top_logprobs": tops}

        await job.send(0, ids[:at], **scores(0, ids[:at]))
        await job.send(at, ids[at:], finish_reason="stop", usage=job.usage(len(ids)),
                       **scores(at, ids[at:]))  # fmt: skip

    return behaviour


async def fail_with(job: Job, code: str = "invalid_request", after_tokens: int = 0) -> None:
    """Send ``after_tokens`` letters, then an error chunk."""
    if after_tokens:
        await job.send(0, alphabet_tokens(after_tokens))
    await job.send(after_tokens, [], error=ErrorInfo(code=code, message=f"worker says {code}"))


async def never_answer(job: Job) -> None:
    await asyncio.sleep(3600)


@dataclass
class FakeWorker:
    """A worker of ``group``: telemetry every ``telemetry_s``, jobs through ``behaviour``."""

    nats_config: NatsConfig
    group: str
    behaviour: Behaviour = echo_alphabet
    worker_id: str = "w1"
    telemetry_s: float = 0.3
    state: str = "serving"
    jobs: list[Job] = field(default_factory=list)
    nc: Client = field(init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False

    async def start(self) -> FakeWorker:
        self.nc = await qnats.connect(self.nats_config, f"fake-{self.group}-{self.worker_id}")
        js = self.nc.jetstream()
        await qnats.ensure_stream(js, self.nats_config, [self.group])
        await qnats.ensure_group_consumer(js, self.nats_config, self.group)
        self._sub = await qnats.group_pull_subscription(js, self.nats_config, self.group)
        await self._report()
        self._tasks = [
            asyncio.create_task(self._telemetry()),
            asyncio.create_task(self._pull()),
        ]
        return self

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._tasks, what="fake worker tasks")
        await self.nc.close()

    async def _report(self) -> None:
        subjects = Subjects(self.nats_config.subject_prefix)
        report = Telemetry(
            worker=self.worker_id,
            group=self.group,
            ts_ms=int(time.time() * 1000),
            state=self.state,  # type: ignore[arg-type]
        )
        await self.nc.publish(subjects.telemetry(self.group, self.worker_id), report.to_bytes())

    async def _telemetry(self) -> None:
        while True:
            await asyncio.sleep(self.telemetry_s)
            await self._report()

    async def _pull(self) -> None:
        # A cancel that lands inside nats-py's fetch can surface as TimeoutError (Python
        # 3.11); the flag ends the loop anyway, so stop() never waits on it forever.
        while not self._stopping:
            try:
                msgs = await self._sub.fetch(8, timeout=0.5)
            except TimeoutError:
                continue
            for msg in msgs:
                request = GenerateRequest.from_bytes(msg.data)
                job = Job(request, dict(msg.headers or {}), msg, self)
                self.jobs.append(job)
                self._tasks.append(asyncio.create_task(self._run(job)))

    async def _run(self, job: Job) -> None:
        try:
            await self.behaviour(job)
        finally:
            with contextlib.suppress(Exception):
                await job.msg.ack()


@contextlib.asynccontextmanager
async def running_worker(nats_config: NatsConfig, group: str, **kwargs: object):  # type: ignore[no-untyped-def]
    worker = await FakeWorker(nats_config, group, **kwargs).start()  # type: ignore[arg-type]
    try:
        yield worker
    finally:
        await worker.stop()
