"""Reliability fixtures: a tokenizer folder the sim workers and the gateway share, and a
stack (:class:`tests.e2e.stack.Stack`) on a private ``nats-server`` that a test may kill.

The sim engine stands in for the model everywhere here: its tokens are a pure function of
(seed, position), so a resumed or re-sent stream can be checked token for token
(:func:`~tests.reliability.harness.expected_text`), and its fixed step cost makes capacity
a known number.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.serve_stack import write_word_tokenizer
from common.config import GroupConfig
from common.services import NatsServer
from common.tokenizer import BaseTokenizer, load_tokenizer
from tests.e2e.stack import Stack
from tests.reliability.harness import group, nats_for, sim_engine, stack_config


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder (no weights) whose every token decodes to a whole word, so a
    stream resumed or re-sent at any token boundary must equal the reference exactly."""
    return write_word_tokenizer(tmp_path_factory.mktemp("rel-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> BaseTokenizer:
    return load_tokenizer(str(model_dir))


@pytest.fixture
def private_nats(fresh_nats_server: Callable[..., NatsServer]) -> NatsServer:
    """A nats-server of this test's own: it may be killed and restarted."""
    return fresh_nats_server()


StackFactory = Callable[..., Stack]


@pytest.fixture
def make_stack(tokenizer: BaseTokenizer, model_dir: Path, tmp_path: Path) -> Iterator[StackFactory]:
    """``make_stack(nats_url, groups={...}, workers={"short": 2}, step_s=.02, worker={...},
    **gateway)`` (``worker``: WorkerConfig fields):
    the gateway in a thread of its own and in-process sim workers; closed after the test."""
    stacks: list[Stack] = []

    def make(
        nats_url: str,
        groups: dict[str, GroupConfig] | None = None,
        workers: dict[str, int] | None = None,
        *,
        step_s: float = 0.02,
        nats_overrides: dict[str, object] | None = None,
        admission_wait_s: float = 0.5,
        worker: dict[str, object] | None = None,
        **gateway: object,
    ) -> Stack:
        groups = groups or {"short": group(4)}
        workers = {"short": 1} if workers is None else workers
        nats = nats_for(nats_url, uuid.uuid4().hex[:10], **(nats_overrides or {}))
        config = stack_config(nats, groups, worker, **gateway)
        stack = Stack(
            config, tokenizer, str(model_dir), tmp_path, admission_wait_s=admission_wait_s
        ).start()
        stacks.append(stack)
        for name, count in workers.items():
            for i in range(count):
                batch = groups[name].max_batch
                stack.add_worker(f"{name}-{i}", name, sim_engine(tokenizer, batch, step_s))
        stack.wait_live({name: n for name, n in workers.items() if n})
        return stack

    yield make
    for stack in stacks:
        stack.close()
