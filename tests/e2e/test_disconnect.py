"""A client that hangs up mid-stream stops its generation: the engine frees every KV block."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway import generate as generate_module
from tests.e2e.stack import Stack
from workers.engine.outputs import EngineStats

MAX_TOKENS = 450
STEP_PAUSE_S = 0.005  # each engine step of the `long` worker made ≥ 5 ms: ≥ 2 s of decoding


@pytest.fixture
def slow_long_worker(real_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding far longer than the test on any machine: the tiny demo model can decode
    450 tokens in under 0.4 s on a quiet one, and the request ended before its client left."""
    engine = real_stack.workers["long-0"].engine
    real_step = engine.step

    def step() -> object:
        time.sleep(STEP_PAUSE_S)
        return real_step()

    monkeypatch.setattr(engine, "step", step)


def wait_idle(stack: Stack, worker_id: str, timeout_s: float = 10.0) -> EngineStats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stack.engine_stats(worker_id)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and not stack.workers[worker_id].inflight_ids:
            return stats
        assert time.monotonic() < deadline, f"{worker_id} still busy: {stats}"
        time.sleep(0.02)


@pytest.mark.usefixtures("slow_long_worker")
def test_client_disconnect_mid_stream_aborts_and_frees_the_kv_cache(real_stack: Stack) -> None:
    before = wait_idle(real_stack, "long-0")
    body = {
        "model": real_stack.model,
        "prompt": "The quick brown fox jumps over the lazy dog.",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    events = 0
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{real_stack.base_url}/long/completions", json=body) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        for line in lines:
            events += line.startswith("data: ")
            if events == 3:
                break
        # Read while ``lines`` still holds the stream open: once the iterator is dropped,
        # httpcore may close the connection, the gateway aborts the request, and an abort
        # that beat this read left the engine idle after 4 tokens (a flake seen in CI).
        busy = real_stack.engine_stats("long-0")
        seen = [
            (c.attempt, len(c.token_ids), c.finish_reason)
            for c in real_stack.chunks.get(request_id, [])
        ]
        assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks, (busy, seen)
        del lines
    # Leaving the block closed the connection: the gateway must abort the worker.

    after = wait_idle(real_stack, "long-0")
    assert after.num_free_blocks == after.num_blocks
    generated = after.num_generation_tokens - before.num_generation_tokens
    assert generated < MAX_TOKENS // 2, f"generated {generated}: the abort came late or never"
    assert real_stack.final_chunk(request_id).finish_reason == "abort"


@pytest.mark.usefixtures("slow_long_worker")
def test_a_non_stream_client_that_hangs_up_while_tokens_flow_aborts_it(
    real_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway asked whether a non-stream client was still there only after a second
    without deliveries, which a worker flushing every few ms never leaves: a client that
    timed out kept its worker generating to the end (and the openai client retries)."""
    monkeypatch.setattr(generate_module, "DISCONNECT_POLL_S", 0.1)
    wait_idle(real_stack, "long-0")
    known = set(real_stack.chunks)
    body = {
        "model": real_stack.model,
        "prompt": "The quick brown fox jumps over the lazy dog.",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=0.4) as http, pytest.raises(httpx.ReadTimeout):
        http.post(f"{real_stack.base_url}/long/completions", json=body)
    after = wait_idle(real_stack, "long-0")
    assert after.num_free_blocks == after.num_blocks
    (request_id,) = set(real_stack.chunks) - known
    assert real_stack.final_chunk(request_id).finish_reason == "abort"
