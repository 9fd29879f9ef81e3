"""The official openai client, sync and async, against the gateway served by uvicorn."""

from __future__ import annotations

import asyncio
import codecs
import json
from typing import Any

import httpx
import openai
import pytest

from common.config import NatsConfig
from common.protocol import Chunk, TopLogprobs
from common.tokenizer import ByteTokenizer
from gateway.responses import MIN_LOGPROB, Kind, Shaper
from gateway.streams import Delivery
from tests.gateway.conftest import MODEL, Served
from tests.gateway.fake_worker import (
    CACHED_TOKENS,
    Behaviour,
    Job,
    expected_reply,
    running_worker,
)

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


ALTERNATIVE = 0xE2  # every position's runner-up: the first byte of a 3-byte character


def spell(reply: str) -> Behaviour:
    """A worker answering ``reply`` one byte (ByteTokenizer token) a chunk, each with the
    text it completes: none for a piece of a character, the character with its last byte."""

    async def behaviour(job: Job) -> None:
        ids = list(reply.encode())
        text = codecs.getincrementaldecoder("utf-8")()
        for seq, token in enumerate(ids):
            last = seq == len(ids) - 1
            chunk = Chunk(
                id=job.request.id,
                seq=seq,
                token_ids=[token],
                text=text.decode(bytes((token,))),
                finish_reason="stop" if last else None,
                usage=job.usage(len(ids)) if last else None,
                logprobs=[-0.5],
                top_logprobs=[TopLogprobs([token, ALTERNATIVE], [-0.5, -1.5])],
                worker=job.worker.worker_id,
            )
            await job.worker.nc.publish(job.request.reply, chunk.to_bytes())

    return behaviour


async def test_chat_logprobs_of_a_character_split_over_tokens_carry_its_bytes(
    gateway: Served, nats_config: NatsConfig
):
    async with running_worker(nats_config, "short", behaviour=spell("é!")):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=5,
            logprobs=True,
            top_logprobs=2,
        )
    assert chat.choices[0].message.content == "é!"
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    # Each piece's own byte, not U+FFFD's [239, 191, 189]; its text is U+FFFD.
    assert [(c.token, c.bytes) for c in content] == [
        ("\ufffd", [195]),
        ("\ufffd", [169]),
        ("!", [33]),
    ]
    assert bytes(b for c in content[:2] for b in c.bytes or []).decode() == "é"
    assert [[(t.token, t.bytes) for t in c.top_logprobs] for c in content] == [
        [("\ufffd", [195]), ("\ufffd", [ALTERNATIVE])],
        [("\ufffd", [169]), ("\ufffd", [ALTERNATIVE])],
        [("!", [33]), ("\ufffd", [ALTERNATIVE])],
    ]


async def test_completion_logprobs_spell_pieces_as_bytes_and_offsets_index_the_text(
    gateway: Served, nats_config: NatsConfig
):
    reply = "aé🙂b"
    async with running_worker(nats_config, "short", behaviour=spell(reply)):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        whole = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=2
        )
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=2, stream=True
        )
        chunks = [c async for c in stream]
    lp = whole.choices[0].logprobs
    assert lp is not None
    # Streamed, offsets run on across chunks (one token each here) just the same.
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for text, tokens, offsets, top in [
        (whole.choices[0].text, lp.tokens, lp.text_offset, lp.top_logprobs),
        (
            "".join(c.choices[0].text for c in chunks),
            [t for s in streamed for t in s.tokens or []],
            [o for s in streamed for o in s.text_offset or []],
            [t for s in streamed for t in s.top_logprobs or []],
        ),
    ]:
        assert text == reply
        # OpenAI's spelling of bytes that are no text on their own.
        assert tokens == ["a", "bytes:\\xc3", "bytes:\\xa9"] + [
            f"bytes:\\x{b:02x}" for b in "🙂".encode()
        ] + ["b"]
        assert offsets == [0, 1, 1, 2, 2, 2, 2, 3]
        assert [text[o] for o in offsets] == ["a", "é", "é", "🙂", "🙂", "🙂", "🙂", "b"]
        assert top is not None and top[:2] == [
            {"a": -0.5, "bytes:\\xe2": -1.5},
            {"bytes:\\xc3": -0.5, "bytes:\\xe2": -1.5},
        ]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_nan_logprob_serialises_as_a_number(kind: Kind) -> None:
    # The wire refuses NaN (common.protocol), so only a gateway-side bug could bring one;
    # the response must still be valid JSON.
    nan = float("nan")
    delivery = Delivery(
        token_ids=[97],
        text="a",
        logprobs=[nan],
        top_logprobs=[TopLogprobs([97, 98], [nan, float("-inf")])],
    )
    shaper = Shaper(kind, "id-1", MODEL, 0, ByteTokenizer().token_bytes, logprobs=2)
    body = json.dumps(shaper.body("a", "stop", {}, delivery), allow_nan=False)
    event = shaper.delta_event(delivery).decode().removeprefix("data: ")
    for document in (body, event):
        choice = json.loads(document, parse_constant=_reject_constant)["choices"][0]
        if kind == "chat":
            entry = choice["logprobs"]["content"][0]
            assert entry["logprob"] == MIN_LOGPROB
            assert [t["logprob"] for t in entry["top_logprobs"]] == [MIN_LOGPROB] * 2
        else:
            assert choice["logprobs"]["token_logprobs"] == [MIN_LOGPROB]
            assert choice["logprobs"]["top_logprobs"] == [{"a": MIN_LOGPROB, "b": MIN_LOGPROB}]


