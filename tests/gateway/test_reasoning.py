"""Reasoning (<think>...</think>) returned apart from content: the reader whole and as it
streams, and through the gateway to the official openai client, tool calls included."""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

import openai
import pytest

from common.config import NatsConfig
from common.protocol import Chunk
from common.tokenizer import ByteTokenizer
from gateway.reasoning import ReasoningSplit, reads_reasoning, starts_thinking
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import Behaviour, Job, answers, running_worker

# (the answer begins inside its thinking, the answer, its reasoning, its content)
CASES = [
    (False, "Plain answer.", None, "Plain answer."),
    (False, "<think>\n2 + 2 is 4.\n</think>\n\nIt is 4.", "2 + 2 is 4.", "It is 4."),
    (True, "\nThe user asks.\n\nSo: 4.\n</think>\n\n4", "The user asks.\n\nSo: 4.", "4"),
    (True, "cut by max_tokens while thinking", "cut by max_tokens while thinking", ""),
    (False, "  <thi is not the tag", None, "  <thi is not the tag"),
    (False, "<think></think>Answer at once.", None, "Answer at once."),
    (False, "   ", None, "   "),
    # A model that opens its thinking though the template did: the tag is dropped.
    (True, " <think>\nLet me see.\n</think>\n\n4", "Let me see.", "4"),
    (True, "\n\n", None, ""),
    (False, "\n\n<think>x</think>y", "x", "y"),
]


@pytest.mark.parametrize(("thinking", "answer", "reasoning", "content"), CASES)
def test_an_answer_reads_the_same_whole_and_however_it_streams(
    thinking: bool, answer: str, reasoning: str | None, content: str
) -> None:
    assert ReasoningSplit(thinking).split(answer) == (reasoning, content)
    rng = random.Random(answer)
    for _ in range(100):
        split, pieces, at = ReasoningSplit(thinking), [], 0
        while at < len(answer):
            step = rng.randint(1, 5)
            pieces += split.feed(answer[at : at + step])
            at += step
        pieces += split.finish()
        assert ("".join(t for k, t in pieces if k == "reasoning") or None) == reasoning
        assert "".join(t for k, t in pieces if k == "content") == content


def test_thinking_streams_before_the_block_closes_and_can_be_left_out() -> None:
    split = ReasoningSplit(thinking=True)
    assert split.feed("Let me") == [("reasoning", "Let me")]
    assert split.feed(" think.</thi") == [("reasoning", " think.")]  # the tag's start held
    assert split.feed("nk>\nDone.") == [("content", "Done.")]
    dropped = ReasoningSplit(thinking=True, keep=False)
    assert dropped.split("secret plans</think>Hi") == (None, "Hi")


def test_the_prompt_and_the_template_decide_what_is_read() -> None:
    assert starts_thinking("auto", "<|im_start|>assistant\n<think>\n")
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's enable_thinking false
    assert not starts_thinking("auto", off) and not starts_thinking("qwen3", off)
    assert not starts_thinking("auto", "<|im_start|>assistant\n")
    # deepseek_r1: always inside (R1 sometimes skips the opening tag left to it).
    assert starts_thinking("deepseek_r1", "<|Assistant|>")
    assert reads_reasoning("auto", "{{ content.split('</think>')[-1] }}")
    assert not reads_reasoning("auto", "{{ messages }}")
    assert reads_reasoning("qwen3", "") and not reads_reasoning("none", "</think>")


class ThinkingByteTokenizer(ByteTokenizer):
    """Bytes as tokens; a template that opens the thinking for the model (as DeepSeek-R1's
    does) and renders tools as Qwen's."""

    CHAT_TEMPLATE = (
        "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
        "{# history: content.split('</think>')[-1] #}"
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}"
    )


WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
ANSWER = (
    f"\nThe user wants the weather.\n</think>\n\nLooking.\n<tool_call>\n{WEATHER}\n</tool_call>"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


async def test_the_openai_client_gets_reasoning_content_and_the_calls_after_it(
    nats_config: NatsConfig,
) -> None:
    config = gateway_config(nats_config, short__max_seq_len=2048, tool_call_parser="hermes")
    async with (
        serve(config, ThinkingByteTokenizer()) as gw,
        running_worker(nats_config, "short", behaviour=answers(ANSWER, cut=3)) as worker,
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 300, "tools": TOOLS,
                               "messages": [{"role": "user", "content": "Weather in Oslo?"}]}  # fmt: skip
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
        hidden = await client.chat.completions.create(
            **ask, extra_body={"include_reasoning": False}
        )
        # The openai client sends reasoning_effort to reasoning models: accepted, and passed
        # to the template (gpt-oss's reads it).
        effort = await client.chat.completions.create(**ask, reasoning_effort="low")
    message = whole.choices[0].message
    assert message.model_extra is not None
    # Under both names: vLLM's clients read reasoning now, DeepSeek's reasoning_content.
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    assert message.model_extra["reasoning"] == "The user wants the weather."
    assert message.content == "Looking." and whole.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert thought == "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    said = "".join(d.content or "" for d in deltas)
    assert thought == "The user wants the weather." and said == "Looking."
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_content:])
    assert any(d.tool_calls for d in deltas)
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
    assert hidden.choices[0].message.content == "Looking."
    assert effort.choices[0].message.content == "Looking." and len(worker.jobs) == 4


