"""The KV tiers as the engine sees them: synchronous calls by block hash.

``KVTiers`` implements the engine's ``KVTier`` protocol (``workers.engine.block_pool``):

- ``lookup(hashes) -> int``: the longest prefix of ``hashes`` held below the device cache,
  host memory (G2) first, then Redis (G3);
- ``load(hashes) -> list[memoryview]``: their bytes, possibly fewer (a value can vanish or
  turn out corrupt between lookup and load: the engine recomputes the rest);
- ``store_async(hashes, data)``: write-through to Redis; returns at once. A bounded queue
  (in bytes) takes the batch, or drops it and counts the drop: decode never waits on Redis;
- ``offload(hashes, data)``: blocks the device cache evicted, into host memory.

The engine thread is synchronous, so Redis runs on an asyncio loop in a thread of its own;
``lookup``/``load`` wait for it (admission needs the answer), stores do not. No method
raises: a failure is a miss, counted (see :class:`~kvstore.metrics.TierStats`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from common.config import RedisConfig
from kvstore.codec import CorruptBlock, decode_block, encode_blocks
from kvstore.host_tier import HostTier
from kvstore.identity import CacheLayout, KVIdentity, KVLayout, model_fingerprint
from kvstore.metrics import TierCounters, TierStats, snapshot
from kvstore.redis_tier import CircuitBreaker, RedisTier

log = logging.getLogger(__name__)

T = TypeVar("T")
_Fetched = tuple[list[memoryview], bool, int]  # views, all of them, corrupt values


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it comes with uvicorn[standard]): its transports copy less,
    so less CPU per GB moved (``bench/kvtier.py``, ``event_loop``); asyncio otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _spans(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into at most ``parts`` contiguous pieces (one per codec thread)."""
    step = max(1, -(-n // max(1, parts)))
    return [range(i, min(i + step, n)) for i in range(0, n, step)]


class KVTiers:
    """G2 (``host_capacity_bytes`` of host memory; 0 = none) and G3 (``redis``; None = none).

    Call :meth:`bind` (the engine does, with its model and cache layout) before anything
    else, and :meth:`close` at the end.
    """

    def __init__(
        self,
        redis: RedisConfig | None = None,
        host_capacity_bytes: int = 0,
        *,
        pin_host: bool = True,
        store_queue_bytes: int = 256 << 20,
        batch_bytes: int = 8 << 20,
        breaker: CircuitBreaker | None = None,
        codec_threads: int = 2,
        checksum: str = "blake2b",
    ) -> None:
        self.redis_config = redis
        self.host_capacity_bytes = host_capacity_bytes
        self.pin_host = pin_host
        self.store_queue_bytes = store_queue_bytes
        self.batch_bytes = batch_bytes
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.checksum = checksum  # what stores write; loads accept either kind
        self.codec_threads = codec_threads
        self.identity: KVIdentity | None = None
        self.host: HostTier | None = None
        self.redis: RedisTier | None = None
        self.host_counters = TierCounters()
        self.redis_counters = TierCounters()
        # Checksums run here: hashlib releases the GIL, so they overlap socket work.
        self._codec = ThreadPoolExecutor(codec_threads, thread_name_prefix="kv-codec")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the queue figure changes on both threads
        self._queued_bytes = 0
        self._block_tokens = 0
        # A wait for Redis that outlives every socket timeout: the loop itself is stuck.
        self._wait_s = 30.0 if redis is None else max(5.0, 20 * redis.socket_timeout_s)

    # --- set-up --------------------------------------------------------------------------

    def bind(self, model: str, seed: int, layout: CacheLayout) -> None:
        """Fix the key namespace (model and layout fingerprints) and start the tiers.

        ``layout`` is the engine's ``KVCacheLayout`` (any object with its fields).
        """
        kv_layout = KVLayout(
            block_size=layout.block_size,
            dtype=layout.dtype,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            quant=getattr(layout, "quant", "none"),
            tp_rank=getattr(layout, "tp_rank", 0),
            tp_size=getattr(layout, "tp_size", 1),
        )
        self.identity = KVIdentity(model_fingerprint(model, seed), kv_layout)
        self._block_tokens = layout.block_size
        if self.host_capacity_bytes > 0:
            self.host = HostTier(self.host_capacity_bytes, kv_layout.block_bytes, self.pin_host)
        if self.redis_config is not None:
            loop = _new_loop()
            self._loop = loop
            self._thread = threading.Thread(target=loop.run_forever, name="kv-redis", daemon=True)
            self._thread.start()
            config, identity = self.redis_config, self.identity

            async def make() -> RedisTier:
                return RedisTier(config, identity, self.breaker, self.batch_bytes)

            self.redis = self._wait(make())
        log.info(
            "kv tiers: prefix %s, host %d blocks, redis %s",
            self.identity.key_prefix.decode(),
            self.host.num_slots if self.host else 0,
            self.redis_config.url if self.redis_config else "off",
        )

    @property
    def accepts_stores(self) -> bool:
        """Worth handing newly filled blocks to :meth:`store_async`."""
        return self.redis is not None

    @property
    def accepts_offloads(self) -> bool:
        """Worth handing evicted device blocks to :meth:`offload`."""
        return self.host is not None and self.host.num_slots > 0

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._wait_s)
        except TimeoutError:
            # Every socket timeout has passed: the loop itself is stuck. Stop asking it.
            future.cancel()
            self.breaker.failure()
            raise

    # --- the engine's calls --------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Longest prefix of ``hashes`` in host memory, then Redis."""
        if not hashes:
            return 0
        bt = self._block_tokens
        n = 0
        if self.host is not None:
            self.host_counters.query_tokens += len(hashes) * bt
            n = self.host.prefix(hashes)
        rest = hashes[n:]
        if rest and self.redis is not None:
            self.redis_counters.query_tokens += len(rest) * bt
            if not self.breaker.rejecting():
                try:
                    n += self._wait(self.redis.prefix(rest))
                except Exception as exc:  # the loop is stuck or gone: a miss, never an error
                    self.redis_counters.errors += 1
                    log.warning("kv tiers: lookup failed: %r", exc)
        return n

    def load(self, hashes: Sequence[bytes]) -> list[memoryview]:
        """Bytes of the longest loadable prefix of ``hashes`` (views, read-only)."""
        out: list[memoryview] = []
        bt = self._block_tokens
        if self.host is not None:
            t0 = time.perf_counter()
            for h in hashes:
                view = self.host.get(h)
                if view is None:
                    break
                out.append(view)
            if out:
                c = self.host_counters
                c.loads += 1
                c.hit_tokens += len(out) * bt
                c.load_bytes += sum(v.nbytes for v in out)
                c.load_s += time.perf_counter() - t0
        rest = hashes[len(out) :]
        if rest and self.redis is not None and not self.breaker.rejecting():
            out.extend(self._load_redis(rest))
        return out

    def _load_redis(self, hashes: Sequence[bytes]) -> list[memoryview]:
        c = self.redis_counters
        t0 = time.perf_counter()
        try:
            parts = self._wait(self._fetch(hashes))
        except Exception as exc:
            c.errors += 1
            log.warning("kv tiers: load failed: %r", exc)
            return []
        out: list[memoryview] = []
        for views, complete, corrupt in parts:
            out.extend(views)
            c.corrupt += corrupt
            if not complete:
                break  # a miss or a bad block ends the usable prefix
        if out:
            c.loads += 1
            c.hit_tokens += len(out) * self._block_tokens
            c.load_bytes += len(out) * (self.redis.value_bytes if self.redis else 0)
            c.load_s += time.perf_counter() - t0
        return out

    async def _fetch(self, hashes: Sequence[bytes]) -> list[_Fetched]:
        """MGET sub-batches in parallel; each is verified on a codec thread as soon as it
        arrives, while the others are still on the wire. Per sub-batch: the views up to
        the first miss or corrupt value, whether it got them all, and the corrupt count."""
        assert self.redis is not None and self.identity is not None
        redis, layout, layout_fp = self.redis, self.identity.layout, self.identity.layout_fp
        loop = asyncio.get_running_loop()

        def decode(values: list[bytes | None], names: Sequence[bytes]) -> _Fetched:
            views: list[memoryview] = []
            for value, name in zip(values, names, strict=True):
                if value is None:
                    return views, False, 0
                try:
                    views.append(decode_block(value, layout, layout_fp, name))
                except CorruptBlock as exc:
                    log.warning("kv tiers: corrupt block %s: %s", name.hex(), exc)
                    return views, False, 1
            return views, True, 0

        async def one(names: Sequence[bytes]) -> _Fetched:
            values = await redis.get(names)
            return await loop.run_in_executor(self._codec, decode, values, names)

        step = redis.batch_blocks
        spans = [hashes[i : i + step] for i in range(0, len(hashes), step)]
        return list(await asyncio.gather(*(one(names) for names in spans)))

    def store_async(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        """Write blocks through to Redis in the background; ``data`` is uint8
        ``[len(hashes), block bytes]`` and belongs to the tiers from now on.

        No "already stored" memory: the engine computes a block only after the tiers
        missed it, and Redis may have lost it since (eviction, TTL, restart).
        """
        if self.redis is None or self._loop is None or not len(hashes):
            return
        c = self.redis_counters
        if self.breaker.rejecting():
            c.drops += len(hashes)
            return
        nbytes = data.nbytes
        with self._lock:
            if self._queued_bytes + nbytes > self.store_queue_bytes:
                c.drops += len(hashes)
                return
            self._queued_bytes += nbytes
        asyncio.run_coroutine_threadsafe(self._store(list(hashes), data, nbytes), self._loop)

    async def _store(self, hashes: list[bytes], data: np.ndarray, nbytes: int) -> None:
        assert self.redis is not None and self.identity is not None
        c = self.redis_counters
        t0 = time.perf_counter()
        stored = 0
        try:
            loop = asyncio.get_running_loop()
            ident, kind = self.identity, self.checksum
            parts = await asyncio.gather(
                *(
                    loop.run_in_executor(
                        self._codec,
                        encode_blocks,
                        ident.layout,
                        ident.layout_fp,
                        hashes[span.start : span.stop],
                        data[span.start : span.stop],
                        kind,
                    )
                    for span in _spans(len(hashes), self.codec_threads)
                )
            )
            stored = await self.redis.set(hashes, [v for part in parts for v in part])
        except Exception as exc:  # encoding bugs must not kill the loop either
            c.errors += 1
            log.warning("kv tiers: store failed: %r", exc)
        finally:
            with self._lock:
                self._queued_bytes -= nbytes
        if stored:
            c.stores += 1
            c.store_blocks += stored
            c.store_bytes += stored * self.redis.value_bytes
            c.store_s += time.perf_counter() - t0
        c.drops += len(hashes) - stored

    def offload(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        """Keep blocks the device cache is about to overwrite in host memory."""
        if self.host is None:
            return
        c = self.host_counters
        t0 = time.perf_counter()
        for i, h in enumerate(hashes):
            if self.host.put(h, data[i]):
                c.store_blocks += 1
                c.store_bytes += self.host.block_bytes
            else:
                c.drops += 1
        c.stores += 1
        c.store_s += time.perf_counter() - t0

    # --- telemetry and shutdown ----------------------------------------------------------

    def stats(self) -> TierStats:
        redis = snapshot(self.redis_counters)
        if self.redis is not None:
            redis.errors += self.redis.num_failures
        return TierStats(
            host=snapshot(self.host_counters),
            redis=redis,
            host_blocks=self.host.num_blocks if self.host else 0,
            host_capacity_blocks=self.host.num_slots if self.host else 0,
            host_evictions=self.host.num_evictions if self.host else 0,
            breaker_state=self.breaker.state,
            breaker_opens=self.breaker.num_opens,
            store_queue_bytes=self._queued_bytes,
        )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued store is written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queued_bytes > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Finish queued stores (briefly), then stop the Redis loop and the codec threads."""
        loop, self._loop = self._loop, None
        if loop is not None:
            self.flush(timeout_s=5.0)
            if self.redis is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self.redis.close(), loop).result(5.0)
                except Exception as exc:  # a dead server or a stuck loop: nothing to save
                    log.warning("kv tiers: closing redis: %r", exc)
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(5.0)
            if not loop.is_running():
                loop.close()
        self._codec.shutdown(wait=True)

    def __enter__(self) -> KVTiers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