@pytest.mark.parametrize("k", [0, 1])
def test_completion_top_logprobs_always_hold_the_chosen_token(k: int) -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements"; a sampled token outside the best k was missing, and
    ``logprobs: 0`` gave null."""
    delivery = Delivery(
        token_ids=[99], text="c", logprobs=[-2.0], top_logprobs=[TopLogprobs([97], [-0.1])]
    )
    shaper = Shaper("completion", "id-1", MODEL, 0, ByteTokenizer().token_bytes, logprobs=k)
    top = shaper.body("c", "length", {}, delivery)["choices"][0]["logprobs"]["top_logprobs"]
    assert top == ([{"a": -0.1, "c": -2.0}] if k else [{"c": -2.0}])


def test_a_streamed_chunk_without_tokens_has_null_logprobs() -> None:
    """The last chunk, with only the finish reason, sent ``{"content": []}`` (OpenAI: null)."""
    shaper = Shaper("chat", "id-1", MODEL, 0, ByteTokenizer().token_bytes, logprobs=0)
    event = shaper.delta_event(Delivery(token_ids=[], text="", finish_reason="stop"))
    choice = json.loads(event.decode().removeprefix("data: "))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None


async def test_vllm_extensions_travel_to_the_worker(gateway: Served, nats_config: NatsConfig):
    """min_tokens, skip_special_tokens and include_stop_str_in_output (vLLM's, through
    ``extra_body``) were refused as unknown; left out, nothing new travels (an older worker
    refuses fields it does not know)."""
    extra = {"min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": True}
    async with running_worker(nats_config, "short") as worker:
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body=extra)
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    asked, plain = (job.request.params for job in worker.jobs)
    assert (asked.min_tokens, asked.skip_special_tokens, asked.include_stop_str_in_output) == (
        2, False, True,
    )  # fmt: skip
    assert (plain.min_tokens, plain.skip_special_tokens, plain.include_stop_str_in_output) == (
        None, None, None,
    )  # fmt: skip


async def test_tokenize_counts_what_admission_will_see_and_detokenize_inverts_it(
    gateway: Served, nats_config: NatsConfig
):
    """vLLM's /tokenize and /detokenize: a chat is rendered as /v1/chat/completions renders
    it, so its count is the one the request is admitted with."""
    tok = ByteTokenizer()
    async with (
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gateway.url, timeout=10) as http,
    ):
        chat = await http.post("/tokenize", json={"model": MODEL, "messages": CHAT})
        prompt = await http.post("/v1/tokenize", json={"prompt": "hi", "return_token_strs": True})
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        back = await http.post("/detokenize", json={"tokens": [104, 105, tok.EOS]})
        refused = [
            await http.post("/tokenize", json={"model": MODEL}),
            await http.post("/tokenize", json={"prompt": "a", "messages": CHAT}),
            await http.post("/detokenize", json={"tokens": [10**9]}),
        ]
        unknown = await http.post("/tokenize", json={"model": "gpt-5", "prompt": "a"})
    assert chat.status_code == prompt.status_code == back.status_code == 200
    sent = list(worker.jobs[0].request.prompt_token_ids)
    assert chat.json()["tokens"] == sent and chat.json()["count"] == len(sent)
    assert chat.json()["max_model_len"] > 0
    assert prompt.json() | {"max_model_len": 0} == {
        "count": 3, "max_model_len": 0, "tokens": [tok.BOS, 104, 105],
        "token_strs": ["<|bos|>", "h", "i"],
    }  # fmt: skip
    assert back.json() == {"prompt": "hi<|eos|>"}
    assert [r.status_code for r in refused] == [400, 400, 400] and unknown.status_code == 404
    assert refused[2].json()["error"]["param"] == "tokens"


async def test_a_fallback_group_settles_max_tokens_again_for_a_request_without_it(
    gateway: Served, nats_config: NatsConfig
):
    """Asked for realtime (64 tokens here), a 60-token prompt without max_tokens was settled
    to the 4 realtime leaves it, and kept 4 when realtime had no worker and short (256)
    served it: an answer cut short for no reason."""
    prompt = "a" * 59  # + BOS: 60 tokens
    async with (
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gateway.url, timeout=10) as http,
    ):
        answer = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt},
            headers={"X-QoS-Group": "realtime"},
        )  # fmt: skip
    assert answer.status_code == 200 and answer.headers["x-qos-fallback-from"] == "realtime"
    default = gateway.config.gateway.default_max_tokens
    assert worker.jobs[0].request.params.max_tokens == default  # not 64 - 60


async def test_text_offset_indexes_the_returned_text_past_a_skipped_special_token(
    gateway: Served, nats_config: NatsConfig
):
    """A special token mid-output (skip_special_tokens, the default) adds no text, but it
    moved text_offset by its own text's length: "ab" answered [0, 1, 8]."""
    pad = ByteTokenizer.PAD

    async def pad_between(job: Job) -> None:
        await job.send(0, [97, pad, 98], logprobs=[-0.5] * 3, finish_reason="length",
                       usage=job.usage(3))  # fmt: skip

    async with running_worker(nats_config, "short", behaviour=pad_between):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        completion = await client.completions.create(
            model=MODEL, prompt=[104, 105], max_tokens=3, logprobs=0
        )
    choice = completion.choices[0]
    assert choice.text == "ab" and choice.logprobs is not None
    assert choice.logprobs.text_offset == [0, 1, 1]


