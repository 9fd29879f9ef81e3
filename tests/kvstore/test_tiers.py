"""The sync tier interface against a real redis-server: write-through, lookup, load, and every
failure (garbage, truncation, another layout, a full queue, a dead server) is a counted miss."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from common.config import RedisConfig
from common.services import RedisServer, free_port
from kvstore.identity import KVLayout
from kvstore.redis_tier import CircuitBreaker
from kvstore.tiers import KVTiers

LAYOUT = KVLayout(block_size=4, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)
HASHES = [bytes([i]) * 16 for i in range(6)]


def blocks(n: int, seed: int = 0, layout: KVLayout = LAYOUT) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, layout.block_bytes), dtype=np.uint8)


def make(config: RedisConfig, layout: KVLayout = LAYOUT, **kw: object) -> KVTiers:
    tiers = KVTiers(config, **kw)  # type: ignore[arg-type]
    tiers.bind("dummy:tiny", 0, layout)
    return tiers


@pytest.fixture
def tiers(redis_config: RedisConfig) -> Iterator[KVTiers]:
    with make(redis_config) as t:
        yield t


def test_blocks_written_by_one_node_load_on_another(
    tiers: KVTiers, redis_config: RedisConfig
) -> None:
    data = blocks(4)
    tiers.store_async(HASHES[:4], data)
    assert tiers.flush()
    with make(redis_config) as other:
        assert other.lookup(HASHES) == 4  # the chain stops at the first block not stored
        loaded = other.load(HASHES[:4])
        assert [bytes(v) for v in loaded] == [bytes(r) for r in data]
        s = other.stats().redis
        assert s.hit_tokens == 4 * LAYOUT.block_size and s.query_tokens == 6 * 4
    assert tiers.stats().redis.store_blocks == 4
    assert tiers.identity is not None
    client = redis.Redis.from_url(redis_config.url)
    assert 0 < client.ttl(tiers.identity.key(HASHES[0])) <= redis_config.ttl_s
    client.close()


def test_garbage_or_truncated_values_under_real_keys_are_counted_misses(
    tiers: KVTiers, redis_config: RedisConfig
) -> None:
    tiers.store_async(HASHES[:4], blocks(4))
    assert tiers.flush()
    assert tiers.identity is not None
    raw = redis.Redis.from_url(redis_config.url)
    raw.set(tiers.identity.key(HASHES[1]), b"not a block")
    value = raw.get(tiers.identity.key(HASHES[3]))
    assert isinstance(value, bytes)
    raw.set(tiers.identity.key(HASHES[3]), value[:-7])
    raw.close()
    assert tiers.lookup(HASHES) == 4  # present, but ...
    assert len(tiers.load(HASHES[:4])) == 1  # ... only the block before the garbage loads
    assert len(tiers.load(HASHES[2:4])) == 1  # the truncated one is refused too
    assert tiers.stats().redis.corrupt == 2


def test_another_block_size_or_dtype_sees_none_of_the_keys(
    tiers: KVTiers, redis_config: RedisConfig
) -> None:
    tiers.store_async(HASHES[:3], blocks(3))
    assert tiers.flush()
    for other_layout in (
        KVLayout(block_size=8, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8),
        KVLayout(block_size=4, dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8),
    ):
        with make(redis_config, other_layout) as other:
            assert other.lookup(HASHES[:3]) == 0
            assert other.load(HASHES[:3]) == []


def test_a_full_store_queue_drops_and_counts_instead_of_blocking(
    redis_config: RedisConfig,
) -> None:
    with make(redis_config, store_queue_bytes=3 * LAYOUT.block_bytes) as tiers:
        t0 = time.perf_counter()
        for i in range(20):  # far more than the queue holds until Redis acknowledges
            tiers.store_async([bytes([100 + i]) * 16, bytes([200 + i]) * 16], blocks(2, i))
        assert time.perf_counter() - t0 < 0.5
        assert tiers.flush()
        s = tiers.stats().redis
        assert s.drops > 0
        assert s.drops + s.store_blocks == 40


def test_a_batch_larger_than_the_queue_stores_its_leading_blocks(
    redis_config: RedisConfig,
) -> None:
    """A long prompt fills more blocks in one step than the queue holds: its first blocks,
    the prefix other requests share, still go through; only the rest is dropped."""
    with make(redis_config, store_queue_bytes=3 * LAYOUT.block_bytes) as tiers:
        tiers.store_async(HASHES[:5], blocks(5))
        assert tiers.flush()
        s = tiers.stats().redis
        assert (s.store_blocks, s.drops) == (3, 2)
        assert tiers.lookup(HASHES[:5]) == 3


def test_stores_are_not_asked_for_when_the_queue_has_no_room_for_a_block(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    """A queue with room for less than a block would drop every block offered: the engine
    must not copy them off the device for that."""
    server = fresh_redis_server()
    assert server.pid is not None
    config = RedisConfig(url=server.url, socket_timeout_s=2.0)
    with make(config, store_queue_bytes=LAYOUT.block_bytes * 3 // 2) as tiers:
        assert tiers.accepts_stores
        os.kill(server.pid, signal.SIGSTOP)  # the write stays queued while Redis is silent
        try:
            tiers.store_async(HASHES[:1], blocks(1))
            assert not tiers.accepts_stores  # half a block of room left
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert tiers.flush()
        assert tiers.accepts_stores and tiers.stats().redis.store_blocks == 1


def test_breaker_opens_while_redis_is_down_and_hits_resume_after_restart(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    server = fresh_redis_server()
    config = RedisConfig(url=server.url, socket_timeout_s=0.2)
    breaker = CircuitBreaker(failures_to_open=1, open_s=0.2)
    with make(config, breaker=breaker) as tiers:
        tiers.store_async(HASHES[:2], blocks(2))
        assert tiers.flush() and tiers.lookup(HASHES[:2]) == 2
        server.kill()
        t0 = time.perf_counter()
        assert tiers.lookup(HASHES[:2]) == 0  # the failure that opens the breaker
        assert tiers.stats().breaker_state == "open"
        for _ in range(20):  # while open: immediate misses and dropped stores, no waits
            assert tiers.lookup(HASHES[:2]) == 0 and tiers.load(HASHES[:2]) == []
            tiers.store_async(HASHES[2:3], blocks(1))
        assert time.perf_counter() - t0 < 1.0
        s = tiers.stats()
        assert s.breaker_opens == 1 and s.redis.errors >= 1 and s.redis.drops >= 20
        server.restart()
        time.sleep(0.25)  # the breaker lets a probe through after open_s
        tiers.store_async(HASHES[:2], blocks(2))  # the restarted server has no data
        assert tiers.flush()
        assert tiers.lookup(HASHES[:2]) == 2 and len(tiers.load(HASHES[:2])) == 2
        assert tiers.stats().breaker_state == "closed"


def test_a_hung_redis_times_out_once_then_the_breaker_answers_at_once(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    server = fresh_redis_server()
    assert server.pid is not None
    config = RedisConfig(url=server.url, socket_timeout_s=0.2)
    breaker = CircuitBreaker(failures_to_open=1, open_s=30.0)
    with make(config, breaker=breaker) as tiers:
        tiers.store_async(HASHES[:2], blocks(2))
        assert tiers.flush() and tiers.lookup(HASHES[:2]) == 2
        os.kill(server.pid, signal.SIGSTOP)  # alive but silent: only timeouts tell
        try:
            t0 = time.perf_counter()
            assert tiers.lookup(HASHES[:2]) == 0
            first = time.perf_counter() - t0
            errors = tiers.stats().redis.errors
            for _ in range(10):
                assert tiers.lookup(HASHES[:2]) == 0 and tiers.load(HASHES[:2]) == []
            assert first > 0.1  # the one timeout (socket_timeout_s 0.2) ...
            assert tiers.stats().redis.errors == errors  # ... and no other: the breaker is open
            assert tiers.stats().breaker_state == "open"
        finally:
            os.kill(server.pid, signal.SIGCONT)


def test_breaker_probes_once_after_the_open_period_and_backs_off_on_failure() -> None:
    now = [0.0]
    b = CircuitBreaker(failures_to_open=2, open_s=1.0, max_open_s=3.0, clock=lambda: now[0])
    b.failure()
    assert b.allow() and b.state == "closed"
    b.failure()
    assert b.state == "open" and not b.allow() and b.rejecting()
    now[0] = 1.0
    assert b.allow() and not b.allow()  # one probe at a time
    b.failure()  # the probe failed: open for twice as long
    now[0] = 2.5
    assert not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.num_opens == 1


def test_small_lookups_that_pass_do_not_hide_loads_that_fail() -> None:
    """A link that passes the tiny EXPIRE lookups and times out on 2 MiB loads: each load
    stalls the engine, so the breaker must open although every lookup in between passes."""
    now = [0.0]
    b = CircuitBreaker(failures_to_open=2, open_s=1.0, clock=lambda: now[0])
    b.failure()  # a load timed out
    b.success(light=True)  # the next admission's lookup passed
    b.failure()  # and its load timed out again
    assert b.state == "open"
    now[0] = 1.0
    assert b.allow()  # a lookup takes the probe...
    b.success(light=True)
    assert b.state == "half_open" and b.allow()  # ...and hands it on to a load or a store
    b.success()
    assert b.state == "closed"


def test_only_answers_of_calls_let_through_in_the_current_state_move_the_breaker() -> None:
    """A slow store let through before the breaker opened, answering after: its success
    closed the breaker with Redis still down (and its failure re-opened a half-open one
    whose probe was still out, doubling the wait). Only the probe decides now."""
    now = [0.0]
    b = CircuitBreaker(failures_to_open=1, open_s=1.0, clock=lambda: now[0])
    slow_ok, slow_bad, failing = b.allow(), b.allow(), b.allow()
    assert slow_ok and slow_bad and failing
    b.failure(failing)
    assert b.state == "open"
    b.success(slow_ok)  # from before the outage: says nothing about now
    assert b.state == "open" and not b.allow()
    now[0] = 1.0
    probe = b.allow()
    assert probe and b.state == "half_open"
    b.failure(slow_bad)  # nor does this one
    assert b.state == "half_open" and not b.allow()  # the probe is still out
    b.success(probe)
    assert b.state == "closed"
    fresh = b.allow()
    b.failure(probe)  # answered twice, or late: ignored
    assert b.state == "closed"
    b.failure(fresh)
    assert b.state == "open"


def test_calls_in_flight_together_that_fail_count_as_one_failure() -> None:
    """One stall of the server (a fork for a snapshot, a slow command) failed both writer
    threads' sub-batches at once: two "consecutive" failures, and the breaker opened on
    one event, every lookup and load missing meanwhile."""
    now = [0.0]
    b = CircuitBreaker(failures_to_open=2, open_s=1.0, clock=lambda: now[0])
    first, second = b.allow(), b.allow()  # two writers' sub-batches, in flight together
    now[0] = 0.5  # the stall ends both by the socket timeout
    b.failure(first)
    b.failure(second)
    assert b.state == "closed"
    later = b.allow()  # issued after that failure: a failure of its own
    now[0] = 1.0
    b.failure(later)
    assert b.state == "open"


def test_a_value_longer_than_a_block_is_a_counted_miss_and_loads_go_on(
    tiers: KVTiers, redis_config: RedisConfig
) -> None:
    tiers.store_async(HASHES[:3], blocks(3))
    assert tiers.flush()
    assert tiers.identity is not None
    raw = redis.Redis.from_url(redis_config.url)
    value = raw.get(tiers.identity.key(HASHES[1]))
    assert isinstance(value, bytes)
    raw.set(tiers.identity.key(HASHES[1]), value + b"extra")
    raw.close()
    assert len(tiers.load(HASHES[:3])) == 1
    assert tiers.stats().redis.corrupt == 1
    assert [bytes(v) for v in tiers.load(HASHES[2:3])] == [bytes(blocks(3)[2])]


def test_a_load_of_many_sub_batches_returns_them_in_order(redis_config: RedisConfig) -> None:
    # Sub-batches of two blocks run on several reader threads; the prefix stays in order.
    with make(redis_config, batch_bytes=2 * (LAYOUT.block_bytes + 64)) as tiers:
        hashes = [bytes([50 + i]) * 16 for i in range(11)]
        data = blocks(11, seed=3)
        tiers.store_async(hashes, data)
        assert tiers.flush()
        assert tiers.lookup(hashes) == 11
        assert [bytes(v) for v in tiers.load(hashes)] == [bytes(r) for r in data]
        assert tiers.stats().redis.store_blocks == 11


@pytest.mark.parametrize("path", ["store", "lookup"])
def test_a_probe_that_fails_with_a_bug_not_redis_leaves_the_breaker_able_to_close(
    redis_config: RedisConfig, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The breaker's one probe raises something that is not a Redis error (an encoding bug):
    it counts as the probe failing (a lookup answers a miss, not an exception into the
    engine's step), and a later probe can still close the breaker."""
    import kvstore.tiers as tiers_module

    breaker = CircuitBreaker(failures_to_open=1, open_s=0.1)
    with make(redis_config, breaker=breaker) as tiers:
        tiers.store_async(HASHES[:2], blocks(2))
        assert tiers.flush()
        breaker.failure()  # open: as after a Redis outage
        time.sleep(0.15)  # the next call is the probe

        def bug(*args: object, **kwargs: object) -> bytes:
            raise ValueError("an encoding bug")

        assert tiers.identity is not None
        if path == "store":
            monkeypatch.setattr(tiers_module, "block_header", bug)
            tiers.store_async(HASHES[2:3], blocks(1))
            assert tiers.flush()
        else:
            monkeypatch.setattr(type(tiers.identity), "key", bug)
            assert tiers.lookup(HASHES[:2]) == 0  # a miss, not the bug raised
        monkeypatch.undo()
        assert tiers.stats().redis.errors >= 1
        assert tiers.stats().breaker_state == "open"  # the probe failed: open again
        time.sleep(0.3)  # past the doubled open period: another probe
        assert tiers.lookup(HASHES[:2]) == 2  # a small call: it hands the probe on
        assert len(tiers.load(HASHES[:2])) == 2  # and a load's success closes it
        assert tiers.stats().breaker_state == "closed"


