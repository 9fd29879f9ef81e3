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
from tests.workers.test_abort import _total
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
