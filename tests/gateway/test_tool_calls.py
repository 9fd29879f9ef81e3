"""Tool calls read from a chat model's answer (Hermes format): whole and as it streams,
and through the gateway to the official openai client."""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import NatsConfig
from common.tokenizer import ByteTokenizer
from gateway.forced_calls import ForcedCalls
from gateway.tool_calls import (
    HermesCalls,
    Llama3JsonCalls,
    MistralCalls,
    ToolCallStream,
    tool_format,
)
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import answers, running_worker

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich"}}'
TIME = '{"name": "get_time", "arguments": {}}'
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": {"type": "object"}}},
    # The OpenAI Agents SDK sends strict on every tool: accepted, not enforced.
    {"type": "function", "function": {"name": "get_time", "strict": True}},
]  # fmt: skip
ANSWERS = [
    "Plain text, no call.",
    f"<tool_call>\n{WEATHER}\n</tool_call>",
    f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"<tool_call>\n{WEATHER}",  # the model stopped before its closing tag
    "<tool_call>\nnot json\n</tool_call> and text after",
    # A block with no call is text up to where that shows; the next block is read anew.
    f"<tool_call>not json<tool_call>{WEATHER}",
    "a < b and <tool_ca is not a tag",
    f"<tool_call>\n{TIME}\n</tool_call>\nA.\n\nB.",  # blank lines after a call are content
    # Arguments first, or as a JSON string: read whole once the object closes.
    '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    # Braces, brackets and quotes inside strings are the arguments' text.
    '<tool_call>{"name": "f", "arguments": {"q": "} ]\\"{ <", "n": [1, {}]}}</tool_call> done',
    '<tool_call>{"name": "f", "arguments": {"a": 1}, "id": "x"}</tool_call>',  # more keys
    '<tool_call>{"name": "f", "arguments": {"a": 1}}{"name": "g", "arguments": {}}</tool_call>',
]


def split_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    return HermesCalls(parallel).split(text)


