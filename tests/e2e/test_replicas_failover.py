"""Two ``python -m workers`` replicas of one group behind the gateway: shared load, and a
``kill -9`` mid-stream that the openai client never notices.

The workers run the sim engine with the tiny model's tokenizer: its tokens are a pure
function of (seed, position), so a resumed request continues exactly, and the expected
text is computed in-process (:func:`~tests.e2e.tiny_model.sim_reference`). ``ack_wait`` is
2 s, so JetStream hands a dead worker's request to the survivor quickly.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from common.services import NatsServer
from common.tokenizer import BaseTokenizer
from tests.e2e.conftest import nats_config_for, stack_config
from tests.e2e.stack import Stack
from tests.e2e.tiny_model import joined, sim_reference
from workers.engine.sampling_params import SamplingParams

STEP_MS = 30  # slow enough to kill a worker mid-stream
PROMPT = "Hello world! how are you today?"


def sim_flags(model: Path) -> list[str]:
    return ["--engine", "sim", "--model", str(model), "--sim-base-ms", str(STEP_MS),
            "--sim-prefill-us-per-token", "0", "--sim-decode-us-per-seq", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def sim_stack(
    nats_server: NatsServer,
    tiny_model: Path,
    tokenizer: BaseTokenizer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    nats = nats_config_for(nats_server, ack_wait_s=2.0)
    config = stack_config(nats, {"short": (4, 256, 64, None, 1)})
    workdir = tmp_path_factory.mktemp("sim-stack")
    with Stack(config, tokenizer, str(tiny_model), workdir) as stack:
        for worker_id in ("a", "b"):
            stack.spawn_worker(worker_id, "short", *sim_flags(tiny_model))
        stack.wait_live({"short": 2})
        yield stack


def expected_text(tokenizer: BaseTokenizer, max_tokens: int, seed: int) -> str:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    return sim_reference(tokenizer, ids, SamplingParams(max_tokens=max_tokens, seed=seed)).text


def tokens_sent(stack: Stack, request_id: str) -> list[int]:
    """Every token the workers published for a request, in publishing order."""
    return [t for c in stack.chunks[request_id] for t in c.token_ids]


async def test_two_replicas_share_the_load_and_serve_each_request_once(
    sim_stack: Stack, tokenizer: BaseTokenizer
) -> None:
    client = openai.AsyncOpenAI(base_url=sim_stack.base_url, api_key="unused", max_retries=0)

    async def one(seed: int) -> tuple[str, str, int]:
        raw = await client.completions.with_raw_response.create(
            model=sim_stack.model, prompt=PROMPT, max_tokens=8, seed=seed
        )
        result = raw.parse()
        assert result.usage is not None
        return raw.headers["x-request-id"], result.choices[0].text, result.usage.completion_tokens

    seeds = list(range(12))  # more than both replicas hold at once (batch 4 each)
    results = await asyncio.gather(*(one(seed) for seed in seeds))
    served: Counter[str] = Counter()
    for seed, (request_id, text, n_tokens) in zip(seeds, results, strict=True):
        assert text == expected_text(tokenizer, 8, seed)
        sim_stack.final_chunk(request_id)  # every chunk recorded
        workers = sim_stack.served_by(request_id)
        assert len(workers) == 1, f"{request_id} served by {workers}"
        chunks = sim_stack.chunks[request_id]
        assert {c.attempt for c in chunks} == {1}
        assert len(tokens_sent(sim_stack, request_id)) == n_tokens  # no token sent twice
        served[workers.pop()] += 1
    assert set(served) == {"a", "b"} and min(served.values()) >= 2, served


async def test_kill_9_mid_stream_the_openai_stream_gets_every_token_once(
    sim_stack: Stack, tokenizer: BaseTokenizer
) -> None:
    client = openai.AsyncOpenAI(base_url=sim_stack.base_url, api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model=sim_stack.model, prompt=PROMPT, max_tokens=60, seed=7, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    request_id = stream.response.headers["x-request-id"]
    chunks = []
    victim: str | None = None
    async for chunk in stream:
        chunks.append(chunk)
        if victim is None and len(tokens_sent(sim_stack, request_id)) >= 10:
            (victim,) = sim_stack.served_by(request_id)
            child = sim_stack.children[victim]
            child.send_signal(signal.SIGKILL)  # no drain, no nak: only ack_wait brings it back
            await asyncio.to_thread(child.wait)
    expected = sim_reference(
        tokenizer,
        tokenizer.encode(PROMPT, add_special_tokens=True),
        SamplingParams(max_tokens=60, seed=7, ignore_eos=True),
    )
    assert victim is not None
    assert joined(chunks) == expected.text
    sim_stack.final_chunk(request_id)  # every chunk recorded
    assert chunks[-1].choices[0].finish_reason == "length"
    sent = sim_stack.chunks[request_id]
    survivor = ({"a", "b"} - {victim}).pop()
    assert sim_stack.served_by(request_id) == {victim, survivor}
    assert {c.attempt for c in sent if c.worker == survivor} == {2}
    # The survivor resumed where the client stood: its chunks continue, never repeat.
    resumed = [c for c in sent if c.worker == survivor]
    delivered_before = sum(len(c.token_ids) for c in sent if c.worker == victim)
    assert resumed[0].seq == delivered_before
    assert sum(len(c.token_ids) for c in resumed) == 60 - delivered_before
