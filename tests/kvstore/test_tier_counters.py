"""What the KV-tier counters say: each token queried and hit once, and store time that
compares with load time (the tiers' hit rates and GB/s on the dashboards)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from common.config import RedisConfig
from kvstore.bulk_io import BulkConnection
from kvstore.tiers import KVTiers
from tests.kvstore.test_tiers import HASHES, LAYOUT, blocks, looked_up_then_lost_by_the_host
from workers.engine.batcher import Batcher
from workers.engine.block_pool import BlockPool
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams

BS = LAYOUT.block_size


def make(config: RedisConfig | None, **kw: object) -> KVTiers:
    tiers = KVTiers(config, **kw)  # type: ignore[arg-type]
    tiers.bind("dummy:tiny", 0, LAYOUT)
    return tiers


class HostLosingTail(KVTiers):
    """Host memory whose prefix loses its last ``lose`` blocks to other requests' offloads
    between the lookup and the load (the first load only)."""

    def __init__(self, capacity_blocks: int, lose: int) -> None:
        super().__init__(None, host_capacity_bytes=capacity_blocks * LAYOUT.block_bytes,
                         pin_host=False)  # fmt: skip
        self.lose = lose

    def load(self, hashes: Sequence[bytes], budget_s: float | None = None) -> list[memoryview]:
        # A lookup left the prefix's head the most recently used: its tail goes first.
        others = [bytes([200, i]) * 8 for i in range(self.lose)]
        self.offload(others, blocks(self.lose, seed=1))
        self.lose = 0
        return super().load(hashes)


def test_a_whole_prompt_sent_back_to_wait_after_a_short_load_is_counted_once() -> None:
    """A tier load came back short and the rest did not fit the step: the request waited,
    and when it came back the blocks that had loaded were counted again as device hits
    (after counting as host hits) and its tokens were queried of the tier a second time."""
    tiers = HostLosingTail(capacity_blocks=24, lose=20)
    tiers.bind("dummy:tiny", 0, LAYOUT)
    pool = BlockPool(64, BS, watermark=0.0)
    b = Batcher(pool, "continuous", 4, 16, 0.0, kv_tier=tiers)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    short = Request(request_id="a", prompt_token_ids=[1] * 10, params=greedy)
    long = Request(request_id="b", prompt_token_ids=list(range(2, 102)), params=greedy)
    held = pool.update_hashes(long)[:24]  # all but the last block, which is computed
    tiers.offload(held[::-1], blocks(24)[::-1])  # evicted tail first, as the device does
    b.add(short)
    b.add(long)

    plan = b.schedule()  # 4 blocks load, the other 80 tokens wait for a step of their own
    assert [r.request_id for r in plan.requests] == ["a"] and b.waiting == [long]
    assert len(plan.kv_loads) == 4
    b.commit(plan)
    plan = b.schedule()  # back first in line: a step of its own, its load's blocks a hit
    assert [r.request_id for r in plan.requests] == ["b"]
    assert plan.num_tokens == 100 - 4 * BS
    queried = 2 * BS + 24 * BS  # a's two full blocks (none held), b's 24
    host = tiers.stats().host
    assert (b.tier_query_tokens, host.query_tokens) == (queried, queried)
    assert (b.tier_hit_tokens, host.hit_tokens) == (4 * BS, 4 * BS)
    # The device cache: both prompts queried once, the loaded blocks no device hit.
    assert (pool.prefix_queries, pool.prefix_hits) == (10 + 100, 0)
    assert long.num_cached_tokens == 4 * BS


def test_a_load_that_starts_inside_a_lookups_host_prefix_counts_what_the_host_lost(
    redis_config: RedisConfig,
) -> None:
    """The batcher loads from its grown device hit, inside the range it looked up: the
    lookup's host prefix, kept under its first block only, was not found, so the blocks
    the host lost meanwhile were loaded from Redis without being queried there (Redis hits
    above its queries), and the answer stayed to be counted by a later load."""
    with make(redis_config, host_capacity_bytes=4 * LAYOUT.block_bytes, pin_host=False) as tiers:
        data = looked_up_then_lost_by_the_host(tiers)
        loaded = tiers.load(HASHES[2:])  # the first two are on the device by now
        assert [bytes(v) for v in loaded] == [bytes(r) for r in data[2:]]
        s = tiers.stats().redis
        assert s.hit_tokens == 4 * BS
        assert s.query_tokens == 4 * BS  # 2 blocks at lookup, 2 the host lost
        # A load its lookup did not count (an answer reused) counts no queries.
        assert len(tiers.load(HASHES)) == 6
        assert tiers.stats().redis.query_tokens == 4 * BS


def test_store_time_is_the_wall_time_the_writers_were_busy(
    redis_config: RedisConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers side by side each counted their sub-batches' time: store time read
    twice the wall time, and store GB/s half of what went over the wire (loads count
    their wall time)."""
    pause = 0.05
    overlapped = threading.Event()
    running = [0]
    lock = threading.Lock()
    set_many = BulkConnection.set_many

    def slow(self: BulkConnection, *args: object, **kw: object) -> tuple[int, str]:
        with lock:
            running[0] += 1
            if running[0] > 1:
                overlapped.set()
        time.sleep(pause)
        with lock:
            running[0] -= 1
        return set_many(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(BulkConnection, "set_many", slow)
    with make(redis_config, write_threads=2, batch_bytes=1) as tiers:  # a block a sub-batch
        t0 = time.perf_counter()
        tiers.store_async(HASHES[:4] + [bytes([7, i]) * 8 for i in range(4)], blocks(8))
        assert tiers.flush()
        wall = time.perf_counter() - t0
        s = tiers.stats().redis
    assert overlapped.is_set() and s.store_blocks == 8
    assert 4 * pause <= s.store_s <= wall
