"""Greedy tokens equal ``transformers.generate`` on the same checkpoint, whatever the batching.

fp32 on both sides: the engine's logits differ from transformers' by ~2e-5 on these
checkpoints while the smallest top-2 margin along the reference paths is ~4e-3 (see
``tiny_checkpoints``), so any difference in tokens is a bug, not rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_checkpoints import KINDS, checkpoint, hf_greedy, prompts
from workers.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from workers.engine.args import POLICIES

BS = 4
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


def expected(path: Path, batch: list[list[int]], n: int = MAX_TOKENS) -> list[list[int]]:
    return [hf_greedy(path, p, n) for p in batch]


def run_llm(path: Path, batch: list[list[int]], **kw: object) -> list[list[int]]:
    llm = LLM(str(path), block_size=BS, dtype="float32", **{"num_kv_blocks": 64, **kw})  # type: ignore[arg-type]
    return [o.token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=GREEDY)]


def tight_engine(
    path: Path, policy: str, caching: bool, max_batch_size: int = 8, budget: int = 16
) -> LLMEngine:
    """An engine whose 14 blocks of 4 force preemption by recompute."""
    return LLMEngine(
        EngineArgs(
            str(path),
            dtype="float32",
            policy=policy,
            block_size=BS,
            num_kv_blocks=14,
            max_batch_size=max_batch_size,
            max_num_batched_tokens=budget,
            max_wait_ms=0,
            enable_prefix_caching=caching,
        )
    )


@pytest.mark.parametrize("kind", KINDS)
def test_each_architecture_matches_transformers_across_block_boundaries(
    kind: str, root: str
) -> None:
    path = checkpoint(kind, root)
    batch = prompts(BS) + prompts(BS, seed=1)
    assert run_llm(path, batch, policy="hybrid") == expected(path, batch)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_transformers(policy: str, root: str) -> None:
    path = checkpoint("llama", root)
    batch = prompts(BS) + prompts(BS, seed=2)
    # Three at a time: static/dynamic form several batches; hybrid chunks prompts by 8.
    got = run_llm(
        path, batch, policy=policy, max_batch_size=3, max_num_batched_tokens=8, max_wait_ms=1
    )
    assert got == expected(path, batch)


# policy@F: with prefill_delay_factor F, arrivals wait while others decode, then join together.
@pytest.mark.parametrize("spec", [*POLICIES, "continuous@2", "hybrid@2"])
def test_requests_arriving_while_others_decode_get_transformers_tokens(
    spec: str, root: str
) -> None:
    policy, _, delay = spec.partition("@")
    path = checkpoint("qwen3", root)
    batch = prompts(BS, seed=3) + prompts(BS, seed=4)
    engine = LLMEngine(
        EngineArgs(
            str(path),
            dtype="float32",
            policy=policy,
            block_size=BS,
            num_kv_blocks=64,
            max_batch_size=4,
            max_num_batched_tokens=8,
            max_wait_ms=0,
            prefill_delay_factor=float(delay or 0),
        )
    )
    got: dict[str, list[int]] = {}
    finals: dict[str, list[int]] = {}
    pending = list(enumerate(batch))
    step = 0
    while pending or engine.has_unfinished():
        # Two new arrivals every third step, so joins happen mid-decode.
        if step % 3 == 0:
            for i, p in pending[:2]:
                engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
            pending = pending[2:]
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                assert d.output is not None
                finals[d.request_id] = d.output.token_ids
        step += 1
    want = expected(path, batch)
    assert [got[f"r{i}"] for i in range(len(batch))] == want
    assert [finals[f"r{i}"] for i in range(len(batch))] == want


@pytest.mark.parametrize("policy", ["continuous", "hybrid"])
def test_prefix_cache_hits_reuse_blocks_and_keep_tokens(policy: str, root: str) -> None:
    path = checkpoint("qwen2", root)
    shared = prompts(BS, seed=5)[-1] * 2  # 28 tokens = 7 full blocks
    batch = [[*shared, 7], [*shared, 8, 9], shared[:10], [*shared, 7]]
    engine = LLMEngine(
        EngineArgs(str(path), dtype="float32", policy=policy, block_size=BS, num_kv_blocks=64)
    )
    outputs = {}
    for i, p in enumerate(batch):  # one after another: each finds the previous ones' blocks
        engine.add_request(str(i), prompt_token_ids=p, params=GREEDY)
        while engine.has_unfinished():
            for d in engine.step():
                if d.output is not None:
                    outputs[d.request_id] = d.output
    assert [outputs[str(i)].token_ids for i in range(4)] == expected(path, batch)
    cached = [outputs[str(i)].num_cached_tokens for i in range(4)]
    assert cached[0] == 0
    assert cached[1] == 28 and cached[2] == 8
    # The identical request finds prompt and generated blocks alike, all but the last token.
    assert cached[3] == 28
    stats = engine.stats()
    assert stats.prefix_cache_hits == sum(cached)
    assert stats.prefix_cache_queries == sum(len(p) for p in batch)


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_by_recompute_gives_transformers_tokens(policy: str, root: str) -> None:
    path = checkpoint("mistral", root)
    batch = [p for p in prompts(BS, seed=6) + prompts(BS, seed=7) if len(p) > 2]
    long_greedy = SamplingParams(temperature=0.0, max_tokens=16)
    for caching in (True, False):
        engine = tight_engine(path, policy, caching)
        for i, p in enumerate(batch):
            engine.add_request(str(i), prompt_token_ids=p, params=long_greedy)
        outputs = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.output is not None:
                    outputs[d.request_id] = d.output.token_ids
        if policy in ("static", "dynamic"):  # a batch reserves its members' whole runs
            assert engine.stats().num_preemptions == 0
        else:
            assert engine.stats().num_preemptions > 0
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        assert [outputs[str(i)] for i in range(len(batch))] == expected(path, batch, 16)


def test_priority_preemption_mid_run_gives_transformers_tokens(root: str) -> None:
    """Urgent arrivals trim, sit out and preempt less urgent requests at every stage
    (prefill chunks, decodes), in a cache that also forces preemption by recompute: every
    request still ends with transformers' tokens and nothing is left held."""
    path = checkpoint("llama", root)
    batch = [p for p in prompts(BS, seed=8) + prompts(BS, seed=9) if len(p) > 2]
    long_greedy = SamplingParams(temperature=0.0, max_tokens=16)
    for caching in (True, False):
        engine = tight_engine(path, "hybrid", caching, max_batch_size=3, budget=12)
        outputs: dict[str, list[int]] = {}
        pending = list(enumerate(batch))
        while pending or engine.has_unfinished():
            if pending:  # one arrival a step, more urgent as the run goes on
                i, p = pending.pop(0)
                engine.add_request(str(i), prompt_token_ids=p, params=long_greedy, priority=-i)
            for d in engine.step():
                if d.output is not None:
                    outputs[d.request_id] = d.output.token_ids
        assert engine.stats().num_priority_preemptions > 0
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        assert [outputs[str(i)] for i in range(len(batch))] == expected(path, batch, 16)
