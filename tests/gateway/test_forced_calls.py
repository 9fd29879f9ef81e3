"""Forced tool calls (tool_choice "required" or named): the JSON schema the gateway asks the
engine to keep, and the calls read back from the answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.errors import InvalidRequestError
from common.guided import problem
from common.models import demo_model_path
from gateway.forced_calls import ForcedCalls
from gateway.openai_api import ChatCompletionRequest, parse_body
from workers.engine import LLM, SamplingParams

PLACE = {"type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}},
         "required": ["city"], "additionalProperties": False}  # fmt: skip


def tool(name: str, place: dict[str, Any] = PLACE) -> dict[str, Any]:
    """A tool as pydantic writes one with a nested model: "#/$defs/Place"."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"],
        "additionalProperties": False, "$defs": {"Place": place}}}}  # fmt: skip


def body(tools: list[dict[str, Any]], tool_choice: Any, **more: Any) -> ChatCompletionRequest:
    raw = {"messages": [{"role": "user", "content": "go"}], "tools": tools,
           "tool_choice": tool_choice, **more}  # fmt: skip
    parsed = parse_body(ChatCompletionRequest, json.dumps(raw).encode())
    parsed.check_fields()
    return parsed


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "b"}}])
def test_tools_pointing_into_their_own_defs_compile_and_guide_to_valid_calls(choice: Any) -> None:
    request = body([tool("a"), tool("b")], choice, parallel_tool_calls=False)
    spec = request.guided()
    assert spec is not None and problem(spec.kind, spec.spec) is None
    llm = LLM(str(demo_model_path()), device="cpu")
    for seed in range(3):
        out = llm.generate(["call:"], SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                                                     guided=spec))[0]  # fmt: skip
        assert out.finish_reason == "stop", out.text
        reader = ForcedCalls(False, function=request.forced_function())
        content, calls = reader.split(out.text)
        assert content is None and len(calls) == 1
        assert calls[0]["function"]["name"] in ("a", "b")
        assert json.loads(calls[0]["function"]["arguments"])["to"]["city"] in ("Rome", "Oslo")


def test_two_tools_defining_one_name_differently_are_a_400() -> None:
    other = {**PLACE, "properties": {"city": {"enum": ["Paris"]}}}
    with pytest.raises(InvalidRequestError, match="twice, differently") as caught:
        body([tool("a"), tool("b", other)], "required").guided()
    assert caught.value.param == "tool_choice"
    assert body([tool("a"), tool("b")], "required").guided() is not None  # same: shared


def test_a_named_calls_arguments_stream_as_written_and_equal_the_whole_reading() -> None:
    text = '{"to": {"city": "Rome"}}'
    for cut in (1, 3, 7):
        reader = ForcedCalls(True, function="trip")
        pieces = [p for i in range(0, len(text), cut) for p in reader.feed(text[i : i + cut])]
        pieces += reader.finish()
        assert pieces[0][0] == "call" and pieces[0][1]["function"]["name"] == "trip"
        assert all(kind == "arguments" for kind, _ in pieces[1:])
        streamed = pieces[0][1]["function"]["arguments"] + "".join(v for _, v in pieces[1:])
        _, whole = ForcedCalls(True, function="trip").split(text)
        assert streamed == whole[0]["function"]["arguments"] == text
    # Cut by max_tokens: the call keeps what was written (its reason says length).
    assert (
        ForcedCalls(True, function="trip").split('{"to": {"ci')[1][0]["function"]["arguments"]
        == '{"to": {"ci'
    )
    # "required"'s list cut before a call's arguments began: text; after, a call with the
    # arguments written.
    assert ForcedCalls(True).split('[{"name": "trip", "para') == ('[{"name": "trip", "para', [])
    _, (call,) = ForcedCalls(True).split('[{"name": "trip", "parameters": {"to')
    assert call["function"] == {"name": "trip", "arguments": '{"to'}
