"""Guided decoding on a worker: the spec travels in RequestParams, the worker compiles it
off its engine thread, a bad one is an invalid_request error chunk, and the sim engine
refuses what it cannot do."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest

from common.client import QosClient
from common.errors import DeadlineExceededError, InvalidRequestError
from common.models import demo_model_path
from common.protocol import RequestParams
from tests.engine.test_guided import guides_fail_after
from workers.engine import LLMEngine
from workers.engine.args import EngineArgs

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
          "maximum": 999}}, "required": ["id"], "additionalProperties": False}  # fmt: skip


def guided(kind: str, spec: str, **more: Any) -> RequestParams:
    return RequestParams(max_tokens=40, seed=3, guided_kind=kind, guided_spec=spec, **more)


async def test_a_guided_request_matches_and_its_grammar_compiles_off_the_engine_thread(
    start_worker: Any, client: QosClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu", max_batch_size=4))
    compiled_on: list[str] = []
    real = engine.guide

    def guide(*args: Any) -> Any:
        compiled_on.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(engine, "guide", guide)
    service = await start_worker(engine=engine)
    ids = engine.tokenizer.encode("def main():\n")
    _, text, final = await client.collect(
        group="short", prompt_token_ids=ids, params=guided("json_schema", json.dumps(SCHEMA))
    )
    jsonschema.validate(json.loads(text), SCHEMA)
    assert final.finish_reason == "stop"
    assert compiled_on and all(not n.startswith("engine-") for n in compiled_on)
    assert threading.main_thread().name not in compiled_on  # nor on the event loop
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        await client.collect(group="short", prompt_token_ids=ids, params=guided("regex", "("))
    # The worker goes on serving.
    _, text, _ = await client.collect(
        group="short", prompt_token_ids=ids, params=guided("choice", '["on", "off"]')
    )
    assert text in ("on", "off")
    # Counted by kind once their matcher is made (a spec that cannot compile is not).
    registry = service.observer.registry
    labels = {"group": "short", "model": service.observer.metrics.model}
    count = [registry.get_sample_value("qos_guided_requests_total", {**labels, "kind": kind})
             for kind in ("json_schema", "choice", "regex")]  # fmt: skip
    assert count == [1.0, 1.0, None]
    assert registry.get_sample_value("qos_guided_compile_seconds_count", labels) == 2.0


async def test_the_sim_engine_refuses_guided_requests(start_worker: Any, client: QosClient) -> None:
    await start_worker()
    with pytest.raises(InvalidRequestError, match="no guided decoding"):
        await client.collect(group="short", prompt_token_ids=[1, 2, 3],
                             params=guided("regex", "[a-z]+"))  # fmt: skip


async def test_guided_decoding_that_fails_mid_output_is_an_error_chunk_after_its_tokens(
    start_worker: Any, client: QosClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from common.errors import GuidedDecodingError

    guides_fail_after(monkeypatch, 4)
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu", max_batch_size=4))
    await start_worker(engine=engine)
    ids = engine.tokenizer.encode("def main():\n")
    got: list[int] = []
    # A 400 (the client's grammar hit the library's limits): no breaker counts it.
    with pytest.raises(GuidedDecodingError, match="guided decoding failed: limit"):
        async for chunk in client.generate(
            group="short", prompt_token_ids=ids, params=guided("json_schema", json.dumps(SCHEMA))
        ):
            got += chunk.token_ids
    assert len(got) == 4  # every token sampled went out, the last one included


async def test_a_failed_request_retired_while_its_tokens_flush_is_not_answered(
    start_worker: Any, client: QosClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its buffered tokens go out before its error chunk; a flush that waits (a full NATS
    buffer) can let the flight be retired meanwhile (superseded by another replica): it
    must then not ack the message another replica now serves."""
    consumed = guides_fail_after(monkeypatch, 4)
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu", max_batch_size=4))
    service = await start_worker(engine=engine)
    real_flush, completed = service._flush, []

    async def flush(st: Any) -> None:
        await real_flush(st)
        if len(consumed) >= 4 and service._inflight.get(st.request.id) is st:
            service._retire(st, "superseded")

    async def complete(st: Any, chunk: Any, *, error: bool) -> None:
        completed.append(chunk)

    monkeypatch.setattr(service, "_flush", flush)
    monkeypatch.setattr(service, "_complete", complete)
    ids = engine.tokenizer.encode("def main():\n")
    with pytest.raises(DeadlineExceededError):  # nobody answers: the client gives up
        await client.collect(group="short", prompt_token_ids=ids, timeout_s=1.5,
                             params=guided("json_schema", json.dumps(SCHEMA)))  # fmt: skip
    assert len(consumed) == 4 and completed == []
