"""OpenAI's ``n`` through the gateway (``gateway/choices.py``): each choice a request of its
own on NATS, one response; a failure or a client leaving ends them all and leaks nothing."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from common.config import NatsConfig
from common.protocol import Control
from common.subjects import Subjects
from tests.gateway.conftest import MODEL, Served, gateway_config, serve
from tests.gateway.fake_worker import (
    FakeWorker,
    Job,
    echo_alphabet,
    expected_reply,
    fail_with,
    never_answer,
    running_worker,
)

pytestmark = pytest.mark.timeout(60)
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 5}


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def _released(gw: Served) -> bool:
    state = gw.app.state.gateway
    return state.admission.in_flight("short") == 0 and state.dispatch.dispatcher.open_streams == 0


async def _aborts(worker: FakeWorker, nats_config: NatsConfig) -> list[Control]:
    controls: list[Control] = []

    async def on_msg(msg: Any) -> None:
        controls.append(Control.from_bytes(msg.data))

    await worker.nc.subscribe(Subjects(nats_config.subject_prefix).abort("short"), cb=on_msg)
    return controls


def _requests_total(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("qos_gateway_requests_total{")
    )


async def test_n_choices_are_n_requests_and_one_response(nats_config: NatsConfig) -> None:
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        whole = (await http.post("/v1/completions", json={**BODY, "n": 3, "seed": 7})).json()
        async with http.stream(
            "POST", "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 5, "n": 2, "stream": True,
                  "stream_options": {"include_usage": True}},
        ) as response:  # fmt: skip
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        metrics = (await http.get("/metrics")).text
        await _until(lambda: _released(gw))
    text, finish = expected_reply(5)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert all(c["text"] == text and c["finish_reason"] == finish for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == 15
    assert whole["usage"]["prompt_tokens"] == len(worker.jobs[0].request.prompt_token_ids)
    # Each choice its own request, seeded seed + index.
    seeds = sorted(j.request.params.seed for j in worker.jobs[:3])
    assert seeds == [7, 8, 9] and len({j.request.id for j in worker.jobs}) == 5
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len({e["id"] for e in events}) == 1
    streamed = ["", ""]
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == [text, text]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    assert _requests_total(metrics) == 2  # one per HTTP request, not per choice


async def test_a_failing_choice_fails_the_response_and_stops_the_others(
    nats_config: NatsConfig,
) -> None:
    answered = 0

    async def one_fails(job: Job) -> None:
        nonlocal answered
        answered += 1
        if answered == 2:
            await fail_with(job, "invalid_request")
        else:
            await never_answer(job)

    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=one_fails) as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        aborts = await _aborts(worker, nats_config)
        reply = await http.post("/v1/completions", json={**BODY, "n": 3})
        await _until(lambda: _released(gw) and len(aborts) == 2)
        assert reply.status_code == 400 and "worker says" in reply.json()["error"]["message"]
        assert reply.headers["x-request-id"].startswith("cmpl-")
        assert len({c.request_id for c in aborts}) == 2  # the two still running


async def test_a_streaming_client_that_leaves_aborts_every_choice(nats_config: NatsConfig) -> None:
    async def slow(job: Job) -> None:
        await echo_alphabet(job, chunk_size=1, delay_s=0.2)

    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=slow) as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        aborts = await _aborts(worker, nats_config)
        body = {**BODY, "max_tokens": 26, "n": 3, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # one event, then hang up
        await _until(lambda: _released(gw) and len(aborts) == 3)
        assert {c.request_id for c in aborts} == {j.request.id for j in worker.jobs}


async def test_more_choices_than_a_group_ever_holds_are_a_400_with_nothing_started(
    nats_config: NatsConfig,
) -> None:
    """A 429 would have told the client to retry a request no idle gateway can serve."""
    config = gateway_config(nats_config, short__max_pending=2)
    async with (
        serve(config) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        never = await http.post("/v1/completions", json={**BODY, "n": 3})
        assert _released(gw)
        served = await http.post("/v1/completions", json={**BODY, "n": 2})
        await _until(lambda: _released(gw))
    assert never.status_code == 400 and never.json()["error"]["param"] == "n"
    assert served.status_code == 200 and len(served.json()["choices"]) == 2
    assert len(worker.jobs) == 2  # the served request's two; nothing of the refused one


@pytest.mark.parametrize("n", [0, 17, -1])
async def test_n_out_of_range_is_a_400(gateway: Served, n: int) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        reply = await http.post("/v1/completions", json={**BODY, "n": n})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"


async def test_a_batch_of_prompts_is_one_response_of_n_choices_each(
    nats_config: NatsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenAI and vLLM number them: choice ``p * n + i`` is choice ``i`` of prompt ``p``."""
    caplog.set_level(logging.INFO, logger="gateway.choices")
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        batch = {**BODY, "prompt": ["hello", "hi"], "n": 2, "seed": 7}
        whole = (await http.post("/v1/completions", json=batch)).json()
        async with http.stream(
            "POST", "/v1/completions", json={**batch, "stream": True, "n": 1}
        ) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        await _until(lambda: _released(gw))
    text, finish = expected_reply(5)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == text and c["finish_reason"] == finish for c in whole["choices"])
    # Each prompt once however many choices it has (ByteTokenizer: BOS, then a byte a token).
    assert whole["usage"]["prompt_tokens"] == (1 + len("hello")) + (1 + len("hi"))
    assert whole["usage"]["completion_tokens"] == 4 * 5
    sent = sorted(
        (bytes(j.request.prompt_token_ids[1:]), j.request.params.seed) for j in worker.jobs[:4]
    )
    assert sent == [(b"hello", 7), (b"hello", 8), (b"hi", 7), (b"hi", 8)]
    # The log ties the requests the workers saw to the response's id.
    (line,) = [r for r in caplog.records if r.getMessage().startswith("4 choices")]
    assert set(line.getMessage().split()[-4:]) == {j.request.id for j in worker.jobs[:4]}
    # Streamed with n=1: one choice a prompt, indexed by its prompt.
    streamed = ["", ""]
    for line in lines[:-1]:
        for choice in json.loads(line[6:])["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [text, text] and lines[-1] == "data: [DONE]"


async def test_every_choice_is_admitted_into_one_group_and_counted_as_one_fallback(
    nats_config: NatsConfig,
) -> None:
    """Admitted one by one, a half-open group took some choices and passed the others on,
    and each choice counted a fallback of its own."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        reply = await http.post(
            "/v1/realtime/completions", json={**BODY, "prompt": ["a", "b"], "n": 2}
        )
        metrics = (await http.get("/metrics")).text
        await _until(lambda: _released(gw))
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 4
    assert reply.headers["X-QoS-Group"] == "short"
    assert reply.headers["X-QoS-Fallback-From"] == "realtime"
    assert {j.request.group for j in worker.jobs} == {"short"}
    assert (
        'qos_gateway_fallbacks_total{from_group="realtime",reason="no_worker",to_group="short"} 1.0'
        in metrics
    )  # one for the HTTP request, not one for each of its four choices


async def test_a_refused_choice_answers_with_the_group_that_served_it(
    nats_config: NatsConfig,
) -> None:
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=fail_with) as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        reply = await http.post("/v1/realtime/completions", json={**BODY, "n": 2})
        await _until(lambda: _released(gw))
    assert reply.status_code == 400 and worker.jobs
    assert reply.headers["X-QoS-Group"] == "short"
    assert reply.headers["X-QoS-Fallback-From"] == "realtime"


async def test_prompts_times_n_beyond_the_group_is_a_400_naming_the_prompt(
    nats_config: NatsConfig,
) -> None:
    config = gateway_config(nats_config, short__max_pending=3)
    async with (
        serve(config) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        reply = await http.post("/v1/completions", json={**BODY, "prompt": ["a", "b"], "n": 2})
        assert _released(gw)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert "2 prompts x n=2" in reply.json()["error"]["message"] and not worker.jobs


async def test_echo_returns_each_prompt_before_its_completion(nats_config: NatsConfig) -> None:
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short"),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        echo = {**BODY, "echo": True}
        one = (await http.post("/v1/completions", json=echo)).json()
        batch = await http.post("/v1/completions", json={**echo, "prompt": [[97, 98], [99, 100]]})
        streams = []
        for body in ({**echo, "stream": True}, {**echo, "stream": True, "n": 2}):
            async with http.stream("POST", "/v1/completions", json=body) as response:
                streams.append(
                    [
                        json.loads(line[6:])["choices"][0]
                        async for line in response.aiter_lines()
                        if line.startswith("data: {")
                    ]
                )
        await _until(lambda: _released(gw))
    text, _ = expected_reply(5)
    assert one["choices"][0]["text"] == "hello" + text
    assert [c["text"] for c in batch.json()["choices"]] == ["ab" + text, "cd" + text]
    for choices in streams:
        by_index: dict[int, list[str]] = {}
        for choice in choices:
            by_index.setdefault(choice["index"], []).append(choice["text"])
        # The prompt is a chunk of its own, each choice's first.
        assert all(texts[0] == "hello" for texts in by_index.values())
        assert all("".join(texts) == "hello" + text for texts in by_index.values())


async def test_echo_with_logprobs_scores_the_prompt_first(nats_config: NatsConfig) -> None:
    """As vLLM answers (and lm-evaluation-harness reads): the prompt's tokens head the
    legacy logprobs, the first with none; ``max_tokens`` 0 scores the prompt alone."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        body = {**BODY, "prompt": [[104, 105, 33]], "echo": True, "logprobs": 1, "max_tokens": 2}
        whole = (await http.post("/v1/completions", json=body)).json()
        scored = (await http.post("/v1/completions", json={**body, "max_tokens": 0})).json()
        async with http.stream(
            "POST", "/v1/completions", json={**body, "max_tokens": 0, "stream": True}
        ) as response:
            events = [
                json.loads(line[6:])["choices"][0]
                async for line in response.aiter_lines()
                if line.startswith("data: {")
            ]
        no_echo = await http.post("/v1/completions", json={**BODY, "max_tokens": 0})
        await _until(lambda: _released(gw))
    assert [j.request.params.prompt_logprobs for j in worker.jobs] == [1, 1, 1]
    assert [j.request.params.max_tokens for j in worker.jobs] == [2, 1, 1]
    choice = whole["choices"][0]
    assert choice["text"] == "hi!ab"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["h", "i", "!", "a", "b"]
    assert lp["token_logprobs"] == [None, -0.25, -0.5, -0.5, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"?": -9.0, "i": -0.25}
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    expected = {"tokens": ["h", "i", "!"], "token_logprobs": [None, -0.25, -0.5],
                "top_logprobs": [None, {"?": -9.0, "i": -0.25}, {"?": -9.0, "!": -0.5}],
                "text_offset": [0, 1, 2]}  # fmt: skip
    only = scored["choices"][0]
    assert only["text"] == "hi!" and only["finish_reason"] == "length"
    assert only["logprobs"] == expected
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == 3
    assert events[0]["text"] == "hi!" and events[0]["logprobs"] == expected
    assert "".join(e["text"] for e in events) == "hi!"
    assert events[-1]["finish_reason"] == "length"
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"


async def test_scorings_that_could_never_be_answered_are_400s(nats_config: NatsConfig) -> None:
    """n identical scorings, and a prompt whose logprobs would not fit in one message (the
    worker would run the whole prompt, then fail it, and its breaker would count that)."""
    nats = nats_config.model_copy(update={"max_payload_bytes": 64 * 1024})
    async with (
        serve(gateway_config(nats)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        score = {**BODY, "echo": True, "max_tokens": 0, "logprobs": 1}
        twice = await http.post("/v1/completions", json={**score, "n": 2})
        # 200 tokens x 20 alternatives ~ 37 KB: fits; 600 ~ 110 KB: does not.
        fits = await http.post("/v1/completions", json={**score, "prompt": [[97] * 200],
                                                        "logprobs": 20})  # fmt: skip
        too_big = await http.post("/v1/completions", json={**score, "prompt": [[97] * 600],
                                                           "logprobs": 20})  # fmt: skip
        await _until(lambda: _released(gw))
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "n"
    assert fits.status_code == 200, fits.text
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "logprobs"
    assert "nats.max_payload_bytes" in too_big.json()["error"]["message"]
    assert len(worker.jobs) == 1  # the one that fits


async def test_echoed_prompt_offsets_index_its_text_under_a_sentencepiece_vocabulary(
    nats_config: NatsConfig,
) -> None:
    """Llama 2's "▁ok" is b" ok" on its own but "ok" at the start of a text: offsets from
    each token's bytes ran one past the echo for every token after the first."""
    from tests.engine.test_tokenizer import sentencepiece_byte_fallback

    tok = sentencepiece_byte_fallback()
    async with (
        serve(gateway_config(nats_config), tok) as gw,
        running_worker(nats_config, "short"),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        body = {**BODY, "prompt": "ok ok", "echo": True, "max_tokens": 0, "logprobs": 0}
        reply = (await http.post("/v1/completions", json=body)).json()
        await _until(lambda: _released(gw))
    choice = reply["choices"][0]
    assert choice["text"] == "ok ok"
    assert choice["logprobs"]["tokens"] == [" ok", " ok"]
    assert choice["logprobs"]["text_offset"] == [0, 2]  # bytes gave [0, 3]


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    nats_config: NatsConfig,
) -> None:
    """vLLM's stream option: each chunk (with include_usage) carries the usage so far, each
    choice's own; the last, usage-only chunk the whole response's."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short"),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        options = {"include_usage": True, "continuous_usage_stats": True}
        streams = []
        for extra in ({"stream_options": options}, {"stream_options": options, "n": 2},
                      {"stream_options": {"continuous_usage_stats": True}}):  # fmt: skip
            body = {**BODY, "max_tokens": 7, "stream": True, **extra}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines = [line async for line in response.aiter_lines()]
                streams.append([json.loads(x[6:]) for x in lines if x.startswith("data: {")])
        await _until(lambda: _released(gw))
    one, two, without = streams
    prompt = 1 + len("hello")
    counts = [c["usage"]["completion_tokens"] for c in one[:-1]]
    assert counts == [3, 6, 7]  # the fake worker's chunks of 3 letters
    assert all(c["usage"]["prompt_tokens"] == prompt for c in one)
    assert one[-1]["choices"] == [] and one[-1]["usage"]["completion_tokens"] == 7
    for index in (0, 1):
        ours = [c for c in two[:-1] if c["choices"][0]["index"] == index]
        assert [c["usage"]["completion_tokens"] for c in ours] == [3, 6, 7]
    assert two[-1]["usage"]["completion_tokens"] == 14
    assert all("usage" not in c for c in without)  # it needs include_usage, as in vLLM