def split_llama3_json(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    return Llama3JsonCalls(parallel).split(text)


def split_mistral(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    return MistralCalls(parallel).split(text)


def _names(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_whole_answer_splits_into_content_and_calls() -> None:
    assert split_calls(ANSWERS[0]) == (ANSWERS[0], [])
    content, calls = split_calls(ANSWERS[1])
    assert content is None and _names(calls) == [("get_weather", {"city": "Zürich"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    content, calls = split_calls(ANSWERS[2])
    assert content == "Let me look." and [n for n, _ in _names(calls)] == [
        "get_weather",
        "get_time",
    ]
    assert _names(split_calls(ANSWERS[2], parallel=False)[1]) == [
        ("get_weather", {"city": "Zürich"})
    ]
    assert _names(split_calls(ANSWERS[3])[1]) == [("get_weather", {"city": "Zürich"})]
    assert split_calls(ANSWERS[4]) == (ANSWERS[4], [])  # not a call: the text it was
    content, calls = split_calls(ANSWERS[5])
    assert content == "<tool_call>not json" and len(calls) == 1
    assert split_calls(ANSWERS[6]) == (ANSWERS[6], [])
    assert split_calls(ANSWERS[7])[0] == "A.\n\nB."


LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
LLAMA_ANSWERS = [
    "Plain text, no call.",
    LLAMA_WEATHER,
    f"<|python_tag|>{LLAMA_WEATHER}; {TIME}",
    '{"not": "a call"}',
    f"{LLAMA_WEATHER} and then some words",
    "  <|python_ta is only the start of a word",
]


def test_a_whole_llama3_json_answer_is_calls_up_to_the_first_thing_that_is_none() -> None:
    assert split_llama3_json(LLAMA_ANSWERS[0]) == (LLAMA_ANSWERS[0], [])
    content, calls = split_llama3_json(LLAMA_ANSWERS[1])
    assert content is None and _names(calls) == [("get_weather", {"city": "Zürich"})]
    content, calls = split_llama3_json(LLAMA_ANSWERS[2])
    assert content is None and [n for n, _ in _names(calls)] == ["get_weather", "get_time"]
    assert len(split_llama3_json(LLAMA_ANSWERS[2], parallel=False)[1]) == 1
    for text in (LLAMA_ANSWERS[3], LLAMA_ANSWERS[5]):
        assert split_llama3_json(text) == (text, [])
    # No tag says a llama3_json answer is a call: an object with a name and no arguments is
    # content (vLLM's rule; a JSON answer about a person was a call to a tool "Alice"),
    # whole and streamed a character at a time.
    person = '{"name": "Alice", "age": 30}'
    assert split_llama3_json(person) == (person, [])
    reader = Llama3JsonCalls(True)
    pieces = [p for ch in person for p in reader.feed(ch)] + reader.finish()
    assert "".join(text for kind, text in pieces if kind == "content") == person
    assert not [p for p in pieces if p[0] == "call"]
    # Streamed, a call is out before what follows it is known: the rest is content.
    content, calls = split_llama3_json(LLAMA_ANSWERS[4])
    assert content == "and then some words" and len(calls) == 1


MISTRAL_ANSWERS = [
    "Plain text, no call.",
    f"[TOOL_CALLS][{WEATHER}, {TIME}]",
    f"Let me look.[TOOL_CALLS] [{WEATHER}]",
    "[TOOL_CALLS][not json",
    "a [TOOL_CA is not the tag",
    f"[TOOL_CALLS] [{WEATHER}][TOOL_CALLS] [{TIME}]",  # a tag and a list per call
    f'[TOOL_CALLS][{WEATHER}, {{"no": 1}}] after',  # the calls, then text
    # Tokenizer v11 and later: a tag per call, name[ARGS]{...}, maybe [CALL_ID]id.
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[ARGS]{}',
    '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Zürich"}',
    "[TOOL_CALLS]get weather",  # no name[ARGS]: text
]


def test_a_whole_mistral_answer_is_its_text_and_the_calls_after_the_tag() -> None:
    assert split_mistral(MISTRAL_ANSWERS[0]) == (MISTRAL_ANSWERS[0], [])
    content, calls = split_mistral(MISTRAL_ANSWERS[1])
    assert content is None and [n for n, _ in _names(calls)] == ["get_weather", "get_time"]
    # Mistral's templates take back only ids of 9 letters and digits.
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    content, calls = split_mistral(MISTRAL_ANSWERS[2])
    assert content == "Let me look." and _names(calls) == [("get_weather", {"city": "Zürich"})]
    assert len(split_mistral(MISTRAL_ANSWERS[1], parallel=False)[1]) == 1
    for text in MISTRAL_ANSWERS[3:5]:
        assert split_mistral(text) == (text, [])
    content, calls = split_mistral(MISTRAL_ANSWERS[5])
    assert content is None and [n for n, _ in _names(calls)] == ["get_weather", "get_time"]
    content, calls = split_mistral(MISTRAL_ANSWERS[6])
    assert content == '{"no": 1}] after' and len(calls) == 1
    content, calls = split_mistral(MISTRAL_ANSWERS[7])
    assert content == "Sure." and _names(calls) == [
        ("get_weather", {"city": "Zürich"}),
        ("get_time", {}),
    ]
    content, calls = split_mistral(MISTRAL_ANSWERS[8])
    assert content is None and _names(calls) == [("get_weather", {"city": "Zürich"})]
    assert calls[0]["id"] != "a1B2c3D4e"  # ids are the gateway's, as every format's
    assert split_mistral(MISTRAL_ANSWERS[9]) == (MISTRAL_ANSWERS[9], [])


CASES = (
    [(HermesCalls, a) for a in ANSWERS]
    + [(Llama3JsonCalls, a) for a in LLAMA_ANSWERS]
    + [(MistralCalls, a) for a in MISTRAL_ANSWERS]
)


def _folded(pieces: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The calls a client rebuilds from streamed pieces: each call's arguments appended."""
    calls: list[dict[str, Any]] = []
    for kind, value in pieces:
        if kind == "call":
            calls.append({**value, "function": dict(value["function"])})
        elif kind == "arguments":
            calls[-1]["function"]["arguments"] += value
    return calls


def _client_calls(chunks: list[Any]) -> list[tuple[int, str, Any]]:
    """The calls the openai client's user rebuilds from streamed deltas: by index, the
    name from the first delta, the arguments appended."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, [delta.function.name, ""])
            entry[1] += delta.function.arguments or ""
    return [(i, name, json.loads(args)) for i, (name, args) in sorted(calls.items())]


@pytest.mark.parametrize(("kind", "answer"), CASES)
def test_the_streamed_reading_equals_the_whole_one_however_the_text_is_cut(
    kind: type[ToolCallStream], answer: str
) -> None:
    rng = random.Random(answer)
    content, calls = kind().split(answer)
    for _ in range(50):
        stream = kind()
        pieces: list[tuple[str, Any]] = []
        at = 0
        while at < len(answer):
            step = rng.randint(1, 6)
            pieces += stream.feed(answer[at : at + step])
            at += step
        pieces += stream.finish()
        streamed = "".join(v for k, v in pieces if k == "content")
        assert _names(_folded(pieces)) == _names(calls)
        assert streamed == (content or "")  # less only the blanks around the calls


STREAMED_ARGUMENTS = '{"city": "Zürich", "days": [1, {"from": "}\\"{"}]}'


@pytest.mark.parametrize(
    ("kind", "answer"),
    [
        (HermesCalls, f'Sure.<tool_call>\n{{"name": "w", "arguments": {STREAMED_ARGUMENTS}}}\n'
                      "</tool_call>"),
        (Llama3JsonCalls, f'<|python_tag|>{{"name": "w", "parameters": {STREAMED_ARGUMENTS}}}'),
        (MistralCalls, f'[TOOL_CALLS][{{"name": "w", "arguments": {STREAMED_ARGUMENTS}}}]'),
        (MistralCalls, f"[TOOL_CALLS]w[ARGS]{STREAMED_ARGUMENTS}"),
        (ForcedCalls, f'[{{"name": "w", "parameters": {STREAMED_ARGUMENTS}}}]'),
    ],
)  # fmt: skip
def test_a_calls_arguments_stream_as_the_model_writes_them(
    kind: type[ToolCallStream], answer: str
) -> None:
    """OpenAI's way: the call opens (id, name, no arguments yet) once its arguments begin,
    then each piece of them goes out as it is written, the model's own text."""
    stream = kind()
    fed = [stream.feed(char) for char in answer]
    opened = next(i for i, pieces in enumerate(fed) if any(k == "call" for k, _ in pieces))
    assert answer[: opened + 1].endswith((": {", "[ARGS]{"))  # at its arguments' brace
    call = next(v for k, v in fed[opened] if k == "call")
    assert call["function"] == {"name": "w", "arguments": ""}
    streamed = [(i, v) for i, pieces in enumerate(fed) for k, v in pieces if k == "arguments"]
    assert "".join(v for _, v in streamed) == STREAMED_ARGUMENTS
    # Each character as it came (mistral's holds the "[" that may begin its tag).
    assert len(streamed) >= len(STREAMED_ARGUMENTS) - 1
    assert answer[: streamed[-1][0] + 1].endswith(STREAMED_ARGUMENTS)  # none held back
    assert not [p for p in stream.finish() if p[0] != "content"]


def test_without_parallel_calls_the_second_calls_arguments_go_nowhere() -> None:
    first = '{"name": "a", "arguments": {"x": 1}}'
    answer = f'[TOOL_CALLS][{first}, {{"name": "b", "arguments": {{"y": 2}}}}]'
    for kind, text in ((HermesCalls, f"<tool_call>{first}</tool_call><tool_call>{TIME}</tool_call>"),
                       (MistralCalls, answer)):  # fmt: skip
        stream = kind(parallel=False)
        pieces = [p for char in text for p in stream.feed(char)] + stream.finish()
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in _folded(pieces)] == [
            ("a", '{"x": 1}')
        ]
        assert stream.calls == 1 and not [v for k, v in pieces if k == "content"]


def test_a_call_cut_by_max_tokens_keeps_the_arguments_written() -> None:
    """As OpenAI's: the arguments written so far (no JSON), the reason ``length``."""
    cut = '<tool_call>{"name": "f", "arguments": {"a": [1, 2'
    content, calls = HermesCalls().split(cut)
    assert content is None and calls[0]["function"]["arguments"] == '{"a": [1, 2'
    # Cut before its arguments began, it was no call yet: the text it was.
    assert HermesCalls().split('<tool_call>{"name": "f", "argu') == (
        '<tool_call>{"name": "f", "argu',
        [],
    )


def test_what_follows_a_calls_arguments_is_no_part_of_them() -> None:
    """Keys after the arguments (Nemo writes an id), or an object left open: the
    arguments end at their own closing brace."""
    for kind, text in (
        (HermesCalls, '<tool_call>{"name": "f", "arguments": {"a": 1}, "x": 2</tool_call>'),
        (HermesCalls, '<tool_call>{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
        (MistralCalls, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abc'),
    ):
        _, (call,) = kind().split(text)
        assert call["function"]["arguments"] == '{"a": 1}', text


def test_text_after_a_list_of_calls_keeps_its_brackets() -> None:
    done = '[TOOL_CALLS][{"name": "f", "arguments": {}}]'
    assert MistralCalls().split(f"{done} [see note]")[0] == "[see note]"
    assert MistralCalls().split(f"{done}\n\n[1] Source: x")[0] == "[1] Source: x"
    assert len(MistralCalls().split(f"{done}[TOOL_CALLS] [{TIME}]")[1]) == 2  # a list again


def test_a_hermes_call_whose_closing_tag_is_left_out_ends_where_the_next_opens() -> None:
    text = f"<tool_call>{WEATHER}\n<tool_call>\n{TIME}\n</tool_call>"
    content, calls = HermesCalls().split(text)
    assert content is None and [n for n, _ in _names(calls)] == ["get_weather", "get_time"]


def test_the_format_comes_from_the_setting_or_the_chat_template() -> None:
    assert tool_format("auto", "{{ '<tool_call>' }}") == "hermes"
    assert tool_format("auto", "{{ messages }}") is None
    assert tool_format("hermes", "") == "hermes"
    assert tool_format("none", "<tool_call>") is None
    assert tool_format("auto", "{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_format("llama3_json", "") == "llama3_json"
    assert tool_format("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"


class HermesByteTokenizer(ByteTokenizer):
    """Bytes as tokens, with a chat template that renders tools as Qwen's does."""

    CHAT_TEMPLATE = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
        'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
        + ByteTokenizer.CHAT_TEMPLATE
    )


async def test_the_openai_client_gets_tool_calls_whole_and_streamed(
    nats_config: NatsConfig,
) -> None:
    """The format found in the model's chat template (``auto``), the tools rendered by it."""
    answer = ANSWERS[2]
    async with (
        serve(gateway_config(nats_config, short__max_seq_len=2048), HermesByteTokenizer()) as gw,
        running_worker(nats_config, "short", behaviour=answers(answer)) as worker,
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "tools": TOOLS,
                               "messages": [{"role": "user", "content": "Weather and time?"}]}  # fmt: skip
        whole = await client.chat.completions.create(**ask)
        stream = await client.chat.completions.create(**ask, stream=True)
        chunks = [c async for c in stream]
        single = await client.chat.completions.create(**ask, parallel_tool_calls=False)
        declined = await client.chat.completions.create(**ask, tool_choice="none")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Zürich"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    # Streamed: content as it comes, each call opened by a delta naming it (id, index),
    # its arguments in the deltas after it.
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "Let me look."
    assert [(d.index, d.function.name) for d in deltas if d.id] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]
    assert _client_calls(chunks) == [(0, "get_weather", {"city": "Zürich"}), (1, "get_time", {})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len(single.choices[0].message.tool_calls or []) == 1
    # The template rendered the tools, unless declined: then the answer is text as it came.
    prompts = [bytes(t for t in j.request.prompt_token_ids if t < 256) for j in worker.jobs]
    assert all(b'<tools>{"type": "function", "function": {"name": "get_weather"' in p
               for p in prompts[:3])  # fmt: skip
    assert b"<tools>" not in prompts[3]
    assert declined.choices[0].message.content == answer
    assert declined.choices[0].message.tool_calls is None
    assert declined.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("cut", [2, 5])
async def test_logprobs_come_with_tool_calls_every_token_once_in_order(
    nats_config: NatsConfig, cut: int
) -> None:
    """logprobs with tools was a 400 (LangChain's ChatOpenAI(logprobs=True).bind_tools
    failed on every call); OpenAI and vLLM give the generated tokens' logprobs whatever
    their text became. Streamed, a delivery's ride on its first chunk, or on an empty
    delta of their own when the reader held all its text back (a call's tag)."""
    answer = ANSWERS[2]
    async with (
        serve(gateway_config(nats_config, short__max_seq_len=2048), HermesByteTokenizer()) as gw,
        running_worker(nats_config, "short", behaviour=answers(answer, cut=cut)),
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "tools": TOOLS,
                               "logprobs": True, "top_logprobs": 1,
                               "messages": [{"role": "user", "content": "Weather and time?"}]}  # fmt: skip
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    want = [-i / 100 for i in range(len(answer.encode()))]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls or []) == 2
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(want)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [t.logprob for t in streamed] == pytest.approx(want)
    assert all(len(t.top_logprobs) == 1 for t in streamed)
    assert _client_calls(chunks) == [(0, "get_weather", {"city": "Zürich"}), (1, "get_time", {})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_tools_are_refused_clearly_where_they_cannot_be_served(
    nats_config: NatsConfig,
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    named = {"type": "function", "function": {"name": "get_date"}}  # not among the tools
    async with (
        serve(gateway_config(nats_config, tool_call_parser="hermes")) as gw,
        serve(gateway_config(nats_config)) as plain,  # a model with no tool format
        httpx.AsyncClient(timeout=10) as http,
    ):
        url = f"{gw.url}/v1/chat/completions"
        replies = {
            "tool_choice": await http.post(url, json={**chat, "tool_choice": "anything"}),
            "tool_choice named": await http.post(url, json={**chat, "tool_choice": named}),
            "tools shape": await http.post(url, json={**chat, "tools": [{"type": "custom"}]}),
            "no format": await http.post(f"{plain.url}/v1/chat/completions", json=chat),
        }
    params = {name: r.json()["error"]["param"] for name, r in replies.items()}
    assert all(r.status_code == 400 for r in replies.values()), params
    assert params == {"tool_choice": "tool_choice", "tool_choice named": "tool_choice",
                      "tools shape": "tools",
                      "no format": "tools"}  # fmt: skip
    assert "not among the tools" in replies["tool_choice named"].json()["error"]["message"]


class Llama31ByteTokenizer(ByteTokenizer):
    """Bytes as tokens, with a template that names Llama 3.1's python tag."""

    CHAT_TEMPLATE = (
        "{% if tools %}Environment: ipython<|python_tag|>{% for t in tools %}"
        "{{ t | tojson }}{% endfor %}\n{% endif %}" + ByteTokenizer.CHAT_TEMPLATE
    )


async def test_a_llama31_answer_that_is_a_call_comes_back_as_one(nats_config: NatsConfig) -> None:
    async with (
        serve(gateway_config(nats_config, short__max_seq_len=2048), Llama31ByteTokenizer()) as gw,
        running_worker(nats_config, "short", behaviour=answers(LLAMA_ANSWERS[2])),
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "tools": TOOLS,
                               "messages": [{"role": "user", "content": "Weather and time?"}]}  # fmt: skip
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [c.function.name for c in message.tool_calls or []] == ["get_weather", "get_time"]
    assert json.loads((message.tool_calls or [])[0].function.arguments) == {"city": "Zürich"}
    assert _client_calls(chunks) == [(0, "get_weather", {"city": "Zürich"}), (1, "get_time", {})]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_a_guided_answer_with_tools_offered_is_content_not_a_call(
    nats_config: NatsConfig,
) -> None:
    """Tools offered (``auto``) and the answer guided by the client's JSON schema (the
    Agents SDK's structured output): the schema's object, ``{"name": "Alice", ...}``, was
    read as a llama3_json call to a tool named Alice, and the client got no content."""
    person = '{"name": "Alice", "age": 30}'
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}}}  # fmt: skip
    async with (
        serve(gateway_config(nats_config, short__max_seq_len=2048), Llama31ByteTokenizer()) as gw,
        running_worker(nats_config, "short", behaviour=answers(person)),
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        reply = await client.chat.completions.create(
            model=MODEL, max_tokens=200, tools=TOOLS,
            messages=[{"role": "user", "content": "Who?"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": schema}},
        )  # fmt: skip
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop" and not message.tool_calls
    assert json.loads(message.content or "") == {"name": "Alice", "age": 30}


class SpecialTagByteTokenizer(HermesByteTokenizer):
    """A Hermes model whose call tags are special tokens (dropped from text by default)."""

    OPEN_ID, CLOSE_ID = 300, 301
    _SPECIALS: ClassVar[dict[int, str]] = {
        **ByteTokenizer._SPECIALS,
        OPEN_ID: "<tool_call>",
        CLOSE_ID: "</tool_call>",
    }

    def __init__(self) -> None:
        super().__init__()
        self.all_special_ids = sorted(self._SPECIALS)


async def test_call_tags_that_are_special_tokens_are_kept_in_the_text_to_be_read(
    nats_config: NatsConfig,
) -> None:
    """The worker drops special tokens from its text unless asked: tags that are special
    tokens vanished, and the call came back as content (vLLM's hermes parser asks too)."""
    async with (
        serve(
            gateway_config(nats_config, short__max_seq_len=2048), SpecialTagByteTokenizer()
        ) as gw,
        running_worker(nats_config, "short", behaviour=answers(ANSWERS[1])) as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        chat = {"model": MODEL, "max_tokens": 200, "messages": [{"role": "user", "content": "?"}]}
        called = (await http.post("/v1/chat/completions", json={**chat, "tools": TOOLS})).json()
        await http.post("/v1/chat/completions", json=chat)
    assert [j.request.params.skip_special_tokens for j in worker.jobs] == [False, None]
    assert called["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_an_answer_cut_by_max_tokens_stays_length_with_the_calls_it_made() -> None:
    """OpenAI's reason: its last call may be missing (clients raise on "length" rather
    than run half the calls); vLLM said "tool_calls"."""
    from gateway.responses import Shaper
    from gateway.streams import Delivery

    cut = ANSWERS[1] + '\n<tool_call>\n{"name": "get_ti'
    for reason, expected in (("length", "length"), ("stop", "tool_calls")):
        shaper = Shaper("chat", "id", MODEL, 0, bytes, tool_calls=HermesCalls())
        body = shaper.body(cut, reason, {})
        assert body["choices"][0]["finish_reason"] == expected
        streamed = Shaper("chat", "id", MODEL, 0, bytes, tool_calls=HermesCalls())
        events = streamed.delta_event(Delivery(text=cut, finish_reason=reason)).decode()
        last = json.loads(events.strip().split("\n\n")[-1].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == expected


class MistralByteTokenizer(ByteTokenizer):
    """Bytes as tokens; [TOOL_CALLS] a special token its template names, as Mistral's v3."""

    TAG_ID = 300
    _SPECIALS: ClassVar[dict[int, str]] = {**ByteTokenizer._SPECIALS, TAG_ID: "[TOOL_CALLS]"}
    CHAT_TEMPLATE = (
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "{# an assistant's calls: [TOOL_CALLS][...] #}" + ByteTokenizer.CHAT_TEMPLATE
    )

    def __init__(self) -> None:
        super().__init__()
        self.all_special_ids = sorted(self._SPECIALS)


async def test_a_mistral_answer_keeps_its_special_tag_and_gets_nine_character_ids(
    nats_config: NatsConfig,
) -> None:
    async with (
        serve(gateway_config(nats_config, short__max_seq_len=2048), MistralByteTokenizer()) as gw,
        running_worker(nats_config, "short", behaviour=answers(MISTRAL_ANSWERS[2])) as worker,
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "tools": TOOLS,
                               "messages": [{"role": "user", "content": "Weather?"}]}  # fmt: skip
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    message = whole.choices[0].message
    assert message.content == "Let me look." and whole.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls or []
    assert call.function.name == "get_weather" and len(call.id) == 9 and call.id.isalnum()
    assert all(j.request.params.skip_special_tokens is False for j in worker.jobs)
    assert _client_calls(chunks) == [(0, "get_weather", {"city": "Zürich"})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me look."


# Fragments a model's tool-calling answer is made of, valid or broken, for the property
# below: any sequence of them, cut anywhere, reads the same whole and streamed.
FRAGMENTS = [
    "Sure. ", " ", "\n", "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL_",
    "<|python_tag|>", "{", "}", "[", "]", ",", ";", '"', "\\", ": ", '"name"', '"arguments"',
    '"parameters"', '"f"', '"g\\"x"', '{"a": 1}', '"}{]["', "not json", WEATHER, TIME,
    LLAMA_WEATHER, '{"name": "f", "arguments": ', '[{"name": "g", "parameters": {', "}}",
    "get_x", "[ARGS]", "[CALL_ID]", "a1",
]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([HermesCalls, Llama3JsonCalls, MistralCalls, ForcedCalls]),
    st.booleans(),
    st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    st.lists(st.integers(1, 9), min_size=1, max_size=20),
)
def test_any_answer_reads_the_same_whole_and_streamed_and_loses_no_call_text(
    kind: type[ToolCallStream], parallel: bool, fragments: list[str], cuts: list[int]
) -> None:
    answer = "".join(fragments)
    content, calls = kind(parallel).split(answer)
    stream = kind(parallel)
    pieces: list[tuple[str, Any]] = []
    at = step = 0
    while at < len(answer):
        size = cuts[step % len(cuts)]
        pieces += stream.feed(answer[at : at + size])
        at, step = at + size, step + 1
    pieces += stream.finish()
    folded = _folded(pieces)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in folded] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert "".join(v for k, v in pieces if k == "content") == (content or "")
    assert len(calls) <= 1 or parallel
    if not calls:  # no call: the answer comes back as it was written
        assert content == answer
