"""End-to-end fixtures: the whole serving path on loopback, against a tiny real checkpoint.

- ``tiny_model``: a tiny random Llama with a byte-level BPE tokenizer and chat template,
  saved once per session (:mod:`tests.e2e.tiny_model`).
- ``offline_llm``: the engine's offline API on that checkpoint: the reference outputs.
- ``real_stack``: one stack for the package (:class:`~tests.e2e.stack.Stack`): the
  gateway under uvicorn and in-process workers with the real engine for ``realtime``,
  ``short`` and ``long``, a slow sim worker for ``paced`` (``max_pending=2``, to saturate)
  and no worker at all for ``orphan`` (no fallback, to get 503s).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import Config, GatewayConfig, GroupConfig, NatsConfig, WorkerConfig
from common.services import NatsServer
from common.tokenizer import BaseTokenizer, load_tokenizer
from tests.e2e.stack import Stack
from tests.e2e.tiny_model import MAX_POSITIONS, save_tiny_llama
from workers.engine import EngineArgs, LLMEngine
from workers.engine.llm import LLM
from workers.sim import SimCost, SimEngine

# Engines, the gateway and the tests share two loaded cores: one torch thread each.
torch.set_num_threads(1)

# group -> (max_batch, max_seq_len, max_pending, fallback, rank)
REAL_GROUPS: dict[str, tuple[int, int, int, str | None, int]] = {
    "realtime": (1, 128, 8, None, 0),
    "short": (4, 256, 64, "long", 1),
    "long": (2, MAX_POSITIONS, 16, None, 2),
    "paced": (4, 64, 2, None, 8),
    "orphan": (4, 64, 4, None, 9),
}
PACED_STEP_S = 0.05


def nats_config_for(server: NatsServer, **overrides: Any) -> NatsConfig:
    """Names of its own on the session server, so stacks never see each other's messages."""
    tag = uuid.uuid4().hex[:10]
    return NatsConfig(
        url=server.url,
        subject_prefix=f"e{tag}",
        stream=f"QOS_REQ_{tag}",
        kv_bucket=f"qos_state_{tag}",
        connect_timeout_s=2.0,
        reconnect_wait_s=0.1,
        **overrides,
    )


def stack_config(
    nats: NatsConfig, groups: dict[str, tuple[int, int, int, str | None, int]]
) -> Config:
    return Config(
        nats=nats,
        groups={
            name: GroupConfig(
                max_batch=batch,
                max_seq_len=seq,
                slo_ttft_ms=1000,
                slo_e2e_p99_ms=5000,
                policy="continuous" if batch == 1 else "hybrid",
                max_pending=pending,
                fallback=fallback,
                rank=rank,
            )
            for name, (batch, seq, pending, fallback, rank) in groups.items()
        },
        gateway=GatewayConfig(default_max_tokens=16),
        worker=WorkerConfig(telemetry_interval_s=0.2),
    )


def real_engine(model: Path, group: GroupConfig) -> LLMEngine:
    """The engine a worker of ``group`` runs (as ``python -m workers`` would build it)."""
    return LLMEngine(
        EngineArgs(
            model=str(model), device="cpu", policy=group.policy, max_batch_size=group.max_batch,
            max_seq_len=group.max_seq_len, num_kv_blocks=128,
        )
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> BaseTokenizer:
    return load_tokenizer(str(tiny_model))


@pytest.fixture(scope="session")
def offline_llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), device="cpu", max_batch_size=4, max_seq_len=MAX_POSITIONS,
               num_kv_blocks=128)  # fmt: skip


@pytest.fixture(scope="package")
def real_stack(
    nats_server: NatsServer,
    tiny_model: Path,
    tokenizer: BaseTokenizer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    config = stack_config(nats_config_for(nats_server), REAL_GROUPS)
    with Stack(config, tokenizer, str(tiny_model), tmp_path_factory.mktemp("real-stack")) as stack:
        for group in ("realtime", "short", "long"):
            stack.add_worker(f"{group}-0", group, real_engine(tiny_model, config.groups[group]))
        paced = SimEngine(
            max_batch_size=4, max_seq_len=64, tokenizer=tokenizer,
            cost=SimCost(base_s=PACED_STEP_S, prefill_s_per_token=0.0, decode_s_per_seq=0.0),
        )  # fmt: skip
        stack.add_worker("paced-0", "paced", paced)
        stack.wait_live({"realtime": 1, "short": 1, "long": 1, "paced": 1})
        yield stack
