"""Guided decoding through the whole stack with the official openai client: OpenAI's
``response_format``, vLLM's ``guided_*`` and ``structured_outputs``, and forced tool
calls, each the engine's own guided output on the same prompt and seed; bad specs are 400s
naming the parameter."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from common.guided import GuidedSpec
from common.tokenizer import BaseTokenizer
from tests.e2e.stack import Stack
from tests.e2e.tiny_model import joined
from workers.engine.llm import LLM
from workers.engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me a record."}]
PROMPT = "A record:"
SEED, MAX_TOKENS = 77, 60
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def chat_ids(tokenizer: BaseTokenizer, tools: list[dict[str, Any]] | None = None) -> list[int]:
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(rendered, add_special_tokens=False)


def offline(llm: LLM, ids: list[int], kind: str, spec: Any) -> str:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED,
                            guided=GuidedSpec(kind, text))  # fmt: skip
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.finish_reason == "stop", out.text  # the reference completes its match
    return out.text


@pytest.fixture
def client(real_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_stack.base_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_is_the_engines_guided_output(
    real_stack: Stack, client: openai.OpenAI, offline_llm: LLM, tokenizer: BaseTokenizer,
    stream: bool,
) -> None:  # fmt: skip
    expected = offline(offline_llm, chat_ids(tokenizer), "json_schema", SCHEMA)
    jsonschema.validate(json.loads(expected), SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA,
                                                  "strict": True}}  # fmt: skip
    result: Any = client.chat.completions.create(
        model=real_stack.model, messages=MESSAGES, response_format=fmt,  # type: ignore[arg-type]
        seed=SEED, temperature=1.0, max_tokens=MAX_TOKENS, stream=stream,
    )  # fmt: skip
    text = joined(list(result)) if stream else result.choices[0].message.content
    assert text == expected


def test_vllm_guided_parameters_and_structured_outputs_on_completions(
    real_stack: Stack, client: openai.OpenAI, offline_llm: LLM, tokenizer: BaseTokenizer
) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    cases: list[tuple[dict[str, Any], str, Any]] = [
        ({"guided_choice": ["alpha", "beta", "gamma ray"]}, "choice",
         ["alpha", "beta", "gamma ray"]),
        ({"guided_regex": r"[0-9]{2}-[a-f]{3}"}, "regex", r"[0-9]{2}-[a-f]{3}"),
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"structured_outputs": {"grammar": 'root ::= "x=" [0-9] [0-9]?'}}, "grammar",
         'root ::= "x=" [0-9] [0-9]?'),
        ({"structured_outputs": {"json_object": True}}, "json_schema", '{"type": "object"}'),
    ]  # fmt: skip
    for extra, kind, spec in cases:
        expected = offline(offline_llm, ids, kind, spec)
        for stream in (False, True):
            result: Any = client.completions.create(
                model=real_stack.model, prompt=PROMPT, seed=SEED, temperature=1.0,
                max_tokens=MAX_TOKENS, stream=stream, extra_body=extra,
            )  # fmt: skip
            text = joined(list(result)) if stream else result.choices[0].text
            assert text == expected, (extra, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_named_and_required_come_back_as_tool_calls(
    real_stack: Stack, client: openai.OpenAI, tokenizer: BaseTokenizer, stream: bool
) -> None:
    def ask(tool_choice: Any) -> tuple[str | None, list[tuple[str, Any]], str | None]:
        result: Any = client.chat.completions.create(
            model=real_stack.model, messages=MESSAGES, tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice=tool_choice, seed=SEED, max_tokens=MAX_TOKENS, stream=stream,
        )  # fmt: skip
        if not stream:
            message = result.choices[0].message
            calls = [(c.function.name, json.loads(c.function.arguments))
                     for c in message.tool_calls or []]  # fmt: skip
            return message.content, calls, result.choices[0].finish_reason
        chunks = list(result)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        # As clients read them: a call opens with its id and name, arguments append.
        opened: dict[int, list[str]] = {}
        pieces: dict[int, list[str]] = {}
        for t in [t for d in deltas for t in d.tool_calls or []]:
            if t.id is not None:
                assert t.id.startswith("call_") and t.function and t.function.name
                opened[t.index] = [t.function.name]
            assert t.function is not None and t.index in opened
            pieces.setdefault(t.index, []).append(t.function.arguments or "")
        streamed_pieces.append(max(len(p) for p in pieces.values()))
        calls = [(opened[i][0], json.loads("".join(pieces[i]))) for i in sorted(opened)]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return joined(chunks) or None, calls, finish

    streamed_pieces: list[int] = []
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = ask(named)
    assert content is None and finish == "stop"  # OpenAI's reason for a named call
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    assert calls[0][1] in ({"city": "Paris"}, {"city": "Oslo"})
    content, calls, finish = ask("required")
    assert content is None and finish == "tool_calls" and calls
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        if name == "get_weather":
            assert arguments in ({"city": "Paris"}, {"city": "Oslo"})
    if stream:  # every call's arguments flowed in pieces, required's too
        assert streamed_pieces[0] > 1 and streamed_pieces[1] > 1


def test_specs_that_cannot_guide_are_400s_naming_the_parameter(
    real_stack: Stack, client: openai.OpenAI
) -> None:
    bad: list[tuple[dict[str, Any], str, str]] = [
        ({"guided_regex": "("}, "guided_regex", "unclosed group"),
        ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json", "nowhere"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "not several"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"structured_outputs": {"grammar": "root ::= ((("}}, "structured_outputs", "grammar"),
    ]
    for extra, param, message in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=real_stack.model, prompt=PROMPT, max_tokens=4,
                                      extra_body=extra)  # fmt: skip
        error = caught.value.body
        assert isinstance(error, dict) and error.get("param") == param, (extra, error)
        assert message in error["message"], (extra, error)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model=real_stack.model, messages=MESSAGES, tools=[CLOCK],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip


def test_vllm_switches_that_change_nothing_and_a_schema_left_out_are_accepted(
    real_stack: Stack, client: openai.OpenAI
) -> None:
    # vLLM's switches that change nothing here are accepted, as is a schema left out.
    result2: Any = client.completions.create(
        model=real_stack.model, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=SEED,
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True,
                                           "disable_fallback": True}},
    )  # fmt: skip
    assert isinstance(json.loads(result2.choices[0].text), dict)
    result3: Any = client.chat.completions.create(
        model=real_stack.model, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=SEED,
        response_format={"type": "json_schema", "json_schema": {"name": "any"}},  # type: ignore[typeddict-item]
    )  # fmt: skip
    json.loads(result3.choices[0].message.content)  # any JSON value
