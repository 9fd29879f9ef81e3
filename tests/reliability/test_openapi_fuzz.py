"""The gateway's own OpenAPI schema, fuzzed by schemathesis: no 5xx, no hang.

Every operation gets generated bodies (valid and invalid by the schema) against a live
gateway with a sim worker. The quick run (a few examples per operation) is in CI; the
thorough one is ``slow``. A request must end within ``MAX_RESPONSE_S`` however odd it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error

from common.services import NatsServer
from common.tokenizer import BaseTokenizer
from tests.e2e.stack import Stack
from tests.reliability.harness import group, nats_for, sim_engine, stack_config

MAX_RESPONSE_S = 10.0


@pytest.fixture(scope="module")
def fuzz_stack(
    nats_server: NatsServer, tokenizer: BaseTokenizer, model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:  # fmt: skip
    groups = {"short": group(4, max_pending=256), "long": group(2, max_seq_len=512)}
    config = stack_config(nats_for(nats_server.url, "oapi"), groups, max_body_bytes=64 * 1024,
                          default_max_tokens=8)  # fmt: skip
    with Stack(config, tokenizer, str(model_dir), tmp_path_factory.mktemp("oapi")) as stack:
        stack.add_worker("short-0", "short", sim_engine(tokenizer, 4, step_s=0.0))
        stack.add_worker("long-0", "long", sim_engine(tokenizer, 2, step_s=0.0))
        stack.wait_live({"short": 1, "long": 1})
        yield stack


@pytest.fixture(scope="module")
def api_schema(fuzz_stack: Stack) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_stack.url}/openapi.json")


def call(case: Case, stack: Stack, session: requests.Session) -> None:
    # Keep generated generations short: the point is the gateway's handling, not the tokens.
    if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
        case.body["max_tokens"] = min(case.body["max_tokens"], 64) or case.body["max_tokens"]
    started = time.monotonic()
    response = case.call(base_url=stack.url, session=session, timeout=MAX_RESPONSE_S)
    took = time.monotonic() - started
    case.validate_response(response, checks=[not_a_server_error])
    assert took < MAX_RESPONSE_S, f"{case.method} {case.path} took {took:.1f}s"


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        s.trust_env = False  # loopback only: an http_proxy in the environment must not apply
        yield s


def fuzz(api_schema: Any, stack: Stack, session: requests.Session, examples: int) -> int:
    """``examples`` valid and ``examples`` invalid cases per operation; how many were sent.

    (schemathesis' pytest plugin does not run under this pytest; its strategies do.)
    """
    sent = 0
    for result in api_schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            def run(case: Case) -> None:
                nonlocal sent
                sent += 1
                call(case, stack, session)

            try:
                run()
            except Unsatisfiable:  # no input to make invalid (GET /health): nothing to send
                assert mode is GenerationMode.NEGATIVE, operation
    return sent


def test_openapi_quick_no_operation_answers_5xx_or_hangs(
    api_schema: Any, fuzz_stack: Stack, session: requests.Session
) -> None:
    assert fuzz(api_schema, fuzz_stack, session, examples=6) >= 40


@pytest.mark.slow
def test_openapi_thorough_no_operation_answers_5xx_or_hangs(
    api_schema: Any, fuzz_stack: Stack, session: requests.Session
) -> None:
    assert fuzz(api_schema, fuzz_stack, session, examples=200) >= 1000
