"""The official openai client, sync and async, against the gateway served by uvicorn."""

from __future__ import annotations

import asyncio

import openai

from common.config import NatsConfig
from tests.gateway.conftest import MODEL, Served
from tests.gateway.fake_worker import CACHED_TOKENS, expected_reply, running_worker

PROMPT = "Say the alphabet"
PROMPT_TOKENS = 1 + len(PROMPT)  # ByteTokenizer: BOS + one token per byte
CHAT = [{"role": "user", "content": "hi"}]
# ByteTokenizer's template: "<|user|>\nhi\n<|assistant|>\n", one token per byte, no BOS.
CHAT_PROMPT_TOKENS = len("<|user|>\nhi\n<|assistant|>\n")


async def test_sync_completion_text_and_usage_exact(gateway: Served, nats_config: NatsConfig):
    async with running_worker(nats_config, "short"):
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        result = await asyncio.to_thread(
            client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=10
        )
    text, finish = expected_reply(10)
    assert result.choices[0].text == text
    assert result.choices[0].finish_reason == finish == "length"
    assert result.object == "text_completion" and result.model == MODEL
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (PROMPT_TOKENS, 10)
    assert result.usage.total_tokens == PROMPT_TOKENS + 10
    assert result.usage.prompt_tokens_details is not None
    assert result.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS


async def test_sync_streamed_chat_with_include_usage(gateway: Served, nats_config: NatsConfig):
    async with running_worker(nats_config, "short"):
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)

        def run() -> list:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=30,
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(stream)

        chunks = await asyncio.to_thread(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert (text, finishes) == (expected_reply(30)[0], ["stop"])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == CHAT_PROMPT_TOKENS
    assert usage_chunk.usage.completion_tokens == 26
    assert all(c.usage is None for c in chunks[:-1])


async def test_async_chat_not_streamed(gateway: Served, nats_config: NatsConfig):
    async with running_worker(nats_config, "short"):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        result = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_completion_tokens=5,
        )
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == "abcde"
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (CHAT_PROMPT_TOKENS, 5)


async def test_async_streamed_completion_without_usage(gateway: Served, nats_config: NatsConfig):
    async with running_worker(nats_config, "short"):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=7, stream=True
        )
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "abcdefg"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


async def test_token_id_prompt_and_logprobs_in_both_shapes(
    gateway: Served, nats_config: NatsConfig
):
    async with running_worker(nats_config, "short"):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        completion = await client.completions.create(
            model=MODEL, prompt=[104, 105], max_tokens=3, logprobs=2
        )
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=2,
            logprobs=True,
            top_logprobs=1,
        )
    lp = completion.choices[0].logprobs
    assert lp is not None and completion.usage is not None
    assert completion.usage.prompt_tokens == 2
    assert lp.tokens == ["a", "b", "c"] and lp.token_logprobs == [-0.5] * 3
    assert lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs == [
        {"a": -0.5, "?": -1.5},
        {"b": -0.5, "?": -1.5},
        {"c": -0.5, "?": -1.5},
    ]
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [(c.token, c.logprob, c.bytes) for c in content] == [
        ("a", -0.5, [97]),
        ("b", -0.5, [98]),
    ]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [("a", -0.5)],
        [("b", -0.5)],
    ]


async def test_models_lists_the_served_model(gateway: Served):
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