async def test_tokenize_under_a_group_gives_that_groups_limit(gateway: Served):
    """A client whose base_url names a group (/v1/realtime) calls /v1/realtime/tokenize: it
    was a 404, and the plain route answers the largest limit of all groups."""
    groups = gateway.config.groups
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        own = {g: await http.post(f"/v1/{g}/tokenize", json={"prompt": "hi"}) for g in groups}
        everyone = await http.post("/v1/tokenize", json={"prompt": "hi"})
        back = await http.post("/v1/realtime/detokenize", json={"tokens": [104, 105]})
        unknown = await http.post("/v1/nope/tokenize", json={"prompt": "hi"})
        unknown_back = await http.post("/v1/nope/detokenize", json={"tokens": [104]})
        query = await http.post("/v1/tokenize?group=realtime", json={"prompt": "hi"})
    assert {g: r.json()["max_model_len"] for g, r in own.items()} == {
        g: c.max_seq_len for g, c in groups.items()
    }
    assert everyone.json()["max_model_len"] == max(c.max_seq_len for c in groups.values())
    assert back.json() == {"prompt": "hi"}
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "group_not_found"
    assert unknown_back.status_code == 404
    assert query.json()["max_model_len"] == everyone.json()["max_model_len"]  # path only


async def test_a_400_gives_the_reason_of_the_parameter_it_names(gateway: Served):
    """Pydantic reports every failing field: the 400 named the first (temperature) and gave
    the first validator message anywhere (n's), so the openai client read "Invalid value for
    'temperature': only n=1 is supported"."""
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="hi", temperature=5, n=2)
    assert bad.value.param == "temperature", bad.value.message
    assert "n=1" not in bad.value.message


