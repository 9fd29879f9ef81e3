"""The engine with KV tiers: hits load instead of computing and change no token, evicted
device blocks come back from host memory, and Redis failing costs recomputation only."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from common.config import RedisConfig
from common.services import RedisServer
from kvstore.redis_tier import CircuitBreaker
from kvstore.tiers import KVTiers
from tests.engine.stepping import drain_all
from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.engine import batcher as batcher_module
from workers.engine.block_pool import hash_chain

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompt(seed: int, n: int = 5 * BS + 2) -> list[int]:
    return [(seed * 31 + 7 * i) % 290 + 3 for i in range(n)]


def engine(model: Path, tier: KVTiers | None = None, **kw: object) -> LLMEngine:
    args = dict(dtype="float32", block_size=BS, num_kv_blocks=64) | kw
    return LLMEngine(EngineArgs(str(model), **args), kv_tier=tier)  # type: ignore[arg-type]


def serve(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """One request after another (each may hit what the previous ones left)."""
    outs: list[list[int]] = []
    for p in prompts:
        rid = f"r{eng.num_steps}-{len(outs)}"
        eng.add_request(rid, prompt_token_ids=p, params=GREEDY)
        tokens: list[int] = []
        while eng.has_unfinished():
            for delta in eng.step():
                tokens += delta.token_ids
        outs.append(tokens)
    return outs


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Callable[[list[list[int]]], list[list[int]]]:
    """Tokens without any tier or prefix cache: what every tiered run must reproduce."""
    eng = engine(tiny_llama, enable_prefix_caching=False)
    return lambda prompts: serve(eng, prompts)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exported_blocks_are_whole_blocks_and_import_back_bit_exact(
    dtype: str, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunked:  # one block per staged copy: a load of many blocks goes in pieces
        from workers.engine import model_runner

        monkeypatch.setattr(model_runner, "COPY_CHUNK_BYTES", 1)
    eng = engine(Path("dummy:tiny"), dtype=dtype, num_kv_blocks=8)
    runner = eng.runner
    for k, v, *_ in runner.kv_caches:
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    rows = runner.export_blocks([3, 1])
    assert rows.shape == (2, runner.bytes_per_block())
    layer, block = 1, 1  # row 1 is block 1: [K|V, layer, token, head, dim]
    as_kv = (
        torch.from_numpy(rows[1].copy()).view(runner.dtype).view(2, len(runner.kv_caches), BS, -1)
    )
    assert torch.equal(as_kv[1, layer].flatten(), runner.kv_caches[layer][1][block].flatten())
    runner.import_blocks([6, 5], [memoryview(r) for r in rows])
    assert np.array_equal(runner.export_blocks([6, 5]), rows)


def test_blocks_evicted_from_the_device_come_back_from_host_memory(
    tiny_llama: Path, reference: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    prompts = [prompt(s) for s in range(5)]
    with KVTiers(host_capacity_bytes=64 * 2048, pin_host=False) as tier:
        eng = engine(tiny_llama, tier, num_kv_blocks=16)  # room for two requests' blocks
        first = serve(eng, prompts)  # the later prompts evict the first one's named blocks
        again = serve(eng, prompts[:1])
        s, t = eng.stats(), tier.stats()
    assert first + again == reference(prompts + prompts[:1])
    assert t.host.store_blocks > 0  # evictions went down to G2 ...
    assert s.kv_tier_hits == t.host.hit_tokens == 5 * BS  # ... and the re-request found them
    assert s.num_prompt_tokens_computed == 6 * len(prompts[0]) - 5 * BS


def test_host_tier_keeps_within_its_capacity(tiny_llama: Path) -> None:
    with KVTiers(host_capacity_bytes=6 * 2048 + 100, pin_host=False) as tier:
        eng = engine(tiny_llama, tier, num_kv_blocks=16)
        serve(eng, [prompt(s) for s in range(8)])
        t = tier.stats()
    assert t.host_capacity_blocks == 6 and t.host_blocks == 6
    assert t.host_evictions > 0 and t.host.store_blocks == 6 + t.host_evictions


def test_evictions_are_copied_out_only_as_far_as_the_host_tier_takes_them(
    tiny_llama: Path, reference: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    """Every evicted block was copied into one pinned buffer per step, however many: a long
    prompt's admission took gigabytes of page-locked memory, for blocks the host tier
    already held or would push out again on arrival."""
    with KVTiers(host_capacity_bytes=3 * 2048, pin_host=False) as tier:
        eng = engine(tiny_llama, tier, num_kv_blocks=16)
        real, sizes = eng.runner.export_blocks_async, []

        def counted(block_ids: Sequence[int]) -> object:
            sizes.append(len(block_ids))
            return real(block_ids)

        eng.runner.export_blocks_async = counted  # type: ignore[method-assign]
        prompts = [prompt(s) for s in range(6)] + [prompt(5)] * 2
        got = serve(eng, prompts)
        t = tier.stats()
    assert got == reference(prompts)
    assert sizes and max(sizes) <= 3  # the host tier's slots, not the step's evictions
    # Only blocks it did not hold were copied (a held one's age is refreshed in place).
    assert sum(s for s in sizes if s) == t.host.store_blocks + t.host.drops


def test_a_failed_copy_out_of_evicted_blocks_loses_the_offloads_not_the_loads(
    tiny_llama: Path, reference: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    """The copy out and the loads in failed together: out of pinned memory for the evicted
    rows, the step's tier loads (perhaps a long prefix just fetched) were recomputed, and
    their requests never used the tiers again."""
    prompts = [prompt(s) for s in range(5)]
    with KVTiers(host_capacity_bytes=64 * 2048, pin_host=False) as tier:
        eng = engine(tiny_llama, tier, num_kv_blocks=16)
        serve(eng, prompts)  # prompt 0's blocks went down to the host tier
        failed = []

        def out_of_memory(block_ids: Sequence[int]) -> object:
            failed.append(len(block_ids))
            raise RuntimeError("injected: pinned allocation failed")

        eng.runner.export_blocks_async = out_of_memory  # type: ignore[method-assign]
        computed = eng.stats().num_prompt_tokens_computed
        again = serve(eng, prompts[:1])  # its loads evict other blocks in the same step
        s = eng.stats()
    assert failed  # the copy out was tried, and failed
    assert again == reference(prompts[:1])
    # The loads still came in: only the prompt's tail was computed, not all of it again.
    assert s.num_prompt_tokens_computed - computed == len(prompts[0]) - 5 * BS


@pytest.mark.parametrize("policy", ["continuous", "hybrid"])
def test_a_second_engine_loads_the_prefix_and_keeps_the_tokens(
    tiny_llama: Path,
    redis_config: RedisConfig,
    reference: Callable[[list[list[int]]], list[list[int]]],
    policy: str,
) -> None:
    # hybrid with a small budget: the tail after the loaded prefix is prefilled in chunks.
    kw = dict(policy=policy, max_num_batched_tokens=8, max_batch_size=4)
    prompts = [prompt(1, 9 * BS + 1), prompt(2)]
    with KVTiers(redis_config) as a_tier:
        serve(engine(tiny_llama, a_tier, **kw), prompts)
    with KVTiers(redis_config) as b_tier:
        b = engine(tiny_llama, b_tier, **kw)
        got = serve(b, prompts)
        assert b.stats().kv_tier_hits == 9 * BS + 5 * BS
        assert b.stats().num_prompt_tokens_computed == 1 + 2
    assert got == reference(prompts)


def test_generated_blocks_are_written_through_for_a_resumed_request(
    tiny_llama: Path,
    redis_config: RedisConfig,
    reference: Callable[[list[list[int]]], list[list[int]]],
) -> None:
    p = prompt(4)  # 22 tokens; 6 generated, 5 of them fed back: blocks 0..6 are full
    with KVTiers(redis_config) as a_tier:
        (first,) = serve(engine(tiny_llama, a_tier), [p])
    resumed = [*p, *first[:5]]  # what a replica continues from after a redelivery
    with KVTiers(redis_config) as b_tier:
        b = engine(tiny_llama, b_tier)
        assert serve(b, [resumed]) == reference([resumed])
        assert b.stats().kv_tier_hits == 6 * BS  # all but the last token: 6 full blocks


class VanishingTier:
    """Claims every block at lookup, then loses them all: the worst a tier can do (or, with
    ``claims=False``, holds nothing)."""

    accepts_stores = accepts_offloads = False

    def __init__(self, claims: bool = True) -> None:
        self.claims = claims
        self.lookups = 0
        self.counted: list[bool] = []  # each lookup's count flag

    def bind(self, model: str, seed: int, layout: object, weights_device: str = "") -> None:
        pass

    def lookup(self, hashes: Sequence[bytes], count: bool = True) -> int:
        self.lookups += 1
        self.counted.append(count)
        return len(hashes) if self.claims else 0

    def load(self, hashes: Sequence[bytes], budget_s: float | None = None) -> list[memoryview]:
        return []

    def store_async(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        pass

    def offload(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        pass

    def skipped(self, blocks: int) -> None:
        pass


@pytest.mark.parametrize("claims", [True, False], ids=["hit", "miss"])
@pytest.mark.parametrize("policy", ["continuous", "hybrid"])
def test_a_tier_that_loses_blocks_costs_recompute_and_a_waiting_head_asks_once(
    tiny_llama: Path,
    reference: Callable[[list[list[int]]], list[list[int]]],
    policy: str,
    claims: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A miss too: each step's lookup was a Redis round trip on the engine thread, and
    counted the head's tokens as queried again (the tier hit rate read low)."""
    monkeypatch.setattr(batcher_module, "TIER_LOOKUP_REUSE_S", 1e9)  # however slow the run
    tier = VanishingTier(claims)
    eng = engine(tiny_llama, tier, num_kv_blocks=16, policy=policy)  # type: ignore[arg-type]
    first, second = prompt(30, 7 * BS), prompt(31, 10 * BS)  # 7 + 10 blocks > 16: one waits
    for i, p in enumerate((first, second)):
        eng.add_request(str(i), prompt_token_ids=p, params=GREEDY)
    outs = drain_all(eng)
    assert [outs["0"], outs["1"]] == reference([first, second])
    assert eng.stats().num_prompt_tokens_computed == len(first) + len(second)
    assert tier.lookups == 2  # not once per step while "1" waited for blocks