def test_the_engine_is_not_asked_for_blocks_the_tier_would_drop(redis_config: RedisConfig) -> None:
    """While the breaker rejects (or the store queue is full) the engine skips copying
    newly filled blocks off the device: they would be dropped on arrival."""
    breaker = CircuitBreaker(failures_to_open=1, open_s=0.1)
    with make(redis_config, breaker=breaker, store_queue_bytes=LAYOUT.block_bytes) as tiers:
        assert tiers.accepts_stores
        breaker.failure()
        assert not tiers.accepts_stores
        time.sleep(0.15)
        assert tiers.lookup(HASHES[:1]) == 0  # a probe Redis answers: a store may probe next
        assert tiers.accepts_stores
        tiers.skipped(3)  # what the engine did not offer meanwhile counts as dropped
        assert tiers.stats().redis.drops == 3


def test_a_host_tier_load_keeps_the_prefix_head_for_the_next_request() -> None:
    """Loading a prefix left its first block the least recently used: the next offload
    evicted it and the rest of the prefix became unreachable (lookups stop at the head)."""
    with KVTiers(None, host_capacity_bytes=4 * LAYOUT.block_bytes, pin_host=False) as tiers:
        tiers.bind("dummy:tiny", 0, LAYOUT)
        data = blocks(5)
        for i in reversed(range(4)):  # evicted tail first, as the device cache does
            tiers.offload([HASHES[i]], data[i : i + 1])
        assert len(tiers.load(HASHES[:4])) == 4
        tiers.offload([HASHES[4]], data[4:5])
        assert tiers.lookup(HASHES[:4]) == 3


