"""The official openai client through the gateway gets exactly the engine's offline output.

Every combination of client (sync, async), endpoint (completions, chat), delivery
(streamed, whole) and sampling (greedy, seeded) goes through the real stack — gateway,
JetStream, a worker running the real engine on the tiny checkpoint, core NATS back — and
its text, finish reason and usage must equal ``LLM.generate`` on the same checkpoint with
the same prompt token ids (chat: the folder's chat template) and parameters.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from common.tokenizer import BaseTokenizer
from tests.e2e.stack import Stack
from tests.e2e.tiny_model import joined
from workers.engine.llm import LLM
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there, how are you today?"},
]
MAX_TOKENS = 24
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1234},
}


def prompt_ids(tokenizer: BaseTokenizer, kind: str) -> list[int]:
    """The token ids the gateway sends: BOS + text, or the chat-templated conversation."""
    if kind == "completion":
        return tokenizer.encode(PROMPT, add_special_tokens=True)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def reference(llm: LLM, ids: list[int], sampling: str) -> RequestOutput:
    params = SamplingParams(max_tokens=MAX_TOKENS, **SAMPLING[sampling])
    return llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]


def request_kwargs(kind: str, stream: bool, sampling: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_tokens": MAX_TOKENS, **SAMPLING[sampling]}
    if kind == "completion":
        kwargs["prompt"] = PROMPT
    else:
        kwargs["messages"] = MESSAGES
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    return kwargs


def text_of(result: Any, kind: str, stream: bool) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) of a whole result or a list of streamed chunks."""
    if stream:
        finishes = [c.choices[0].finish_reason for c in result if c.choices]
        return joined(result), [f for f in finishes if f][-1], result[-1].usage
    choice = result.choices[0]
    text = choice.text if kind == "completion" else choice.message.content
    return text, choice.finish_reason, result.usage


def check(result: Any, kind: str, stream: bool, expected: RequestOutput, n_prompt: int) -> None:
    text, finish, usage = text_of(result, kind, stream)
    assert text == expected.text
    assert finish == expected.finish_reason
    assert usage is not None
    assert usage.prompt_tokens == n_prompt
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == n_prompt + len(expected.token_ids)


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_sync_client_text_and_usage_equal_offline_engine(
    real_stack: Stack,
    offline_llm: LLM,
    tokenizer: BaseTokenizer,
    kind: str,
    stream: bool,
    sampling: str,
) -> None:
    ids = prompt_ids(tokenizer, kind)
    expected = reference(offline_llm, ids, sampling)
    client = openai.OpenAI(base_url=real_stack.base_url, api_key="unused", max_retries=0)
    api = client.completions if kind == "completion" else client.chat.completions
    result = api.create(model=real_stack.model, **request_kwargs(kind, stream, sampling))
    if stream:
        result = list(result)
    check(result, kind, stream, expected, len(ids))


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_async_client_text_and_usage_equal_offline_engine(
    real_stack: Stack,
    offline_llm: LLM,
    tokenizer: BaseTokenizer,
    kind: str,
    stream: bool,
    sampling: str,
) -> None:
    ids = prompt_ids(tokenizer, kind)
    expected = reference(offline_llm, ids, sampling)
    client = openai.AsyncOpenAI(base_url=real_stack.base_url, api_key="unused", max_retries=0)
    api = client.completions if kind == "completion" else client.chat.completions
    result = await api.create(model=real_stack.model, **request_kwargs(kind, stream, sampling))
    if stream:
        result = [chunk async for chunk in result]
    check(result, kind, stream, expected, len(ids))


def test_reference_outputs_are_not_trivial(offline_llm: LLM, tokenizer: BaseTokenizer) -> None:
    """Guard against a vacuous match: the references are real, distinct generations."""
    outs = {
        (kind, sampling): reference(offline_llm, prompt_ids(tokenizer, kind), sampling)
        for kind in ("completion", "chat")
        for sampling in SAMPLING
    }
    assert all(len(o.token_ids) >= 4 and o.text for o in outs.values())
    assert len({o.text for o in outs.values()}) == len(outs)


