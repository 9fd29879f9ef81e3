"""A chunk the NATS server will not carry ends its request with an error, not silence."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from common.client import QosClient
from common.config import Config, NatsConfig
from common.errors import InternalError
from common.protocol import RequestParams
from common.services import NatsServer
from tests.workers.conftest import expected_tokens
from tests.workers.test_abort import _total, _until
from workers.engine import EngineArgs, LLMEngine
from workers.service import WorkerService
from workers.sim import SimCost, SimEngine


# Tokens held for coalesce_ms go out as one chunk: with steps this fast, the whole answer
# in its final chunk, or a first chunk mid-answer, over the server's 1 KiB.
@pytest.mark.parametrize(("step_s", "coalesce_ms"), [(0.0, 5000.0), (0.001, 500.0)])
async def test_a_chunk_over_the_servers_max_payload_ends_the_request_with_an_error(
    fresh_nats_server: Callable[..., NatsServer],
    worker_config: Config,
    start_worker: Any,
    step_s: float,
    coalesce_ms: float,
) -> None:
    """nats-py refuses to publish it (MaxPayloadError): the worker logged it, acked the
    request as answered, and its caller waited to its deadline for a chunk never sent."""
    server = fresh_nats_server(max_payload=1024)
    tag = uuid.uuid4().hex[:8]
    nats = NatsConfig(url=server.url, subject_prefix=f"p{tag}", stream=f"QOS_REQ_{tag}",
                      kv_bucket=f"qos_state_{tag}")  # fmt: skip
    worker = worker_config.worker.model_copy(update={"coalesce_ms": coalesce_ms})
    groups = dict(worker_config.groups)
    groups["short"] = groups["short"].model_copy(update={"max_seq_len": 2048})
    config = worker_config.model_copy(update={"nats": nats, "worker": worker, "groups": groups})
    engine = SimEngine(max_batch_size=4, max_seq_len=2048, cost=SimCost(base_s=step_s))
    service = await start_worker(engine=engine, config=config)
    async with await QosClient.connect(config, "test-client") as client:
        with pytest.raises(InternalError, match="larger than the message bus carries"):
            await client.collect(group="short", prompt_token_ids=[1, 2],
                                 params=RequestParams(max_tokens=1500), timeout_s=20)  # fmt: skip
        assert not service.inflight_ids and service.state == "serving"
        ids, _, _ = await client.collect(
            group="short", prompt_token_ids=[5, 6], params=RequestParams(max_tokens=3)
        )
    assert ids == expected_tokens(2, 3)
    # Counted as the caller heard it: an error, never a success that was not delivered.
    registry = service.observer.registry
    assert _total(registry, "qos_request_errors_total", code="internal_error") == 1
    assert _total(registry, "qos_request_success_total") == 1  # the second request
    assert service.telemetry.errors == 1


async def test_a_first_chunk_too_big_ends_the_request_though_its_ending_came_with_it(
    fresh_nats_server: Callable[..., NatsServer],
    worker_config: Config,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's outputs of one request reach the pump together when the loop misses a
    step: the first chunk (the prompt's logprobs on it) was too big, dropped and the request
    aborted, and its ending in the same batch still went out as a success behind the gap,
    acked and counted, while the error meant to end it found the request gone."""
    deliver = WorkerService._on_engine_events
    held: list[Any] = []

    def all_at_once(self: WorkerService, events: list[Any]) -> None:
        held.extend(events)
        if any(getattr(e, "finished", True) for e in held):
            deliver(self, held[:])
            held.clear()

    monkeypatch.setattr(WorkerService, "_on_engine_events", all_at_once)
    server = fresh_nats_server(max_payload=1024)
    tag = uuid.uuid4().hex[:8]
    nats = NatsConfig(url=server.url, subject_prefix=f"p{tag}", stream=f"QOS_REQ_{tag}",
                      kv_bucket=f"qos_state_{tag}")  # fmt: skip
    config = worker_config.model_copy(update={"nats": nats})
    engine = LLMEngine(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64,
                                  max_batch_size=4, max_seq_len=256))  # fmt: skip
    service = await start_worker(engine=engine, config=config)
    params = RequestParams(max_tokens=3, ignore_eos=True, temperature=0, prompt_logprobs=1)
    async with await QosClient.connect(config, "test-client") as client:
        with pytest.raises(InternalError, match="larger than the message bus carries"):
            await client.collect(group="short", prompt_token_ids=list(range(1, 101)),
                                 params=params, timeout_s=20)  # fmt: skip
        await _until(lambda: not service.inflight_ids)
    registry = service.observer.registry
    assert _total(registry, "qos_request_errors_total", code="internal_error") == 1
    assert _total(registry, "qos_request_success_total") == 0