def test_a_closed_tier_answers_misses_and_counts_drops_without_raising(
    redis_config: RedisConfig,
) -> None:
    """An engine thread that outlived its worker's stop called into a closed tier: the
    thread pools raised RuntimeError, where every method promises a miss or a drop."""
    tiers = make(redis_config)
    tiers.close()
    tiers.store_async(HASHES[:2], blocks(2))
    assert tiers.load(HASHES[:2]) == []
    assert tiers.stats().redis.drops == 2


def test_with_a_shared_secret_a_value_planted_without_it_is_a_counted_miss(
    redis_config: RedisConfig,
) -> None:
    """One who can write to Redis, but lacks the workers' secret, writes a well-formed
    value (valid crc32) under a prompt's key: without a secret it loaded as that prompt's
    KV; with one it is a corrupt block, a miss, and the workers' own values still load."""
    from kvstore.codec import encode_block

    secured = redis_config.model_copy(update={"kv_mac_secret": "shared by the workers"})
    with make(secured) as writer, make(secured) as reader:
        data = blocks(2, seed=5)
        writer.store_async(HASHES[:2], data)
        assert writer.flush()
        assert [bytes(v) for v in reader.load(HASHES[:2])] == [bytes(r) for r in data]
        ident = reader.identity
        assert ident is not None
        planted = encode_block(ident.layout, ident.value_fp, HASHES[2], blocks(1, seed=9)[0].data)
        raw = redis.Redis.from_url(redis_config.url)
        raw.set(ident.key(HASHES[2]), planted)
        raw.close()
        assert reader.load(HASHES[2:3]) == []
        assert reader.stats().redis.corrupt == 1
    with make(redis_config) as open_reader:  # without the secret: keys of its own, so the
        assert open_reader.lookup(HASHES[:2]) == 0  # two never reject and overwrite each other