def test_logit_bias_reaches_the_engine_and_a_foreign_token_id_is_a_400(
    real_stack: Stack, offline_llm: LLM, tokenizer: BaseTokenizer
) -> None:
    """The openai client's ``logit_bias`` (string keys) steers the served greedy output
    exactly as the engine's own ``logit_bias`` does; an id the model lacks is a 400."""
    ids = prompt_ids(tokenizer, "completion")
    plain = reference(offline_llm, ids, "greedy")
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[2]: -100.0, 5: 3.0}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=bias)
    expected = offline_llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert expected.token_ids != plain.token_ids
    client = openai.OpenAI(base_url=real_stack.base_url, api_key="unused", max_retries=0)
    wire_bias = {str(t): b for t, b in bias.items()}
    for stream in (False, True):
        result: Any = client.completions.create(
            model=real_stack.model, logit_bias=wire_bias,  # type: ignore[arg-type]
            **request_kwargs("completion", stream, "greedy"),
        )  # fmt: skip
        check(list(result) if stream else result, "completion", stream, expected, len(ids))
    vocab = offline_llm.engine.model_config.vocab_size
    with pytest.raises(openai.BadRequestError, match=f"logit_bias .* vocabulary .*: {vocab}"):
        client.completions.create(
            model=real_stack.model, prompt=PROMPT, max_tokens=4,
            logit_bias={str(vocab): -100},
        )  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_choices_are_the_engines_outputs_for_seed_plus_index(
    real_stack: Stack,
    offline_llm: LLM,
    tokenizer: BaseTokenizer,
    kind: str,
    stream: bool,
) -> None:
    """OpenAI's ``n``: choice ``i`` of a request seeded ``s`` is the engine's output for seed
    ``s + i`` (vLLM's rule); the prompt counts once in usage, every choice's output counts."""
    n, seed = 3, 1234
    ids = prompt_ids(tokenizer, kind)
    sampling = SAMPLING["seeded"]
    expected = [
        offline_llm.generate(
            prompt_token_ids=[ids],
            sampling_params=SamplingParams(max_tokens=MAX_TOKENS, **{**sampling, "seed": seed + i}),
        )[0]
        for i in range(n)
    ]
    assert len({e.text for e in expected}) == n  # distinct draws: the index is checked
    client = openai.OpenAI(base_url=real_stack.base_url, api_key="unused", max_retries=0)
    api = client.completions if kind == "completion" else client.chat.completions
    result: Any = api.create(model=real_stack.model, n=n, **request_kwargs(kind, stream, "seeded"))
    if stream:
        chunks = list(result)
        assert len({c.id for c in chunks}) == 1
        texts = ["" for _ in range(n)]
        finishes: list[str | None] = [None] * n
        roles = [0] * n
        for c in chunks:
            for choice in c.choices:
                if kind == "completion":
                    texts[choice.index] += choice.text
                else:
                    texts[choice.index] += choice.delta.content or ""
                    roles[choice.index] += choice.delta.role == "assistant"
                finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        usage = chunks[-1].usage
        if kind == "chat":
            assert roles == [1] * n  # each choice's first chunk carries its role, once
    else:
        assert [c.index for c in result.choices] == list(range(n))
        texts = [
            c.text if kind == "completion" else c.message.content or "" for c in result.choices
        ]
        finishes = [c.finish_reason for c in result.choices]
        usage = result.usage
    assert texts == [e.text for e in expected]
    assert finishes == [e.finish_reason for e in expected]
    assert usage is not None and usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == sum(len(e.token_ids) for e in expected)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_batch_of_prompts_echoed_is_the_engines_outputs_after_each_prompt(
    real_stack: Stack, offline_llm: LLM, tokenizer: BaseTokenizer, stream: bool
) -> None:
    """A list of prompts on /v1/completions: choice ``p * n + i`` is the engine's output
    for prompt ``p`` and seed ``s + i``; ``echo`` puts each prompt's text before it."""
    prompts, n, seed = [PROMPT, "Hello world, said the"], 2, 99
    sampling = {**SAMPLING["seeded"], "seed": seed}
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    expected = [
        prompt + offline_llm.generate(
            prompt_token_ids=[ids[p]],
            sampling_params=SamplingParams(max_tokens=MAX_TOKENS, **{**sampling, "seed": seed + i}),
        )[0].text
        for p, prompt in enumerate(prompts)
        for i in range(n)
    ]  # fmt: skip
    client = openai.OpenAI(base_url=real_stack.base_url, api_key="unused", max_retries=0)
    result: Any = client.completions.create(
        model=real_stack.model, prompt=prompts, n=n, echo=True, max_tokens=MAX_TOKENS,
        stream=stream, **sampling,
    )  # fmt: skip
    if stream:
        texts = ["" for _ in expected]
        for chunk in result:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    else:
        texts = [c.text for c in result.choices]
        assert result.usage.prompt_tokens == sum(len(i) for i in ids)
    assert texts == expected


def test_echo_with_logprobs_and_no_tokens_scores_each_prompt_as_the_engine_does(
    real_stack: Stack, offline_llm: LLM, tokenizer: BaseTokenizer
) -> None:
    """lm-evaluation-harness's loglikelihood call: a batch of token-id prompts, ``echo``,
    ``max_tokens`` 0, ``logprobs`` 1. Each prompt token's logprob (and its best
    alternative) is the engine's ``prompt_logprobs``; nothing is generated."""
    prompts = [tokenizer.encode(p, add_special_tokens=True) for p in (PROMPT, "Hello world")]
    offline = [
        offline_llm.generate(
            prompt_token_ids=[ids],
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
        )[0]
        for ids in prompts
    ]
    client = openai.OpenAI(base_url=real_stack.base_url, api_key="unused", max_retries=0)
    result = client.completions.create(
        model=real_stack.model, prompt=prompts, echo=True, max_tokens=0, logprobs=1,
        temperature=0.0,
    )  # fmt: skip
    assert result.usage is not None and result.usage.completion_tokens == 0
    for choice, ids, expected in zip(result.choices, prompts, offline, strict=True):
        assert choice.finish_reason == "length"
        assert choice.text == tokenizer.decode(ids)
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        # Each token's offset indexes the echoed text: where its decoded text begins.
        assert lp.text_offset == [len(tokenizer.decode(ids[:j])) for j in range(len(ids))]
        assert expected.prompt_logprobs is not None and expected.prompt_top_logprobs is not None
        assert lp.token_logprobs[1:] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-5)
        for got, top in zip(lp.top_logprobs[1:], expected.prompt_top_logprobs[1:], strict=True):
            assert top is not None
            # The best alternative, and the prompt's own token: the best is the largest.
            assert max(got.values()) == pytest.approx(top[0][1], abs=1e-5)