class SpecialThinkTokenizer(ThinkingByteTokenizer):
    """As DeepSeek-R1's and Qwen3's vocabularies have it: </think> is one (special) token."""

    CLOSE_ID = 300
    _SPECIALS: ClassVar[dict[int, str]] = {**ByteTokenizer._SPECIALS, CLOSE_ID: "</think>"}

    def __init__(self) -> None:
        super().__init__()
        self.all_special_ids = sorted(self._SPECIALS)


async def _ask_for_json(
    nats_config: NatsConfig, tokenizer: ByteTokenizer, behaviour: Behaviour
) -> tuple[Job, Any]:
    """One chat request with ``response_format: json_object`` through the openai client:
    the job the worker got, and the reply."""
    config = gateway_config(nats_config, short__max_seq_len=2048)
    async with (
        serve(config, tokenizer) as gw,
        running_worker(nats_config, "short", behaviour=behaviour) as worker,
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        reply = await client.chat.completions.create(
            model=MODEL, max_tokens=100, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "JSON please"}],
        )  # fmt: skip
    (job,) = worker.jobs
    return job, reply


async def test_a_guided_answer_of_a_thinking_model_is_shaped_after_its_thinking(
    nats_config: NatsConfig,
) -> None:
    """Guided from its first token, a model that starts inside its thinking could not
    think; the grammar holds after its </think> instead (the worker's engine keeps it so:
    tests/engine/test_guided.py), and the answer's thinking comes back apart."""
    thought, said = b"JSON it is.", b'{"a": 1}'

    async def thinks_then_answers(job: Job) -> None:
        ids = [*thought, SpecialThinkTokenizer.CLOSE_ID, *said]
        text = thought.decode() + "</think>" + said.decode()
        chunk = Chunk(id=job.request.id, seq=0, token_ids=ids, text=text,
                      worker=job.worker.worker_id, finish_reason="stop",
                      usage=job.usage(len(ids)))  # fmt: skip
        await job.worker.nc.publish(job.request.reply, chunk.to_bytes())

    job, reply = await _ask_for_json(nats_config, SpecialThinkTokenizer(), thinks_then_answers)
    assert job.request.params.guided_kind == "json_schema"
    assert job.request.params.guided_after_token == SpecialThinkTokenizer.CLOSE_ID
    assert job.request.params.skip_special_tokens is False  # the tag reaches the text
    message = reply.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "JSON it is."
    assert json.loads(message.content or "") == {"a": 1}


class SpecialThinkAskedTokenizer(SpecialThinkTokenizer):
    """A template that leaves the thinking to the model (Qwen3's with thinking off)."""

    CHAT_TEMPLATE = SpecialThinkTokenizer.CHAT_TEMPLATE.replace("<think>\n", "")


async def test_a_guided_answer_that_cannot_think_keeps_special_tokens_out(
    nats_config: NatsConfig,
) -> None:
    """Guided from its first token, none of the answer is thinking: its text needs no
    </think>, so special tokens stay out of it as for any request (they were kept for every
    chat request once </think> was a special token)."""
    tokenizer = SpecialThinkAskedTokenizer()
    job, reply = await _ask_for_json(nats_config, tokenizer, answers('{"a": 1}'))
    assert job.request.params.guided_after_token is None
    assert job.request.params.skip_special_tokens is not False
    assert json.loads(reply.choices[0].message.content or "") == {"a": 1}


@pytest.mark.parametrize(("usage", "continuous"), [(False, False), (True, False), (True, True)])
def test_a_reasoning_chunk_is_a_chat_chunk_with_its_usage_as_asked(
    usage: bool, continuous: bool
) -> None:
    """Built from a kept prefix and suffix (a thinking model streams mostly thinking): the
    same JSON as a chunk built whole."""
    from gateway.responses import Shaper
    from gateway.streams import Delivery

    shaper = Shaper("chat", "chatcmpl-1", MODEL, 7, bytes, include_usage=usage,
                    continuous_usage=continuous, prompt_tokens=3,
                    reasoning=ReasoningSplit(thinking=True))  # fmt: skip
    event = shaper.delta_event(Delivery(text='a "quoted" thought', completion_tokens=4))
    chunk = json.loads(event.decode().removeprefix("data: "))
    want: dict[str, Any] = {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": MODEL,
        "choices": [{"index": 0, "delta": {"reasoning": 'a "quoted" thought',
                                            "reasoning_content": 'a "quoted" thought'},
                     "logprobs": None, "finish_reason": None}],
    }  # fmt: skip
    if usage:
        want["usage"] = (
            {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7} if continuous else None
        )
    assert chunk == want
