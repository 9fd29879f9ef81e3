"""vLLM's ``prompt_logprobs``: each prompt token's logprob given the tokens before it, and the
top k there, equal to transformers' ``log_softmax`` of its forward logits (fp32 both sides)
whatever the batching: chunked prefill, slices of rows, prefix-cache and KV-tier hits that
must not be taken, and preemption, which must neither repeat nor lose an entry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import takewhile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.tiny_checkpoints import _hf_model, checkpoint, hf_greedy, prompts
from workers.engine import LLM, EngineArgs, LLMEngine, RequestDelta, RequestOutput, SamplingParams
from workers.engine import model_runner as model_runner_module
from workers.engine.sampling_params import SamplingParamsError

BS = 4
ATOL = 1e-4  # the engine's logits differ from transformers' by ~2e-5 on these checkpoints
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


_ref_cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def hf_logprobs(path: Path, prompt: Sequence[int]) -> torch.Tensor:
    """``[len(prompt), V]`` fp32 ``log_softmax`` of transformers' logits: row ``j - 1``
    is the distribution of prompt token ``j``."""
    key = (str(path), tuple(prompt))
    if key not in _ref_cache:
        model = _hf_model(str(path))  # loaded once per checkpoint (tiny_checkpoints)
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt)])).logits[0].float()
        _ref_cache[key] = torch.log_softmax(logits, dim=-1)
    return _ref_cache[key]


def assert_prompt_logprobs(
    path: Path,
    prompt: Sequence[int],
    values: list[float | None] | None,
    tops: list[list[tuple[int, float]] | None] | None,
    k: int,
) -> None:
    """One entry per prompt token, entry 0 None; values and top k as transformers'."""
    assert values is not None and tops is not None
    assert len(values) == len(tops) == len(prompt)
    assert values[0] is None and tops[0] is None
    ref = hf_logprobs(path, prompt)
    want = [float(ref[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    assert values[1:] == pytest.approx(want, abs=ATOL)
    for j in range(1, len(prompt)):
        top = tops[j]
        assert top is not None and len(top) == k
        best = ref[j - 1].topk(k).values.tolist() if k else []
        assert [v for _, v in top] == pytest.approx(best, abs=ATOL)
        # Each id's own value: the ids are transformers' top k (ties may swap places).
        assert [v for _, v in top] == pytest.approx(
            [float(ref[j - 1, t]) for t, _ in top], abs=ATOL
        )


def engine(path: Path, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(dtype="float32", block_size=BS, num_kv_blocks=64) | kw
    return LLMEngine(EngineArgs(str(path), **args))


def drain(eng: LLMEngine) -> tuple[dict[str, RequestOutput], dict[str, list[RequestDelta]]]:
    """Step until done: each request's final output and its deltas."""
    outputs: dict[str, RequestOutput] = {}
    deltas: dict[str, list[RequestDelta]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            deltas.setdefault(d.request_id, []).append(d)
            if d.output is not None:
                outputs[d.request_id] = d.output
    return outputs, deltas


def asking(k: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=k)


def assert_delivered_once(deltas: list[RequestDelta], output: RequestOutput) -> None:
    """On the delta of the first token only, as the final output has them."""
    carrying = [i for i, d in enumerate(deltas) if d.prompt_logprobs is not None]
    first = next(i for i, d in enumerate(deltas) if d.token_ids)
    assert carrying == [first]
    assert deltas[first].prompt_logprobs == output.prompt_logprobs
    assert deltas[first].prompt_top_logprobs == output.prompt_top_logprobs


# --- parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [21, -1, 2.0, "3", True])
def test_prompt_logprobs_outside_0_to_20_are_refused_by_name(bad: object) -> None:
    with pytest.raises(SamplingParamsError, match=r"\[0, 20\]") as info:
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    assert info.value.param == "prompt_logprobs"


def test_prompt_logprobs_0_and_20_are_accepted() -> None:
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


# --- values -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prompt_logprobs_equal_transformers_across_block_boundaries(kind: str, root: str) -> None:
    path = checkpoint(kind, root)
    batch = prompts(BS) + prompts(BS, seed=1)  # 1, 3, 4, 5 and 14 tokens
    llm = LLM(str(path), block_size=BS, dtype="float32", num_kv_blocks=64, policy="hybrid")
    outs = llm.generate(prompt_token_ids=batch, sampling_params=asking(5))
    for prompt, out in zip(batch, outs, strict=True):
        assert_prompt_logprobs(path, prompt, out.prompt_logprobs, out.prompt_top_logprobs, 5)
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS)  # sampling unchanged
        assert out.logprobs is None  # generated tokens' logprobs were not asked


@pytest.mark.parametrize("async_output", [False, True], ids=["sync", "async"])
def test_chunked_prefill_accumulates_the_same_prompt_logprobs(
    root: str, async_output: bool
) -> None:
    """Hybrid with a budget of 3: prompts split across steps at other points than blocks,
    beside a request that asks nothing and one that asks no alternatives."""
    path = checkpoint("llama", root)
    batch = [*prompts(BS, seed=2)[2:], prompts(BS, seed=3)[-1]]  # 4, 5, 14, 14 tokens
    eng = engine(
        path,
        policy="hybrid",
        max_batch_size=2,
        max_num_batched_tokens=3,
        async_output=async_output,
    )
    ks = [3, 1, 0, None]
    for i, (p, k) in enumerate(zip(batch, ks, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=k)
        eng.add_request(str(i), prompt_token_ids=p, params=params)
    outputs, deltas = drain(eng)
    for i, (p, k) in enumerate(zip(batch, ks, strict=True)):
        out = outputs[str(i)]
        assert out.token_ids == hf_greedy(path, p, MAX_TOKENS)
        if k is None:
            assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
            assert all(d.prompt_logprobs is None for d in deltas[str(i)])
            continue
        assert_prompt_logprobs(path, p, out.prompt_logprobs, out.prompt_top_logprobs, k)
        assert_delivered_once(deltas[str(i)], out)


def test_long_prompts_get_their_logits_a_bounded_slice_at_a_time(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint("qwen2", root)
    monkeypatch.setattr(model_runner_module, "PROMPT_LOGPROBS_ROWS", 5)
    eng = engine(path, policy="continuous")
    rows: list[int] = []
    compute_logits = eng.runner.model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(eng.runner.model, "compute_logits", counted)
    g = torch.Generator().manual_seed(11)
    long_prompt = torch.randint(2, 298, (31,), generator=g).tolist()
    eng.add_request("r", prompt_token_ids=long_prompt, params=asking(4, max_tokens=2))
    outputs, _ = drain(eng)
    out = outputs["r"]
    assert_prompt_logprobs(path, long_prompt, out.prompt_logprobs, out.prompt_top_logprobs, 4)
    assert max(rows) <= 5
    # The whole prompt in one step: its sampling row, then 30 prompt rows in slices of 5;
    # then one decode row.
    assert rows == [1, 5, 5, 5, 5, 5, 5, 1]


def test_requests_not_asking_compute_no_prompt_rows(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint("llama", root)
    eng = engine(path, policy="hybrid", max_batch_size=4, max_num_batched_tokens=8)
    calls: list[int] = []
    prompt_logprobs = eng.runner._prompt_logprobs

    def spied(hidden: torch.Tensor, seqs: Any, wanted: Any) -> Any:
        calls.append(sum(len(w.targets) for w in wanted))
        return prompt_logprobs(hidden, seqs, wanted)

    monkeypatch.setattr(eng.runner, "_prompt_logprobs", spied)
    batch = prompts(BS, seed=4)
    eng.add_request("asks", prompt_token_ids=batch[-1], params=asking(2))
    for i, p in enumerate(batch[:-1]):
        eng.add_request(str(i), prompt_token_ids=p, params=GREEDY)
    outputs, _ = drain(eng)
    # Only the asking request's 13 positions, over the steps its prompt took.
    assert sum(calls) == len(batch[-1]) - 1
    asked = outputs["asks"]
    assert_prompt_logprobs(path, batch[-1], asked.prompt_logprobs, asked.prompt_top_logprobs, 2)
    assert all(outputs[str(i)].prompt_logprobs is None for i in range(len(batch) - 1))
    calls.clear()
    for i, p in enumerate(batch):  # once nobody asks, no step looks for prompt rows
        eng.add_request(f"again-{i}", prompt_token_ids=p, params=GREEDY)
    outputs, _ = drain(eng)
    assert calls == []
    assert all(
        o.prompt_logprobs is None and o.prompt_top_logprobs is None for o in outputs.values()
    )


@pytest.mark.parametrize("async_output", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generated_tokens_logprobs_equal_transformers(
    kind: str, async_output: bool, root: str
) -> None:
    """The decode path's ``logprobs``/``top_logprobs``, not only the prompt's: each generated
    token's value and the top k are transformers' ``log_softmax`` at its position, the
    model's raw distribution whatever the sampling (temperature, penalties, a seed)
    changed in the choice. Greedy parity alone would not see a value read from the wrong
    row or after the penalties."""
    path = checkpoint(kind, root)
    eng = engine(
        path, policy="hybrid", max_batch_size=4, max_num_batched_tokens=6, async_output=async_output
    )
    batch = prompts(BS, seed=6)[1:]  # 3, 4, 5 and 14 tokens: decodes beside chunked prefill
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3),
        SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, logprobs=2, seed=11,
                       repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=MAX_TOKENS, logprobs=0, seed=3),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=4,
                       frequency_penalty=1.0),
    ]  # fmt: skip
    for i, (ids, sp) in enumerate(zip(batch, params, strict=True)):
        eng.add_request(str(i), prompt_token_ids=ids, params=sp)
    outputs, _ = drain(eng)
    for i, (ids, sp) in enumerate(zip(batch, params, strict=True)):
        out = outputs[str(i)]
        assert out.logprobs is not None and out.top_logprobs is not None
        assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs) > 0
        ref = hf_logprobs(path, ids + out.token_ids)
        rows = [ref[len(ids) - 1 + n] for n in range(len(out.token_ids))]
        want = [float(row[t]) for row, t in zip(rows, out.token_ids, strict=True)]
        assert out.logprobs == pytest.approx(want, abs=ATOL), (kind, i)
        for row, top in zip(rows, out.top_logprobs, strict=True):
            assert sp.logprobs is not None and len(top) == sp.logprobs
            assert [v for _, v in top] == pytest.approx(
                row.topk(sp.logprobs).values.tolist() if sp.logprobs else [], abs=ATOL
            )
            assert [v for _, v in top] == pytest.approx([float(row[t]) for t, _ in top], abs=ATOL)
        assert out.cumulative_logprob == pytest.approx(sum(want), abs=ATOL * len(want))


# --- caches -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["continuous", "hybrid"])
def test_a_prefix_cache_hit_is_not_taken_and_the_blocks_still_serve_others(
    policy: str, root: str
) -> None:
    path = checkpoint("qwen2", root)
    prompt = prompts(BS, seed=5)[-1] * 2  # 28 tokens: 7 full blocks
    eng = engine(path, policy=policy, max_num_batched_tokens=16, max_batch_size=4)
    served: dict[str, RequestOutput] = {}
    for rid, params in (("warm", GREEDY), ("asks", asking(3)), ("after", GREEDY)):
        eng.add_request(rid, prompt_token_ids=prompt, params=params)
        served.update(drain(eng)[0])
    assert served["asks"].num_cached_tokens == 0  # the whole prompt computed
    asked = served["asks"]
    assert_prompt_logprobs(path, prompt, asked.prompt_logprobs, asked.prompt_top_logprobs, 3)
    assert served["after"].num_cached_tokens == 24  # all but the last token's block
    stats = eng.stats()  # the asking request looked nothing up: the hit rate is the others'
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * len(prompt), 24)
    assert {o.token_ids == hf_greedy(path, prompt, MAX_TOKENS) for o in served.values()} == {True}


def test_a_request_asking_first_publishes_its_blocks_for_others(root: str) -> None:
    path = checkpoint("llama", root)
    prompt = prompts(BS, seed=6)[-1]  # 14 tokens: 3 full blocks
    eng = engine(path, policy="hybrid", max_num_batched_tokens=16, max_batch_size=4)
    eng.add_request("asks", prompt_token_ids=prompt, params=asking(1))
    first = drain(eng)[0]["asks"]
    eng.add_request("plain", prompt_token_ids=prompt, params=GREEDY)
    plain = drain(eng)[0]["plain"]
    assert first.num_cached_tokens == 0 and plain.num_cached_tokens == 12
    assert_prompt_logprobs(path, prompt, first.prompt_logprobs, first.prompt_top_logprobs, 1)


class DictTier:
    """A KV tier in a dict: stores what is written through, loads it back by name."""

    accepts_stores = True
    accepts_offloads = False

    def __init__(self) -> None:
        self.blocks: dict[bytes, np.ndarray] = {}
        self.lookups = 0
        self.stored = 0  # blocks offered

    def bind(self, model: str, seed: int, layout: object, weights_device: str = "") -> None:
        pass

    def _held(self, hashes: Sequence[bytes]) -> Iterator[bytes]:
        return takewhile(lambda h: h in self.blocks, hashes)

    def lookup(self, hashes: Sequence[bytes], count: bool = True) -> int:
        self.lookups += 1
        return sum(1 for _ in self._held(hashes))

    def load(self, hashes: Sequence[bytes], budget_s: float | None = None) -> list[memoryview]:
        return [self.blocks[h].data for h in self._held(hashes)]

    def store_async(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        self.stored += len(hashes)
        for h, row in zip(hashes, data, strict=True):
            self.blocks[h] = row.copy()

    def offload(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        pass

    def skipped(self, blocks: int) -> None:
        pass


def test_the_kv_tier_is_not_asked_for_a_prompt_that_owes_logprobs(root: str) -> None:
    path = checkpoint("llama", root)
    prompt = prompts(BS, seed=7)[-1] * 2  # 28 tokens
    tier = DictTier()
    first = LLMEngine(
        EngineArgs(str(path), dtype="float32", block_size=BS, num_kv_blocks=64),
        kv_tier=tier,
    )
    first.add_request("warm", prompt_token_ids=prompt, params=GREEDY)
    drain(first)
    assert len(tier.blocks) >= 6  # written through
    second = LLMEngine(
        EngineArgs(str(path), dtype="float32", block_size=BS, num_kv_blocks=64),
        kv_tier=tier,
    )
    lookups = tier.lookups
    second.add_request("asks", prompt_token_ids=prompt, params=asking(2))
    asked = drain(second)[0]["asks"]
    assert tier.lookups == lookups and second.stats().kv_tier_hits == 0
    assert_prompt_logprobs(path, prompt, asked.prompt_logprobs, asked.prompt_top_logprobs, 2)
    # The tier holds the prefix: a request that asks nothing loads it.
    third = LLMEngine(
        EngineArgs(str(path), dtype="float32", block_size=BS, num_kv_blocks=64),
        kv_tier=tier,
    )
    third.add_request("plain", prompt_token_ids=prompt, params=GREEDY)
    drain(third)
    assert third.stats().kv_tier_hits == 24


def test_a_prompt_recomputed_for_its_logprobs_is_not_written_through_again(root: str) -> None:
    """Its blocks are copies of blocks another request named (and wrote through): offered
    again, they were copied off the device and stored twice, using up the budget."""
    path = checkpoint("llama", root)
    prompt = prompts(BS, seed=7)[-1] * 2  # 28 tokens: 7 full blocks
    tier = DictTier()
    eng = LLMEngine(
        EngineArgs(str(path), dtype="float32", block_size=BS, num_kv_blocks=64),
        kv_tier=tier,
    )
    eng.add_request("warm", prompt_token_ids=prompt, params=GREEDY)
    drain(eng)
    written = tier.stored
    assert written >= 7
    eng.add_request("asks", prompt_token_ids=prompt, params=asking(0))
    drain(eng)
    assert tier.stored - written <= 1  # at most the block its first token completed


# --- preemption ---------------------------------------------------------------------------


def one_slot_engine(path: Path, caching: bool, budget: int) -> LLMEngine:
    """One request at a time, priority preemption on: an urgent arrival preempts."""
    return engine(
        path,
        policy="hybrid",
        max_batch_size=1,
        max_num_batched_tokens=budget,
        priority_preemption=True,
        enable_prefix_caching=caching,
    )


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_a_request_preempted_mid_prefill_resumes_without_repeating_an_entry(
    root: str, caching: bool
) -> None:
    path = checkpoint("llama", root)
    low, urgent = prompts(BS, seed=8)[-1], prompts(BS, seed=8)[3]  # 14 and 5 tokens
    eng = one_slot_engine(path, caching, budget=BS)
    eng.add_request("low", prompt_token_ids=low, params=asking(2), priority=3)
    early = eng.step()  # its first chunk: 4 of its 13 positions
    assert early == [] and eng.requests["low"].prompt_lp_done == BS
    eng.add_request("urgent", prompt_token_ids=urgent, params=asking(2), priority=0)
    outputs, deltas = drain(eng)
    assert eng.stats().num_priority_preemptions == 1
    for rid, prompt in (("low", low), ("urgent", urgent)):
        out = outputs[rid]
        assert_prompt_logprobs(path, prompt, out.prompt_logprobs, out.prompt_top_logprobs, 2)
        assert_delivered_once(deltas[rid], out)
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS)
    assert eng.pool.num_used_blocks == 0


def test_a_request_preempted_after_its_prompt_logprobs_keeps_them_and_may_hit(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint("qwen2", root)
    low, urgent = prompts(BS, seed=9)[-1], prompts(BS, seed=9)[3]  # 14 and 5 tokens
    eng = one_slot_engine(path, caching=True, budget=16)
    computed: list[int] = []
    prompt_logprobs = eng.runner._prompt_logprobs

    def spied(hidden: torch.Tensor, seqs: Any, wanted: Any) -> Any:
        computed.append(sum(len(w.targets) for w in wanted))
        return prompt_logprobs(hidden, seqs, wanted)

    monkeypatch.setattr(eng.runner, "_prompt_logprobs", spied)
    eng.add_request("low", prompt_token_ids=low, params=asking(3), priority=3)
    seen: dict[str, list[RequestDelta]] = {"low": eng.step() + eng.step()}  # 2 tokens
    assert [len(d.token_ids) for d in seen["low"]] == [1, 1]
    eng.add_request("urgent", prompt_token_ids=urgent, params=GREEDY, priority=0)
    outputs, deltas = drain(eng)
    assert eng.stats().num_priority_preemptions == 1
    seen["low"] += deltas["low"]
    out = outputs["low"]
    assert_prompt_logprobs(path, low, out.prompt_logprobs, out.prompt_top_logprobs, 3)
    assert_delivered_once(seen["low"], out)
    assert out.token_ids == hf_greedy(path, low, MAX_TOKENS)
    assert computed == [len(low) - 1]  # never again after the preemption
    # Its recompute took the prefix-cache hit it no longer owes logits for.
    assert eng.stats().num_prompt_tokens_computed < len(urgent) + 2 * len(low)


@pytest.mark.parametrize("policy", ["continuous", "hybrid"])
def test_preemption_by_recompute_in_a_tight_cache_keeps_every_entry_once(
    policy: str, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache too small for 8 requests of up to 14 + 16 tokens: requests are preempted and
    recompute, after their first tokens and (hybrid's chunks of 4) mid-prefill."""
    path = checkpoint("mistral", root)
    batch = [p for p in prompts(BS, seed=10) + prompts(BS, seed=11) if len(p) > 2]
    hybrid = policy == "hybrid"
    eng = engine(
        path,
        policy=policy,
        num_kv_blocks=10 if hybrid else 14,
        max_batch_size=4 if hybrid else 8,
        max_num_batched_tokens=4 if hybrid else 16,
    )
    owed: list[bool] = []  # per preemption: did the victim still owe prompt logprobs?
    preempt = eng.batcher._preempt

    def spied(req: Any, plan: Any) -> None:
        owed.append(req.prompt_lp_pending)
        preempt(req, plan)

    monkeypatch.setattr(eng.batcher, "_preempt", spied)
    for i, p in enumerate(batch):
        eng.add_request(str(i), prompt_token_ids=p, params=asking(2, max_tokens=16))
    outputs, deltas = drain(eng)
    assert False in owed and (True in owed or not hybrid)
    assert eng.stats().num_preemptions == len(owed)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    for i, p in enumerate(batch):
        out = outputs[str(i)]
        assert out.token_ids == hf_greedy(path, p, 16)
        assert_prompt_logprobs(path, p, out.prompt_logprobs, out.prompt_top_logprobs, 2)
        assert_delivered_once(deltas[str(i)], out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_graphs_and_async_output_the_values_are_transformers(root: str) -> None:
    """The device paths: the logprobs copied to pinned host memory without a sync of their
    own, and read at the first token; a prompt joining while others decode (their steps
    replay CUDA graphs, a step with prompt rows runs eagerly)."""
    path = checkpoint("llama", root)
    eng = engine(path, device="cuda", backend="triton", async_output=True, max_batch_size=8,
                 num_kv_blocks=256)  # fmt: skip
    background = prompts(BS, seed=4)
    for i, ids in enumerate(background):
        eng.add_request(f"bg{i}", prompt_token_ids=ids, params=GREEDY)
    for _ in range(3):  # they decode now
        eng.step()
    asked = prompts(BS, seed=5)
    for i, ids in enumerate(asked):
        eng.add_request(f"ask{i}", prompt_token_ids=ids, params=asking(3))
    outputs, deltas = drain(eng)
    for i, ids in enumerate(asked):
        out = outputs[f"ask{i}"]
        assert_delivered_once(deltas[f"ask{i}"], out)
        values, tops = out.prompt_logprobs, out.prompt_top_logprobs
        assert values is not None and tops is not None and values[0] is None
        ref = hf_logprobs(path, ids)
        want = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
        assert values[1:] == pytest.approx(want, abs=2e-3)  # TF32 matmuls on the device
        assert all(top is not None and len(top) == 3 for top in tops[1:])
    assert all(outputs[f"bg{i}"].prompt_logprobs is None for i in range(len(background)))