async def test_streamed_chunks_asked_to_be_obfuscated_are_padded_and_still_parse(
    gateway: Served, nats_config: NatsConfig
):
    """include_obfuscation was accepted and ignored: each SSE event's size was a token's
    length plus a constant, which a passive observer of TLS traffic reads replies from.
    Padded, events of one token each fall in a few size buckets, and the client's text is
    the same."""
    async with running_worker(nats_config, "short"):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        ask: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 30, "stream": True}
        padded = [
            c
            async for c in await client.chat.completions.create(
                **ask, stream_options={"include_obfuscation": True, "include_usage": True}
            )
        ]
        plain = [c async for c in await client.chat.completions.create(**ask)]
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            body = {**ask, "stream_options": {"include_obfuscation": True}}
            raw = (await http.post("/v1/chat/completions", json=body)).content
            asked = {**body, "logprobs": True, "top_logprobs": 2}
            raw_logprobs = (await http.post("/v1/chat/completions", json=asked)).content
            # An echoed prompt opens the stream: it must not size the chunks after it.
            echoed = {"model": MODEL, "prompt": "x" * 150, "echo": True, "max_tokens": 12,
                      "stream": True, "stream_options": {"include_obfuscation": True}}  # fmt: skip
            raw_echo = (await http.post("/v1/completions", json=echoed)).content
    after_echo = [e for e in raw_echo.split(b"\n\n") if e.startswith(b"data: {")][1:]
    assert len({len(e) for e in after_echo}) == 1 and len(after_echo[0]) <= 320, after_echo
    text = "".join(c.choices[0].delta.content or "" for c in padded if c.choices)
    assert text == "".join(c.choices[0].delta.content or "" for c in plain if c.choices)
    assert text == expected_reply(30)[0] and padded[-1].usage is not None
    # The SDK's ChatCompletionChunk has the field: OpenAI sends it.
    assert all(isinstance(c.obfuscation, str) and c.obfuscation for c in padded)
    assert all(c.obfuscation is None for c in plain)
    # After the opening (the role, padded apart), every chunk one size: the letters, the
    # ending, and with logprobs too (each alternative spells its token out again).
    for stream in (raw, raw_logprobs):
        events = [e for e in stream.split(b"\n\n") if e.startswith(b"data: {")]
        sizes = {len(e) for e in events[1:]}
        assert len(events) > 5 and len(sizes) == 1, sorted(len(e) for e in events)
        assert stream.endswith(b"data: [DONE]\n\n")
        assert all(e.count(b'"obfuscation"') == 1 for e in events)  # padded once each


def test_padding_makes_a_streams_small_chunks_one_size_and_leaves_done_alone() -> None:
    """Rounded to a bucket with the jitter after it, a chunk's bucket was its length's:
    tokens either side of a boundary always told apart. A stream's events are now one
    size up to its headroom, whatever their token; [DONE] and big events as they are."""
    from gateway.obfuscation import BIG_EVENT_BYTES, HEADROOM, Padder

    def chunk(token: str) -> bytes:
        head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
        return ("data: " + head + '"choices":[{"index":0,"delta":{"content":'
                + json.dumps(token) + '},"finish_reason":null}]}\n\n').encode()  # fmt: skip

    for name_pad in range(0, 64, 7):  # the constant part at every offset within a bucket
        pad = Padder()
        sizes = set()
        for token in ["a", "abcd", "x" * 20, "y" * (HEADROOM - 8), "é\n"]:
            out = pad(chunk(token).replace(b'"model":"m"', b'"model":"' + b"m" * name_pad + b'"'))
            (event, end) = out.split(b"\n\n")
            assert end == b"" and json.loads(event.removeprefix(b"data: "))["obfuscation"]
            sizes.add(len(event))
        assert len(sizes) == 1, (name_pad, sizes)
    pad = Padder()
    assert pad(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    big = b'data: {"x":"' + b"z" * BIG_EVENT_BYTES + b'"}\n\n'
    assert pad(big) == big


async def test_streamed_choices_reach_the_stream_helper_in_order_whichever_speaks_first(
    gateway: Served, nats_config: NatsConfig
):
    """Each choice is a request of its own, so choice 1 may speak first. The openai
    client's stream helper files choices by order of appearance: with choice 1's role chunk
    first it raised IndexError (or filed one choice's text under the other)."""

    async def later_choice_first(job: Job) -> None:
        index = job.request.params.seed - 7  # seeded seed + index
        if index == 0:
            await asyncio.sleep(0.3)
        text = b"first" if index == 0 else b"second"
        await job.send(0, list(text), finish_reason="stop", usage=job.usage(len(text)))

    async with running_worker(nats_config, "short", behaviour=later_choice_first):
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        async with client.chat.completions.stream(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=8,
            n=2,
            seed=7,
        ) as stream:
            final = await stream.get_final_completion()
    assert [c.message.content for c in final.choices] == ["first", "second"]
    assert [c.index for c in final.choices] == [0, 1]