@contextlib.contextmanager
def proxied(redis_config: RedisConfig, db: int = 0, **settings: object) -> Iterator[Any]:
    """(a TCP proxy in front of ``redis_config``'s server, the config through it on ``db``
    with ``settings``); the proxy closed on the way out."""
    from tests.reliability.tcp_proxy import TcpProxy

    host, port = redis_config.url.removeprefix("redis://").split("/")[0].split(":")
    proxy = TcpProxy(host, int(port)).start()
    try:
        url = f"redis://127.0.0.1:{proxy.port}/{db}"
        yield proxy, redis_config.model_copy(update={"url": url, **settings})
    finally:
        proxy.close()


@contextlib.contextmanager
def throttled_tiers(redis_config: RedisConfig, hashes: list[bytes]) -> Iterator[KVTiers]:
    """Tiers reading ``hashes`` (32 blocks, stored and found) through a link that moves
    8 KiB a second, so their load would take 4 s, the load's own budget ~0.9 s
    (redis.load_min_gbps 1e-4). Closed on the way out, timed: a load that freed its readers
    leaves no trickle to wait for (~3 s more)."""
    with proxied(redis_config, load_min_gbps=1e-4) as (proxy, slow):
        with make(redis_config) as writer:
            writer.store_async(hashes, blocks(len(hashes), seed=hashes[0][0]))
            assert writer.flush()
        tiers = make(slow)
        try:
            assert tiers.lookup(hashes) == 32
            proxy.throttle(8 * 1024)
            yield tiers
        finally:
            t0 = time.monotonic()
            tiers.close()
            assert time.monotonic() - t0 < 1.5


