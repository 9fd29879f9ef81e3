"""What mainstream clients send and expect, from the OpenAI API review: the official openai
client, LiteLLM's context-window check, browsers (CORS), uptime probes."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest

from common.config import NatsConfig
from tests.gateway.conftest import MODEL, Served, gateway_config, serve
from tests.gateway.fake_worker import fail_with, running_worker

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


async def test_top_p_zero_is_greedy_and_prompt_cache_retention_is_accepted(
    gateway: Served, nats_config: NatsConfig
):
    """OpenAI allows top_p 0 (only the likeliest token); a 400 refused clients configured
    with "temperature 0, top_p 0" for determinism."""
    async with (
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gateway.url, timeout=10) as http,
    ):
        body = {**BODY, "temperature": 0.9, "top_p": 0, "prompt_cache_retention": "24h"}
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    params = worker.jobs[0].request.params
    assert (params.temperature, params.top_p) == (0.0, 1.0)


async def test_the_context_length_error_reads_as_openais_for_litellm(gateway: Served):
    """LiteLLM raises ContextWindowExceededError (and routers take their context-window
    fallback) on OpenAI's wording only, not on the error code."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        response = await http.post("/v1/completions", json={**BODY, "max_tokens": 100_000})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["message"].lower().startswith("this model's maximum context length is")
    assert "in the completion" in error["message"]


async def test_models_answer_head_and_retrieve_by_id(gateway: Served):
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    card = await client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("org/other-model")  # ids may hold a "/"
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        head = await http.head("/v1/models")
        wrong = await http.delete("/v1/models")
    assert head.status_code == 200 and head.content == b""
    assert wrong.status_code == 405
    assert wrong.json()["error"]["type"] == "invalid_request_error"  # the caller's, not ours


async def test_cors_answers_preflights_only_when_origins_are_configured(nats_config: NatsConfig):
    preflight = {
        "Origin": "https://app.example.com",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    config = gateway_config(nats_config, cors_allow_origins=["https://app.example.com"])
    async with serve(config) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        allowed = await http.options("/v1/chat/completions", headers=preflight)
        listed = await http.get("/v1/models", headers={"Origin": "https://app.example.com"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
    # A browser lets a script read only the headers listed: openai-node reads x-should-retry
    # (without it, a 504 or a given-up request was retried as any 5xx).
    exposed = {
        h.strip().lower() for h in listed.headers["access-control-expose-headers"].split(",")
    }
    assert {"x-should-retry", "retry-after", "x-request-id"} <= exposed
    async with (
        serve(gateway_config(nats_config)) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        closed = await http.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in closed.headers


async def test_a_request_given_up_is_not_retried_by_the_openai_client(
    gateway: Served, nats_config: NatsConfig
):
    """A request that failed on every delivery (one that crashes workers, say) was a plain
    500: the openai client published it twice more, each run to max_deliver."""
    behaviour = functools.partial(fail_with, code="request_given_up")
    async with running_worker(nats_config, "short", behaviour=behaviour) as worker:
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=2)
        with pytest.raises(openai.InternalServerError) as failed:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert failed.value.response.headers["x-should-retry"] == "false"
    assert len(worker.jobs) == 1  # not run again


async def test_a_gateway_not_yet_on_nats_answers_503_with_retry_after(nats_config: NatsConfig):
    from common.tokenizer import ByteTokenizer
    from gateway.app import create_app

    app = create_app(gateway_config(nats_config), ByteTokenizer(), model=MODEL)
    transport = httpx.ASGITransport(app=app)  # no lifespan: never connected
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        response = await http.post("/v1/completions", json=BODY)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable"
