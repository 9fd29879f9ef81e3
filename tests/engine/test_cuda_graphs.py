"""CUDA graphs for decode steps replay to the same logits and tokens as eager mode."""

from __future__ import annotations

import pytest
import torch

from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.engine.batcher import BatchPlan, ScheduledSeq

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def engine(eager: bool) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            "dummy:tiny", device="cuda", dtype="float32", enforce_eager=eager,
            num_kv_blocks=256, block_size=16, max_batch_size=12,
        )
    )  # fmt: skip


def test_graph_replay_equals_eager_for_padded_buckets() -> None:
    eager, graphed = engine(True), engine(False)
    assert not eager.runner._graphs and sorted(graphed.runner._graphs) == [1, 2, 4, 8, 12]
    # 5 sequences replay the bucket of 8: three padding rows must not disturb them.
    seqs = [
        ScheduledSeq(
            str(i), [7 + i], start_pos=n, block_table=list(range(4 * i, 4 * i + 4)), sample=True
        )
        for i, n in enumerate([0, 15, 16, 17, 40])
    ]
    for e in (eager, graphed):
        for kc, vc, *_ in e.runner.kv_caches:
            torch.manual_seed(0)
            kc.normal_()
            vc.normal_()
    plan = BatchPlan(seqs=seqs)
    want = eager.runner.execute(plan)
    got = graphed.runner.execute(plan)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_graphed_engine_generates_the_eager_tokens() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[3 + i] * (5 + 7 * i) for i in range(6)]
    results = []
    for e in (engine(True), engine(False)):
        for i, p in enumerate(prompts):
            e.add_request(str(i), prompt_token_ids=p, params=params)
        out: dict[str, list[int]] = {}
        while e.has_unfinished():
            for d in e.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        results.append(out)
    assert results[0] == results[1]