def test_a_load_slower_than_its_budget_is_given_up_and_frees_its_reader(
    redis_config: RedisConfig,
) -> None:
    """A Redis slow but never silent (a throttled link: every read gets a few bytes within
    the socket timeout) held the engine, and every decode in its batch, for the whole load:
    no timeout fired and the breaker stayed closed. Now a load keeps to its budget (the
    bytes at redis.load_min_gbps), keeps what arrived, and aborts the rest's reads."""
    hashes = [bytes([7, i]) * 8 for i in range(32)]
    with throttled_tiers(redis_config, hashes) as tiers:
        budget = tiers.load_budget_s(32)
        assert 0.8 < budget < 1.0
        t0 = time.monotonic()
        loaded = tiers.load(hashes)
        took = time.monotonic() - t0
        assert took < budget + 1.0 and len(loaded) < 32  # margins for a loaded CI machine
        assert tiers.stats().redis.errors == 1


def test_a_load_cut_by_its_engine_steps_time_is_no_redis_failure(
    redis_config: RedisConfig,
) -> None:
    """The step's other loads took their time (the engine hands a load what is left): the
    load keeps to it, keeps what came, and frees its readers, but Redis was not slower
    than redis.load_min_gbps: no error, no breaker failure. Its time is counted with the
    loads, as every load's is, found something or not."""
    hashes = [bytes([8, i]) * 8 for i in range(32)]
    with throttled_tiers(redis_config, hashes) as tiers:
        tiers.breaker._failures = 1  # an earlier load, too slow: still counted after this
        t0 = time.monotonic()
        loaded = tiers.load(hashes, budget_s=0.2)
        took = time.monotonic() - t0
        assert took < 0.2 + 0.6 and len(loaded) < 32  # margins for a loaded CI machine
        stats = tiers.stats().redis
        # Neither a failure nor a success: a cut load says nothing of the rate (a success
        # cleared the failures of a Redis too slow, which then never opened).
        assert stats.errors == 0 and tiers.breaker._failures == 1
        assert stats.loads == 1 and stats.load_s >= 0.2


