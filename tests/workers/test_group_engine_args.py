"""The worker builds its engine from its group's settings."""

from __future__ import annotations

import torch

from common.config import Config, WorkerConfig, default_groups
from workers.__main__ import build_engine, build_parser


def test_the_groups_policy_batch_and_prefill_delay_reach_the_engine() -> None:
    torch.set_num_threads(1)
    groups = default_groups()
    groups["short"] = groups["short"].model_copy(
        update={"policy": "continuous", "prefill_delay_factor": 1.5}
    )
    config = Config(
        groups=groups, worker=WorkerConfig(model="dummy:tiny", device="cpu", kv_cache_gib=0.05)
    )
    engine = build_engine(config, build_parser().parse_args(["--group", "short"]))
    assert engine.batcher.policy == "continuous"
    assert engine.batcher.prefill_delay_factor == 1.5
    assert engine.batcher.max_batch_size == groups["short"].max_batch
