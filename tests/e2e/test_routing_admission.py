"""Routing and admission through the real stack: which group serves, and when none can.

Groups of ``real_stack``: ``realtime`` (batch 1, 128 tokens), ``short`` (256), ``long``
(512), ``paced`` (a slow sim worker, ``max_pending=2``) and ``orphan`` (no worker, no
fallback). The ``X-QoS-Group`` response header names the group that served.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import PACED_STEP_S
from tests.e2e.stack import Stack


def client_for(stack: Stack, base_url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url or stack.base_url, api_key="unused", max_retries=0)


def served_group(raw: Any) -> str:
    """The group an openai ``with_raw_response`` result names in ``X-QoS-Group``."""
    raw.parse()  # a well-formed completion, not an error body
    return raw.headers["x-qos-group"]


def test_path_group_routes_to_it(real_stack: Stack) -> None:
    client = client_for(real_stack, f"{real_stack.base_url}/realtime")
    raw = client.completions.with_raw_response.create(
        model=real_stack.model, prompt="Hello", max_tokens=4
    )
    assert served_group(raw) == "realtime"
    assert raw.http_request.url.path == "/v1/realtime/completions"


def test_header_group_routes_to_it(real_stack: Stack) -> None:
    raw = client_for(real_stack).chat.completions.with_raw_response.create(
        model=real_stack.model,
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=4,
        extra_headers={"X-QoS-Group": "long"},
    )
    assert served_group(raw) == "long"


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "group"),
    [(8, 16, "short"), (100, 150, "short"), (100, 200, "long"), (400, 8, "long")],
)
def test_length_routes_to_the_first_group_that_holds_prompt_plus_max_tokens(
    real_stack: Stack, prompt_len: int, max_tokens: int, group: str
) -> None:
    prompt = [5 + i % 300 for i in range(prompt_len)]  # token ids: the length is exact
    raw = client_for(real_stack).completions.with_raw_response.create(
        model=real_stack.model, prompt=prompt, max_tokens=max_tokens
    )
    assert served_group(raw) == group  # realtime is never chosen by length (batch 1)


def test_prompt_beyond_every_group_is_400_context_length_exceeded(real_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client_for(real_stack).completions.create(
            model=real_stack.model, prompt=[7] * 600, max_tokens=4
        )
    assert err.value.status_code == 400
    assert err.value.code == "context_length_exceeded"
    assert err.value.param == "prompt"


def test_explicit_group_too_small_is_400_not_moved(real_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client_for(real_stack).completions.create(
            model=real_stack.model,
            prompt=[7] * 100,
            max_tokens=64,
            extra_headers={"X-QoS-Group": "realtime"},
        )
    assert err.value.code == "context_length_exceeded"


def test_group_without_worker_is_503_within_the_admission_wait(real_stack: Stack) -> None:
    client = client_for(real_stack, f"{real_stack.base_url}/orphan")
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=real_stack.model, prompt="Hello", max_tokens=4)
    took = time.monotonic() - started
    assert err.value.status_code == 503
    assert err.value.code == "service_unavailable"
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert real_stack.admission_wait_s * 0.9 <= took < real_stack.admission_wait_s + 2.0


def test_saturated_group_is_429_with_retry_after(real_stack: Stack) -> None:
    # Two long streams fill `paced` (max_pending=2): each runs 40 steps of 50 ms.
    body = {"model": real_stack.model, "prompt": "Hi", "max_tokens": 40, "stream": True}
    body["ignore_eos"] = True
    url = f"{real_stack.base_url}/paced/completions"
    with contextlib.ExitStack() as streams, httpx.Client(timeout=30) as http:
        lines = []  # held: a dropped line iterator closes its connection (= a disconnect)
        for _ in range(2):
            response = streams.enter_context(http.stream("POST", url, json=body))
            assert response.status_code == 200
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("data: ")  # admitted and running
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            client_for(real_stack, f"{real_stack.base_url}/paced").completions.create(
                model=real_stack.model, prompt="Hi", max_tokens=4
            )
        assert time.monotonic() - started < 40 * PACED_STEP_S  # while both still ran
    assert err.value.status_code == 429
    assert err.value.code == "rate_limit_exceeded"
    assert int(err.value.response.headers["retry-after"]) >= 1
