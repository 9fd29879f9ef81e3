"""Poison messages: a request that fails every worker that touches it costs ``max_deliver``
attempts and ends with an explicit error to its caller, never a crash loop or a hang.

Two ways to fail: the worker process dies holding it (JetStream redelivers after
``ack_wait``, then gives up and publishes its ``MAX_DELIVERIES`` advisory, which the
gateway turns into an error), or the worker's own handling raises (it hands the message
back until the last delivery, then answers with an error and terminates it).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from common.config import NatsConfig
from common.services import NatsServer
from common.subjects import Subjects
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import never_answer, running_worker
from tests.reliability.conftest import StackFactory
from tests.reliability.harness import body, completion, expected_text, group
from workers import service as worker_service
from workers.outbox import sampling_params

POISON_SEED = 666


async def test_a_request_that_kills_every_worker_is_given_up_after_max_deliver_with_an_error(
    nats_config: NatsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    nats = nats_config.model_copy(update={"ack_wait_s": 0.5, "max_deliver": 3})
    caplog.set_level(logging.WARNING, logger="gateway.streams")
    # A worker that takes the message and never settles it is, to JetStream, one that died.
    async with (
        serve(gateway_config(nats)) as gw,
        running_worker(nats, "short", behaviour=never_answer) as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        started = time.monotonic()
        response = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
        )
        took = time.monotonic() - started
        await asyncio.sleep(1.0)  # no fourth delivery comes
        deliveries = len(worker.jobs)
        # Given up, it must not stay: a work queue keeps a message past max_deliver for good.
        js = worker.nc.jetstream()
        left = (await js.stream_info(nats.stream)).state.messages
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "request_given_up" and "3 deliveries" in error["message"]
    assert took < 5, f"the caller waited {took:.1f}s"
    assert deliveries == 3 and left == 0
    assert any("failed on all 3 deliveries" in r.getMessage() for r in caplog.records)


async def test_a_request_the_worker_fails_on_every_time_is_retried_then_answered_and_terminated(
    private_nats: NatsServer,
    make_stack: StackFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tokenizer: object,
) -> None:
    def fragile(request, max_tokens):  # type: ignore[no-untyped-def]
        if request.params.seed == POISON_SEED:
            raise RuntimeError("this request breaks the worker")
        return sampling_params(request, max_tokens)

    monkeypatch.setattr(worker_service, "sampling_params", fragile)
    caplog.set_level(logging.ERROR, logger="workers.intake")
    stack = make_stack(
        private_nats.url, {"short": group(4)}, {"short": 2},
        nats_overrides={"ack_wait_s": 2.0, "max_deliver": 3},
    )  # fmt: skip
    url = f"{stack.base_url}/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        poison, *normal = await asyncio.gather(
            completion(http, url, body(stack.model, POISON_SEED, 8)),
            *(completion(http, url, body(stack.model, seed, 8)) for seed in range(6)),
        )
    assert poison.kind == "error" and poison.code == "request_given_up", poison
    assert "3 deliveries" in poison.error["message"]  # type: ignore[index]
    for seed, outcome in enumerate(normal):  # the other requests never noticed
        assert outcome.kind == "complete" and outcome.text == expected_text(tokenizer, 8, seed)  # type: ignore[arg-type]
    retried = [r for r in caplog.records if "handing it back" in r.getMessage()]
    given_up = [r for r in caplog.records if "terminated as poison" in r.getMessage()]
    assert len(retried) == 2 and len(given_up) == 1
    nc = stack.workers["short-0"].nc
    assert nc is not None
    info = await stack.acall(
        nc.jetstream().consumer_info(stack.config.nats.stream, Subjects.consumer("short"))
    )
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    assert all(w.state == "serving" for w in stack.workers.values())


async def test_worker_processes_sigkilled_on_every_delivery_end_in_an_error_not_a_crash_loop(
    private_nats: NatsServer, make_stack: StackFactory, model_dir: object
) -> None:
    stack = make_stack(
        private_nats.url, {"short": group(4)}, {"short": 0},
        nats_overrides={"ack_wait_s": 1.0, "max_deliver": 2},
    )  # fmt: skip
    flags = ["--engine", "sim", "--model", str(model_dir), "--sim-base-ms", "50",
             "--sim-prefill-us-per-token", "0", "--sim-decode-us-per-seq", "0"]  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        child = stack.spawn_worker("crash-1", "short", *flags)
        await asyncio.to_thread(stack.wait_live, {"short": 1})
        request = asyncio.create_task(
            completion(http, f"{stack.base_url}/completions", body(stack.model, 5, 200))
        )
        for delivery in (1, 2):
            deadline = time.monotonic() + 60
            while not any(
                c.attempt == delivery for chunks in stack.chunks.values() for c in chunks
            ):
                assert time.monotonic() < deadline and not request.done(), stack.worker_log(
                    f"crash-{delivery}"
                )
                await asyncio.sleep(0.05)
            child.kill()  # the request "kills" the worker that holds it
            await asyncio.to_thread(child.wait)
            # A fresh replica each time; after the last delivery a healthy one that would
            # finish the request if JetStream handed it a third time.
            child = stack.spawn_worker(f"crash-{delivery + 1}", "short", *flags)
        started = time.monotonic()
        outcome = await request
        took = time.monotonic() - started
    assert outcome.kind == "error" and outcome.code == "request_given_up", outcome
    assert "2 deliveries" in outcome.error["message"]  # type: ignore[index]
    assert took < 10, f"the caller waited {took:.1f}s after the last crash"
    attempts = {c.attempt for chunks in stack.chunks.values() for c in chunks}
    assert attempts == {1, 2}  # JetStream gave up: the third worker was never handed it