def test_a_waiting_request_whose_device_hit_grows_is_counted_as_queried_once(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting behind a request that prefills the prefix they share, chunk by chunk: each
    chunk named grew its device hit, and each grown hit counted its tier query again (and
    skipped the reuse of the last answer), so the tiers' hit rates read low."""
    monkeypatch.setattr(batcher_module, "TIER_LOOKUP_REUSE_S", 1e9)  # however slow the run
    tier = VanishingTier(claims=False)
    eng = engine(tiny_llama, tier, num_kv_blocks=18, policy="hybrid",  # type: ignore[arg-type]
                 max_num_batched_tokens=12, max_batch_size=4)  # fmt: skip
    shared = prompt(50, 8 * BS)
    first, second = [*shared, 5, 6], shared + prompt(51, 9 * BS)
    longer = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng.add_request("0", prompt_token_ids=first, params=longer)
    eng.add_request("1", prompt_token_ids=second, params=GREEDY)  # waits for blocks
    drain_all(eng)
    # One question per admission (a preempted request asks anew), not one per grown hit.
    preempted = eng.stats().num_preemptions
    assert tier.counted.count(True) == 2 + preempted and len(tier.counted) > 2 + preempted


def test_a_device_hit_grown_into_the_tiers_answer_is_served_by_that_answer() -> None:
    """Another request naming the blocks they share grew a waiting request's device hit
    into the prefix the tier had claimed: it was asked again (a Redis round trip on the
    engine thread) for what the last answer already said."""
    from workers.engine.batcher import Batcher
    from workers.engine.block_pool import BlockPool
    from workers.engine.request import Request

    tier = VanishingTier(claims=True)
    pool = BlockPool(64, BS, watermark=0.0)
    batcher = Batcher(pool, "hybrid", 4, 64, kv_tier=tier)  # type: ignore[arg-type]
    req = Request(request_id="r", prompt_token_ids=prompt(60, 9 * BS), params=GREEDY)
    assert batcher._tier_lookup(req, 0) == 8 * BS  # the last block is always computed
    assert batcher._tier_lookup(req, 3) == 5 * BS  # 3 of them on the device now
    assert tier.lookups == 1


class RaisingTier(VanishingTier):
    """Breaks the tier's promise not to raise: in ``lookup`` or in ``load``."""

    def __init__(self, raises_in: str) -> None:
        super().__init__(claims=True)
        self.raises_in = raises_in

    def lookup(self, hashes: Sequence[bytes], count: bool = True) -> int:
        found = super().lookup(hashes, count)
        if self.raises_in == "lookup":
            raise ConnectionError("injected: lookup")
        return found

    def load(self, hashes: Sequence[bytes], budget_s: float | None = None) -> list[memoryview]:
        raise ConnectionError("injected: load")


@pytest.mark.parametrize("raises_in", ["lookup", "load"])
def test_a_tier_that_raises_is_a_miss_not_a_request_lost_with_its_blocks(
    tiny_llama: Path, reference: Callable[[list[list[int]]], list[list[int]]], raises_in: str
) -> None:
    """A load that raised after admission had taken the request out of the waiting queue
    left it in neither queue, holding its blocks, never finished (the step raised)."""
    eng = engine(tiny_llama, RaisingTier(raises_in), policy="hybrid")  # type: ignore[arg-type]
    p = prompt(40, 6 * BS)
    eng.add_request("r", prompt_token_ids=p, params=GREEDY)
    outs = drain_all(eng)
    assert outs["r"] == reference([p])[0]
    assert eng.pool.num_used_blocks == 0


def test_a_waiting_heads_tier_answer_is_asked_again_after_a_while(tiny_llama: Path) -> None:
    """Reused for TIER_LOOKUP_REUSE_S only: another node may store the prefix meanwhile."""
    tier = VanishingTier(claims=False)
    eng = engine(tiny_llama, tier, num_kv_blocks=16, policy="continuous")  # type: ignore[arg-type]
    now = [100.0]
    eng.batcher.clock = eng.batcher.timer = lambda: now[0]
    eng.add_request("0", prompt_token_ids=prompt(30, 7 * BS), params=GREEDY)
    eng.add_request("1", prompt_token_ids=prompt(31, 10 * BS), params=GREEDY)
    eng.step()
    eng.step()
    assert tier.lookups == 2 and len(eng.batcher.waiting) == 1
    queried = eng.batcher.tier_query_tokens
    now[0] += batcher_module.TIER_LOOKUP_REUSE_S + 0.5
    eng.step()
    assert tier.lookups == 3
    # Asked again, not counted again: hits count once, and each re-ask of a waiting head
    # divided the tiers' hit rates by one more.
    assert tier.counted == [True, True, False] and eng.batcher.tier_query_tokens == queried


def test_a_corrupt_block_is_recomputed_and_counted(
    tiny_llama: Path,
    redis_config: RedisConfig,
    reference: Callable[[list[list[int]]], list[list[int]]],
) -> None:
    p = prompt(3)
    with KVTiers(redis_config) as a_tier:
        serve(engine(tiny_llama, a_tier), [p])
        ident = a_tier.identity
    assert ident is not None
    key = ident.key(hash_chain(p, BS)[2])
    client = redis.Redis.from_url(redis_config.url)
    client.set(key, b"\x00" * 100)
    client.close()
    with KVTiers(redis_config) as b_tier:
        b = engine(tiny_llama, b_tier)
        assert serve(b, [p]) == reference([p])
        assert b.stats().kv_tier_hits == 2 * BS  # the blocks before the garbage
        assert b_tier.stats().redis.corrupt == 1


def test_redis_dying_mid_run_costs_recomputation_not_requests(
    tiny_llama: Path,
    fresh_redis_server: Callable[..., RedisServer],
    reference: Callable[[list[list[int]]], list[list[int]]],
) -> None:
    server = fresh_redis_server()
    config = RedisConfig(url=server.url, socket_timeout_s=0.2)
    prompts = [prompt(s) for s in range(10, 14)]
    breaker = CircuitBreaker(failures_to_open=1, open_s=0.3)
    with KVTiers(config, breaker=breaker) as tier:
        eng = engine(tiny_llama, tier)
        assert serve(eng, prompts[:1]) == reference(prompts[:1])
        for i, p in enumerate(prompts[1:]):  # three in flight together when Redis dies
            eng.add_request(f"late{i}", prompt_token_ids=p, params=GREEDY)
        first = {d.request_id: d.token_ids for d in eng.step()}
        server.kill()
        outs = drain_all(eng)
        outs = {rid: first.get(rid, []) + tokens for rid, tokens in outs.items()}
        assert [outs[f"late{i}"] for i in range(3)] == reference(prompts[1:])
        s = tier.stats()
        assert s.breaker_opens == 1 and s.redis.errors >= 1 and s.redis.drops > 0
        server.restart()
        time.sleep(0.35)
        assert serve(eng, [prompt(20)]) == reference([prompt(20)])  # written through again
        assert tier.flush()
    with KVTiers(config) as other:
        b = engine(tiny_llama, other)
        assert serve(b, [prompt(20)]) == reference([prompt(20)])
        assert b.stats().kv_tier_hits == 5 * BS


@pytest.mark.parametrize("policy", ["hybrid", "continuous", "static"])
def test_a_step_whose_tier_load_fails_recomputes_the_loads_and_serves_everyone(
    tiny_llama: Path,
    reference: Callable[[list[list[int]]], list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
) -> None:
    """A swap that raised (out of memory for a staging copy) failed the step, and with it
    every request of the batch; before that, tier hits named in the device cache when
    scheduled and never copied in were hit by the next request with that prefix (garbage,
    no error). Now the loading request recomputes, without the tier, and the others go on."""
    p, others = prompt(1, 3 * BS + 1), [prompt(s, 3 * BS + 1) for s in (2, 3)]
    with KVTiers(host_capacity_bytes=64 * 2048, pin_host=False) as tier:
        eng = engine(tiny_llama, tier, num_kv_blocks=8, policy=policy)
        serve(eng, [p, *others])  # the others' blocks evict p's to the host tier
        real = eng.runner.import_blocks
        calls = {"loads": 0}

        def failing_once(*args: object) -> object:
            if not calls["loads"]:  # the first swap that brings tier hits in
                calls["loads"] = len(args[0])  # type: ignore[arg-type]
                raise RuntimeError("injected: swap failed")
            return real(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(eng.runner, "import_blocks", failing_once)
        short = [7, 8, 9]  # decoding alongside (static: admitted in the same batch)
        eng.add_request("a", prompt_token_ids=short, params=GREEDY)
        eng.add_request("b", prompt_token_ids=p, params=GREEDY)
        got: dict[str, list[int]] = {}
        for _ in range(40):  # bounded: a request stuck or creeping would keep it unfinished
            if not eng.has_unfinished():
                break
            for d in eng.step():  # the failing swap raises nothing
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert calls["loads"] and not eng.has_unfinished()
        assert got["b"] == reference([p])[0] and got["a"] == reference([short])[0]
        (again,) = serve(eng, [p])  # no block named over bytes that never arrived
        assert eng.pool.num_used_blocks == 0
    assert again == reference([p])[0]


class RecordingTier(VanishingTier):
    """Holds nothing, takes every write-through, and notes when each arrived."""

    accepts_stores = True

    def __init__(self) -> None:
        super().__init__(claims=False)
        self.eng_steps: Callable[[], int] = lambda: -1
        self.stores: list[tuple[int, list[bytes], np.ndarray]] = []
        self.dropped = 0

    def skipped(self, blocks: int) -> None:
        self.dropped += blocks

    def store_async(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        self.stores.append((self.eng_steps(), list(hashes), data.copy()))


@pytest.mark.parametrize("async_output", [False, True])
def test_write_through_hands_blocks_over_after_their_copy_and_before_the_engine_idles(
    tiny_llama: Path, async_output: bool
) -> None:
    """A step's filled blocks are copied off the device behind the step and handed to the
    tier at a later step (reading them at once made the host wait for the whole step on
    the device). Every full block arrives once, in order, holding what a synchronous
    export of the cache reads; the engine is not idle until the last has been handed over."""
    tier = RecordingTier()
    eng = engine(tiny_llama, tier, num_kv_blocks=32, async_output=async_output)  # type: ignore[arg-type]
    tier.eng_steps = lambda: eng.num_steps
    p = prompt(40, 3 * BS)  # 3 full blocks at prefill, 1 more after 4 decodes (6 generated)
    eng.add_request("r", prompt_token_ids=p, params=GREEDY)
    tokens: list[int] = []
    finished = False
    while eng.has_unfinished():
        for delta in eng.step():
            tokens += delta.token_ids
            finished |= delta.finished
    full = (len(p) + len(tokens) - 1) // BS  # the last token is never fed back
    names = hash_chain([*p, *tokens][: full * BS], BS)
    assert [h for _, hashes, _ in tier.stores for h in hashes] == names
    assert all(step >= 1 for step, _, _ in tier.stores)  # not during the prefill step (0)
    assert finished  # and, the loop over, every block handed over (below)
    cached = {b.block_hash: b.block_id for b in eng.pool.blocks if b.block_hash is not None}
    rows = np.concatenate([data for _, _, data in tier.stores])
    assert np.array_equal(rows, eng.runner.export_blocks([cached[h] for h in names]))


def test_a_failed_step_drops_its_pending_write_through_and_counts_it(tiny_llama: Path) -> None:
    """Exports waiting for their copy when a step fails are given up (a device in a sticky
    error state fails every wait: kept, they held the engine "unfinished", spinning)."""
    tier = RecordingTier()
    eng = engine(tiny_llama, tier, num_kv_blocks=32)  # type: ignore[arg-type]
    eng.add_request("r", prompt_token_ids=prompt(41, 3 * BS), params=GREEDY)
    eng.step()  # the prefill: 3 full blocks exported, handed over at the next step
    assert len(eng._exports) == 1 and tier.stores == []

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device error")

    eng.runner.execute = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device error"):
        eng.step()
    assert eng._exports == [] and tier.dropped == 3 and tier.stores == []
    eng.abort("r")
    eng.step()
    assert not eng.has_unfinished()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "params",
    [
        [GREEDY],
        # Filters, min_tokens and greedy rows in one batch: every host-to-device copy of
        # their parameters is queued, none waits for the step (torch.tensor(..., device=)
        # and boolean-mask indexing did).
        [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=6, seed=1),
         SamplingParams(temperature=0.7, min_p=0.05, min_tokens=4, max_tokens=6)],
    ],
    ids=["greedy", "mixed"],
)  # fmt: skip
def test_a_step_that_fills_blocks_returns_while_the_device_still_runs_it(
    params: list[SamplingParams],
) -> None:
    """Write-through must not synchronise: with asynchronous output the host schedules the
    next step while the device runs this one (a ``.cpu()`` of the export waited for it)."""
    tier = RecordingTier()
    eng = LLMEngine(
        EngineArgs("dummy:llama-1b", device="cuda", dtype="bfloat16", block_size=16,
                   num_kv_blocks=512, max_batch_size=32, max_num_batched_tokens=8192,
                   async_output=True),
        kv_tier=tier,  # type: ignore[arg-type]
    )  # fmt: skip
    for i in range(32):  # a 4,096-token prefill
        eng.add_request(str(i), prompt_token_ids=prompt(i, 128), params=params[i % len(params)])
    # A second of device work queued first: a host that is slow to queue the step cannot
    # see it done already, and any wait inside step() would wait this out too.
    torch.cuda._sleep(int(2e9))
    eng.step()
    assert not torch.cuda.current_stream().query()  # still running: nobody waited
    assert tier.stores == []
    while eng.has_unfinished():
        eng.step()
    assert sum(len(hashes) for _, hashes, _ in tier.stores) == 32 * ((128 + 5) // 16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_step_makes_the_host_wait_for_the_device() -> None:
    """Asynchronous output's point: the host prepares a step while the device runs the one
    before. Filters, min_tokens, greedy rows, write-through and host-tier offloads (the
    prefix cache full, blocks evicted every step) together: torch reports any implicit
    synchronisation (a blocking copy, nonzero, .item()) as an error here, logprobs and
    penalties included."""
    with KVTiers(host_capacity_bytes=256 << 20) as tier:
        eng = LLMEngine(
            EngineArgs("dummy:llama-1b", device="cuda", dtype="bfloat16", block_size=16,
                       num_kv_blocks=96, max_batch_size=8, async_output=True),
            kv_tier=tier,
        )  # fmt: skip
        mixed = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=6),
                 SamplingParams(temperature=0.7, min_p=0.05, min_tokens=4, max_tokens=6,
                                logprobs=2, presence_penalty=0.5, repetition_penalty=1.1)]  # fmt: skip
        for round_ in range(2):  # the first fills the cache, the second evicts it
            for i in range(8):
                eng.add_request(f"{round_}-{i}", prompt_token_ids=prompt(10 * round_ + i, 160),
                                params=mixed[i % 3])  # fmt: skip
            eng.step()  # compiles what is new; then every step must queue, not wait
            torch.cuda.set_sync_debug_mode("error")
            try:
                while eng.has_unfinished():
                    eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert tier.stats().host.store_blocks > 0  # offloads happened, asynchronously too


def test_a_request_that_loads_from_the_tier_times_the_load_for_its_trace(
    tiny_llama: Path, redis_config: RedisConfig
) -> None:
    """The worker's trace shows a "kv load" phase from these (issue #7's KV lookup/load
    span); a request with no tier hit has none."""
    from workers.tracing import _phases

    p = prompt(50)

    def metrics(eng: LLMEngine) -> object:
        eng.add_request("x", prompt_token_ids=p, params=GREEDY)
        out = None
        while eng.has_unfinished():
            for delta in eng.step():
                out = delta.output or out
        assert out is not None
        return out.metrics

    with KVTiers(redis_config) as a_tier:
        computed = metrics(engine(tiny_llama, a_tier))
    with KVTiers(redis_config) as b_tier:
        loaded = metrics(engine(tiny_llama, b_tier))
    assert computed.kv_load_start is None  # type: ignore[attr-defined]
    assert "kv load" not in [name for name, _, _ in _phases(computed, time.time() - 60)]
    start, took = loaded.kv_load_start, loaded.kv_load_s  # type: ignore[attr-defined]
    assert start is not None and 0 < took < 5
    assert start <= loaded.first_scheduled_time  # type: ignore[attr-defined]
    phases = {name: (a, b) for name, a, b in _phases(loaded, start - 1)}
    assert phases["kv load"] == (start, start + took)
    # The queue ends as the load begins: it ran to the scheduling, over the load, before.
    assert phases["queue"] == (start - 1, start)


def test_a_write_through_copy_that_fails_costs_the_blocks_not_the_step(tiny_llama: Path) -> None:
    """The copy off the device failing (out of memory for it) after the step's tokens were
    committed left its requests computed but never sampled: stalled, the engine unfinished."""
    tier = RecordingTier()
    eng = engine(tiny_llama, tier, num_kv_blocks=32)  # type: ignore[arg-type]

    def no_memory(ids: object) -> None:
        raise torch.cuda.OutOfMemoryError("no room for the copy")

    eng.runner.export_blocks_async = no_memory  # type: ignore[method-assign,assignment]
    eng.add_request("r", prompt_token_ids=prompt(42, 3 * BS), params=GREEDY)
    tokens = drain_all(eng)["r"]
    assert len(tokens) == GREEDY.max_tokens and tier.dropped >= 3 and tier.stores == []


def test_flush_exports_hands_pending_copies_over_now(tiny_llama: Path) -> None:
    tier = RecordingTier()
    eng = engine(tiny_llama, tier, num_kv_blocks=32)  # type: ignore[arg-type]
    eng.add_request("r", prompt_token_ids=prompt(43, 3 * BS), params=GREEDY)
    eng.step()  # the prefill's 3 full blocks wait for the next step's hand-over
    assert tier.stores == [] and len(eng._exports) == 1
    eng.flush_exports()
    assert [len(hashes) for _, hashes, _ in tier.stores] == [3] and eng._exports == []


def test_blocks_are_offered_for_write_through_only_as_far_as_the_tier_has_room(
    tiny_llama: Path,
) -> None:
    """The tier's room check said yes with room for one block, and a step's copies still on
    their way were not counted: several steps' blocks were copied off the device only to be
    dropped on arrival. Now each request's leading blocks up to the room are offered, the
    rest counted as skipped."""
    from workers.engine.engine import _Export

    class Room(RecordingTier):
        store_room_blocks = 2

    tier = Room()
    eng = engine(tiny_llama, tier, num_kv_blocks=32)  # type: ignore[arg-type]
    p = prompt(44, 3 * BS)
    eng.add_request("r", prompt_token_ids=p, params=GREEDY)
    eng.step()  # the prefill fills 3 blocks: 2 offered, 1 skipped
    eng.flush_exports()
    assert [hashes for _, hashes, _ in tier.stores] == [hash_chain(p, BS)[:2]]
    assert tier.dropped == 1

    class InFlight:  # a copy that has not landed yet
        def query(self) -> bool:
            return False

    eng._exports.append(_Export([b"x" * 16], torch.zeros(1, 1, dtype=torch.uint8), InFlight()))  # type: ignore[arg-type]
    assert eng._store_budget() == 1  # the room less what is on its way
    eng._exports.clear()


def test_the_store_room_in_blocks_follows_the_queue_and_the_breaker(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    import os
    import signal

    server = fresh_redis_server()
    assert server.pid is not None
    breaker = CircuitBreaker(failures_to_open=1, open_s=30.0)
    config = RedisConfig(url=server.url, socket_timeout_s=2.0)
    with KVTiers(config, breaker=breaker) as tiers:
        LLMEngine(EngineArgs("dummy:tiny", dtype="float32", block_size=BS, num_kv_blocks=8),
                  kv_tier=tiers)  # binds the tier: its block size is known  # fmt: skip
        row = tiers.block_bytes
        tiers.store_queue_bytes = 3 * row
        assert tiers.store_room_blocks == 3
        os.kill(server.pid, signal.SIGSTOP)  # the write stays queued while Redis is silent
        try:
            tiers.store_async([b"a" * 16], np.zeros((1, row), dtype=np.uint8))
            assert tiers.store_room_blocks == 2
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert tiers.flush() and tiers.store_room_blocks == 3
        breaker.failure()
        assert tiers.store_room_blocks == 0