def test_stores_the_server_refuses_pause_storing_and_say_why_while_reads_go_on(
    fresh_redis_server: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A full Redis (noeviction) refuses every SET with -OOM. Counted as a success, every
    computed block was still copied off the device and sent, for nothing; counted through
    the breaker, two refused batches shut lookups and loads too, while the server still
    held an hour's hot prefixes and served them."""
    server = fresh_redis_server(extra_config="maxmemory 2mb\nmaxmemory-policy noeviction")
    breaker = CircuitBreaker(failures_to_open=2, open_s=30.0)
    with caplog.at_level("WARNING"), make(RedisConfig(url=server.url), breaker=breaker) as tiers:
        tiers.store_async(HASHES[:2], blocks(2))  # stored while there was room
        assert tiers.flush()
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            for i in range(100_000):  # small values: full to the last kilobyte
                client.set(f"filler:{i}", b"x" * 1024)
        for i in range(1, 3):  # (the filler's connection stays: closed, it frees memory)
            tiers.store_async(HASHES[2 * i : 2 * i + 2], blocks(2))
            assert tiers.flush()
        client.close()
        s = tiers.stats()
        assert s.redis.errors == 1 and s.redis.store_blocks == 2  # the second was not sent
        assert not tiers.accepts_stores  # the engine stops copying blocks off for them
        assert s.breaker_state == "closed"
        assert tiers.lookup(HASHES[:2]) == 2 and len(tiers.load(HASHES[:2])) == 2
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "OOM" in refused[0]  # the cause, not only the state


def test_a_read_only_redis_still_serves_lookups_and_loads_and_pauses_stores(
    fresh_redis_server: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Lookups refresh TTLs with EXPIRE, a write: a read-only replica (a demoted primary
    after a failover) refused it, two lookups opened the breaker, and loads that the
    server would still have served were skipped, the breaker flapping on store probes."""
    server = fresh_redis_server()
    breaker = CircuitBreaker(failures_to_open=2, open_s=30.0)
    with caplog.at_level("WARNING"), make(RedisConfig(url=server.url), breaker=breaker) as tiers:
        tiers.store_async(HASHES[:2], blocks(2))
        assert tiers.flush()
        client = redis.Redis.from_url(server.url)
        client.replicaof("127.0.0.1", str(free_port()))  # a primary that is not there
        try:
            for _ in range(3):
                assert tiers.lookup(HASHES[:2]) == 2
            assert len(tiers.load(HASHES[:2])) == 2
            assert tiers.stats().breaker_state == "closed"
            assert not tiers.accepts_stores  # the engine stops copying blocks off for them
        finally:
            client.replicaof("NO", "ONE")
            client.close()
    refused = [r.getMessage() for r in caplog.records if "refused EXPIRE" in r.getMessage()]
    assert len(refused) == 1 and "READONLY" in refused[0]


def test_a_silent_redis_is_reported_as_such_not_as_a_slow_one(
    fresh_redis_server: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A socket timeout inside a load is a TimeoutError too: it read as "slower than
    redis.load_min_gbps", sending operators after bandwidth when Redis had gone silent."""
    server = fresh_redis_server()
    assert server.pid is not None
    config = RedisConfig(url=server.url, socket_timeout_s=0.2, load_min_gbps=1e-6)
    with make(config) as tiers:
        tiers.store_async(HASHES[:2], blocks(2))
        assert tiers.flush() and tiers.lookup(HASHES[:2]) == 2
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with caplog.at_level("WARNING"):
                assert tiers.load(HASHES[:2]) == []  # budget: 0.2 s + ~2 s of bytes
        finally:
            os.kill(server.pid, signal.SIGCONT)
    assert "load failed" in caplog.text and "slower than" not in caplog.text


def test_stores_cancelled_at_close_are_counted_as_dropped(
    fresh_redis_server: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close whose flush timed out cancelled the queued stores without a word: the queue
    read non-empty for good and the lost blocks showed in no counter."""
    server = fresh_redis_server()
    assert server.pid is not None
    config = RedisConfig(url=server.url, socket_timeout_s=0.5)
    tiers = make(config, write_threads=1, batch_bytes=LAYOUT.block_bytes)
    os.kill(server.pid, signal.SIGSTOP)  # the first write hangs; the rest wait behind it
    try:
        tiers.store_async(HASHES, blocks(len(HASHES)))
        monkeypatch.setattr(tiers, "flush", lambda timeout_s=10.0: False)  # gave up waiting
        tiers.close()
    finally:
        os.kill(server.pid, signal.SIGCONT)
    stats = tiers.stats()
    assert stats.store_queue_bytes == 0
    assert stats.redis.drops + stats.redis.store_blocks == len(HASHES)


def test_a_block_the_host_tier_holds_already_is_refreshed_not_counted_as_stored() -> None:
    """A host hit evicted from the device again is offered again: nothing is copied, and
    counting it as stored inflated the host's store bytes and GB/s."""
    with KVTiers(None, host_capacity_bytes=4 * LAYOUT.block_bytes, pin_host=False) as tiers:
        tiers.bind("dummy:tiny", 0, LAYOUT)
        data = blocks(2)
        tiers.offload(HASHES[:2], data)
        tiers.offload(HASHES[:2], data)
        host = tiers.stats().host
    assert (host.store_blocks, host.store_bytes) == (2, 2 * LAYOUT.block_bytes)


def looked_up_then_lost_by_the_host(tiers: KVTiers) -> np.ndarray:
    """Six blocks stored, four of them in host memory when looked up, then pushed out of it
    by other blocks: the blocks' data."""
    data = blocks(6)
    tiers.store_async(HASHES, data)
    assert tiers.flush()
    tiers.offload(HASHES[:4], data[:4])
    assert tiers.lookup(HASHES) == 6  # four in host memory, the last two in Redis
    tiers.offload([bytes([9, i]) * 8 for i in range(4)], blocks(4, seed=1))  # host lost all
    return data


def test_blocks_the_host_lost_between_lookup_and_load_count_as_queried_at_redis(
    redis_config: RedisConfig,
) -> None:
    with make(redis_config, host_capacity_bytes=4 * LAYOUT.block_bytes, pin_host=False) as tiers:
        data = looked_up_then_lost_by_the_host(tiers)
        loaded = tiers.load(HASHES)
        assert [bytes(v) for v in loaded] == [bytes(r) for r in data]
        s = tiers.stats()
        assert s.host.hit_tokens == 0 and s.host.query_tokens == 6 * 4
        assert s.redis.hit_tokens == 6 * 4
        assert s.redis.query_tokens == 6 * 4  # 2 blocks at lookup, 4 more at load


def test_a_long_prompts_load_budget_stays_under_the_stuck_engine_limit(
    redis_config: RedisConfig,
) -> None:
    """Llama-3-8B bf16 (2 MiB blocks of 16 tokens), a 128k prompt: 8,191 blocks at the
    default 0.25 GB/s got a 69 s budget inside one engine step, past the worker's 60 s
    stuck-engine limit: the worker handed its requests back and exited, then the next."""
    from kvstore.tiers import MAX_LOAD_S

    llama8b = KVLayout(block_size=16, dtype="bfloat16", num_layers=32, num_kv_heads=8,
                       head_dim=128)  # fmt: skip
    with make(redis_config, layout=llama8b) as tiers:
        assert tiers.value_bytes >= 2 << 20
        assert tiers.load_budget_s(8) < MAX_LOAD_S  # a short prefix keeps its own budget
        assert tiers.load_budget_s(8191) == MAX_LOAD_S
    assert 3 * MAX_LOAD_S < 60.0  # the worker's default --engine-stuck-s


def test_the_tier_opens_no_more_connections_than_redis_max_connections(
    redis_config: RedisConfig,
) -> None:
    """The pool was 4 readers + 2 writers + the lookup's whatever max_connections said: an
    operator sizing maxclients from it hit the limit, and the refusals opened the breaker."""
    client = redis.Redis.from_url(redis_config.url)

    def connected() -> int:
        return int(client.info("clients")["connected_clients"]) - 1  # less this client

    hashes = [bytes([9, i]) * 8 for i in range(64)]
    try:
        base = connected()
        # A generous socket timeout: the load's budget is one timeout plus the bytes, and on
        # a loaded CI machine (two cores, the whole suite) 64 loads through three
        # connections ran past the default once; the connections are what is checked.
        config = redis_config.model_copy(update={"max_connections": 3, "socket_timeout_s": 20.0})
        with make(config, batch_bytes=1) as tiers:  # one block per sub-batch: all threads busy
            for _ in range(3):
                tiers.store_async(hashes, blocks(64, seed=5))
                assert tiers.flush()
                assert tiers.lookup(hashes) == 64 and len(tiers.load(hashes)) == 64
            assert connected() - base <= 3
    finally:
        client.close()


def test_stores_that_go_through_do_not_clear_the_failures_of_loads_too_slow() -> None:
    """A link slow enough that every load runs past its budget, while stores (no deadline)
    still finish: each store cleared the loads' failures, so the breaker never opened and
    every load held the engine's step for its whole budget."""
    now = [0.0]
    b = CircuitBreaker(failures_to_open=2, open_s=1.0, clock=lambda: now[0])
    for _ in range(2):
        load, store = b.allow(), b.allow()
        now[0] += 0.1
        b.success(store, write=True)
        b.failure(load, "slower than redis.load_min_gbps")
    assert b.state == "open"
    # Half-open, a store that goes through is the probe's answer: it closes the breaker.
    now[0] += 1.0
    probe = b.allow()
    assert b.state == "half_open" and probe is not None
    b.success(probe, write=True)
    assert b.state == "closed"


def test_two_failures_far_apart_do_not_open_the_breaker() -> None:
    """Stores that go through do not clear the failure count (loads too slow must still
    open it), so in a group that rarely loads, two stalls of the server hours apart (two
    snapshot forks) opened it, dropping stores and lookups for nothing."""
    now = [0.0]
    b = CircuitBreaker(failures_to_open=2, open_s=1.0, clock=lambda: now[0])
    b.failure(b.allow())
    now[0] += 3600.0
    b.failure(b.allow())
    assert b.state == "closed"
    now[0] += 1.0
    b.failure(b.allow())  # soon after: the same trouble
    assert b.state == "open"


def test_a_lookup_answered_by_a_trickle_gives_up_within_one_socket_timeout(
    redis_config: RedisConfig,
) -> None:
    """A lookup runs in the engine's step; its reply read a few bytes at a time, each
    within the socket timeout, held the step for as long as the server liked (3 s here).
    Now the whole reply must come within one socket timeout: past it, a miss and a
    failure the breaker counts; the spoiled connection is not reused."""
    hashes = [bytes([8, i]) * 8 for i in range(32)]
    with proxied(redis_config, socket_timeout_s=0.5) as (proxy, slow):
        with make(redis_config) as writer:
            writer.store_async(hashes, blocks(len(hashes), seed=8))
            assert writer.flush()
        with make(slow) as tiers:
            assert tiers.lookup(hashes) == 32  # a quick link: found
            proxy.throttle(40, piece=4)  # 128 bytes of reply: 3.2 s, 4 bytes every 0.1 s
            t0 = time.monotonic()
            assert tiers.lookup(hashes) == 0
            assert time.monotonic() - t0 < 1.5
            assert tiers.stats().redis.errors == 1
            proxy.restore()
            assert tiers.lookup(hashes) == 32  # a fresh connection, the same answer


def test_a_lookup_that_opens_its_connection_counts_the_log_in_against_its_deadline(
    redis_config: RedisConfig,
) -> None:
    """The deadline started once a connection was in hand: one opened for the lookup (the
    last one spoiled by a trickle) read its log-in's replies a byte at a time, each within
    the socket timeout, on the engine's thread."""
    hashes = [bytes([6, i]) * 8 for i in range(4)]
    # db 1: the connection's log-in sends SELECT, whose reply the link trickles.
    with (
        proxied(redis_config, db=1, socket_timeout_s=0.5) as (proxy, slow),
        make(slow) as tiers,
    ):
        proxy.throttle(4, piece=1)  # "+OK\r\n": a byte every 0.25 s
        t0 = time.monotonic()
        assert tiers.lookup(hashes) == 0
        assert time.monotonic() - t0 < 1.2
        assert tiers.stats().redis.errors == 1
