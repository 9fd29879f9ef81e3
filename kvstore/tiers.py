"""The KV tiers as the engine sees them: synchronous calls by block hash.

``KVTiers`` implements the engine's ``KVTier`` protocol (``workers.engine.block_pool``):

- ``lookup(hashes) -> int``: the longest prefix of ``hashes`` held below the device cache,
  host memory (G2) first, then Redis (G3);
- ``load(hashes) -> list[memoryview]``: their bytes, possibly fewer (a value can vanish or
  turn out corrupt between lookup and load: the engine recomputes the rest);
- ``store_async(hashes, data)``: write-through to Redis; returns at once. A bounded queue
  (in bytes) takes the batch, or drops it and counts the drop: decode never waits on Redis;
- ``offload(hashes, data)``: blocks the device cache evicted, into host memory.

Redis is spoken over blocking connections (:mod:`kvstore.bulk_io`): lookups (one EXPIRE
pipeline) on the engine's thread, loads and stores in sub-batches on small thread pools,
MGET replies landing straight in numpy rows and SETs sent from the engine's rows,
checksummed on the same thread. redis.asyncio on a loop thread copied each value three
times on that one thread, which capped loads at about half of what loopback carries
(``bench/kvtier.py``). ``lookup``/``load`` wait (admission needs the answer), stores do
not. No method raises: a failure is a miss, counted (see :class:`~kvstore.metrics.TierStats`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np
from redis.exceptions import RedisError, ResponseError

from common.config import RedisConfig
from common.logging import redact_url
from kvstore.bulk_io import MISSING, Borrowers, BulkConnection, BulkPool
from kvstore.codec import (
    HEADER_BYTES,
    CorruptBlock,
    block_header,
    decode_block,
    mac_id,
    mac_key,
)
from kvstore.host_tier import HostTier
from kvstore.identity import CacheLayout, KVIdentity, KVLayout, model_fingerprint
from kvstore.metrics import TierCounters, TierStats, snapshot
from kvstore.redis_tier import CircuitBreaker

log = logging.getLogger(__name__)

T = TypeVar("T")
_Fetched = tuple[list[memoryview], bool, int]  # views, all of them, corrupt values
# Failures the breaker counts: the server or the network, not a bad value.
_FAILURES = (RedisError, OSError)
# Replies of a server that refuses writes but serves reads (a read-only replica, a primary
# that cannot persist or reach its replicas, one out of memory under noeviction, an ACL
# user without write commands).
WRITE_REFUSALS = ("READONLY", "MISCONF", "NOREPLICAS", "OOM", "NOPERM")
# The longest one prefix load may hold an engine step (see KVTiers.load_budget_s): well
# under the worker's stuck-engine limit (--engine-stuck-s, 60 s) with a few in one step.
MAX_LOAD_S = 10.0


# Blocks of lookups' host prefixes remembered for their loads (a request that waits for
# device blocks is asked again before it loads; one that never loads ages out).
_HOST_FOUND_KEPT = 1 << 16


class _OverBudget(Exception):
    """A load that outlasted :meth:`KVTiers.load_budget_s`."""


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
        read_threads: int = 4,
        write_threads: int = 2,
        checksum: str = "crc32",
    ) -> None:
        self.redis_config = redis
        self.host_capacity_bytes = host_capacity_bytes
        self.pin_host = pin_host
        self.store_queue_bytes = store_queue_bytes
        self.batch_bytes = batch_bytes
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.checksum = checksum  # what stores write; loads take crc32 or blake2b alike
        secret = redis.kv_mac_secret if redis is not None else None
        # Set: stores write authenticated values, loads take nothing else.
        self._mac_key = mac_key(secret) if secret else b""
        self.identity: KVIdentity | None = None
        self.host: HostTier | None = None
        self.host_counters = TierCounters()
        self.redis_counters = TierCounters()
        # One connection per I/O thread: sockets, zlib and hashlib release the GIL, so
        # sub-batches overlap. Readers and writers apart: a lookup's load at admission (the
        # engine waits) never queues behind a burst of write-through.
        # Within redis.max_connections, the engine thread's lookups counted (3 at least: a
        # lookup, a load, a store): operators size Redis's maxclients from it.
        if redis is not None:
            budget = max(3, redis.max_connections)
            read_threads = max(1, min(read_threads, budget - 2))
            write_threads = max(1, min(write_threads, budget - 1 - read_threads))
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="kv-read")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="kv-write")
        self._bulk = None if redis is None else BulkPool(redis, read_threads + write_threads)
        self.value_bytes = 0  # of one block in Redis, header included (known after bind)
        self.block_bytes = 0  # of one block as the engine hands it over (known after bind)
        self.batch_blocks = 1  # blocks per sub-batch: about batch_bytes
        self._lock = threading.Lock()  # the queue figure changes on both threads
        self._queued_bytes = 0
        # Redis refusing writes (OOM under noeviction, READONLY replica, MISCONF) while it
        # still serves reads: stores pause (doubling, up to a minute), lookups and loads go
        # on. Through the breaker, the refusals shut reads of an hour's hot prefixes too.
        self._stores_refused_until = 0.0
        self._store_pause_s = 0.0
        self._block_tokens = 0
        self._io = Borrowers()  # every connection in use: aborted at close
        # A counted lookup's host prefix until its load, under each of its blocks: blocks
        # the host held then and lost before the load (other requests' offloads) are asked
        # of Redis at load time, and must count as queried there or Redis hits outnumbered
        # its queries. Under each block, not the first only: a load may start inside the
        # looked-up range (the batcher reuses an answer after the device hit grew).
        self._host_found: OrderedDict[bytes, tuple[tuple[bytes, ...], int]] = OrderedDict()
        # Store sub-batches on the writer threads now, and when store_s last caught up.
        self._stores_running = 0
        self._store_busy_mark = 0.0

    # --- set-up --------------------------------------------------------------------------

    def bind(self, model: str, seed: int, layout: CacheLayout, weights_device: str = "") -> None:
        """Fix the key namespace (model and layout fingerprints) and start the tiers.

        ``layout`` is the engine's ``KVCacheLayout`` (any object with its fields);
        ``weights_device`` says what drew a dummy model's random weights.
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
            compute_dtype=getattr(layout, "compute_dtype", ""),
        )
        self.identity = KVIdentity(
            model_fingerprint(model, seed, weights_device), kv_layout,
            mac_id(self._mac_key) if self._mac_key else "",
        )  # fmt: skip
        self._block_tokens = layout.block_size
        if self.host_capacity_bytes > 0:
            self.host = HostTier(self.host_capacity_bytes, kv_layout.block_bytes, self.pin_host)
        self.block_bytes = kv_layout.block_bytes
        self.value_bytes = HEADER_BYTES + kv_layout.block_bytes
        # Big values in few commands, never one huge reply; sub-batches run in parallel.
        self.batch_blocks = max(1, self.batch_bytes // self.value_bytes)
        log.info(
            "kv tiers: prefix %s, host %d blocks, redis %s",
            self.identity.key_prefix.decode(),
            self.host.num_slots if self.host else 0,
            redact_url(self.redis_config.url) if self.redis_config else "off",
        )

    @property
    def accepts_stores(self) -> bool:
        """Worth handing newly filled blocks to :meth:`store_async`: not while the breaker
        rejects or the queue is full, when the engine would wait on the device to copy
        blocks out only for them to be dropped."""
        return (
            self._bulk is not None
            and not self.breaker.rejecting()
            and not self._stores_refused()
            # room for a block: with less, every block offered would be dropped on arrival
            and self._queued_bytes + self.block_bytes <= self.store_queue_bytes
        )

    @property
    def store_room_blocks(self) -> int:
        """Blocks the store queue can take now (0 while stores are not accepted)."""
        if not self.accepts_stores or self.block_bytes <= 0:
            return 0
        return (self.store_queue_bytes - self._queued_bytes) // self.block_bytes

    @property
    def accepts_offloads(self) -> bool:
        """Worth handing evicted device blocks to :meth:`offload`."""
        return self.host is not None and self.host.num_slots > 0

    def _with_connection(
        self,
        call: Callable[[BulkConnection], T],
        group: Borrowers | None = None,
        deadline: float | None = None,
    ) -> T:
        """``call`` on a pooled connection, held in ``group`` (a load's: abandoned at its
        deadline) and the tiers' own; one that failed mid-command is closed, never reused
        (its next reply would be this one's rest)."""
        assert self._bulk is not None
        if group is not None and group.abandoned:  # not worth a pooled connection
            raise ConnectionError("kv tier I/O abandoned")
        conn = self._bulk.take(deadline)  # a new one opens by the caller's deadline
        groups = (self._io,) if group is None else (self._io, group)
        try:
            for g in groups:
                g.enter(conn)
            result = call(conn)
        except BaseException:
            conn.close()
            raise
        finally:
            for g in groups:
                g.leave(conn)
        if conn.spoiled:
            conn.close()
        else:
            self._bulk.give(conn)
        return result

    # --- the engine's calls --------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], count: bool = True) -> int:
        """Longest prefix of ``hashes`` in host memory, then Redis. ``count`` False: a
        question asked again (a request still waiting), whose tokens were counted as queried
        the first time; hits count once, at load, so counting every ask read the hit rate
        low, by as many times as the request was asked."""
        if not hashes:
            return 0
        bt = self._block_tokens
        n = 0
        if self.host is not None:
            if count:
                self.host_counters.query_tokens += len(hashes) * bt
            n = self.host.prefix(hashes)
            if count and self._bulk is not None:  # where Redis's counted queries began
                self._remember_host_prefix(hashes, n)
        rest = hashes[n:]
        if rest and self._bulk is not None:
            if count:
                self.redis_counters.query_tokens += len(rest) * bt
            n += self._redis_prefix(rest)
        return n

    def _redis_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, Redis holds (0 on any failure).

        EXPIRE answers "exists" and refreshes the TTL in one command, so blocks that keep
        being hit outlive ones that are only ever written. Refused (Redis refusing writes:
        a read-only replica, MISCONF), it is asked again by EXISTS and stores pause: through
        the breaker, a refused EXPIRE shut the reads Redis would still serve.
        """
        assert self.identity is not None and self.redis_config is not None
        leave = self.breaker.allow()
        if leave is None:
            return 0
        ttl = self.redis_config.ttl_s
        paused = self._stores_refused()

        within_s = self.redis_config.socket_timeout_s

        def ask(conn: BulkConnection) -> tuple[list[bool], str]:
            with conn.replies_by(deadline):
                return ask_within(conn)

        def ask_within(conn: BulkConnection) -> tuple[list[bool], str]:
            refusal = ""
            if not paused:  # writes are refused: no EXPIRE to be refused as well
                found, refusal = conn.expire_many(keys, ttl)
                if not refusal:
                    return found, ""
                if not refusal.startswith(WRITE_REFUSALS):  # NOAUTH and the like: a failure
                    raise ResponseError(refusal)
            found, failed = conn.exists_many(keys)  # a read: replicas answer it
            if failed:
                raise ResponseError(failed)
            return found, refusal

        try:
            keys = [self.identity.key(h) for h in hashes]
            # One socket timeout for the whole answer, opening a connection included, not
            # for each read: a lookup runs in the engine's step, and a trickling server
            # held it for as long as it liked.
            deadline = time.monotonic() + within_s
            found, refusal = self._with_connection(ask, deadline=deadline)
            if refusal and not paused:
                self._refuse_stores()
                log.warning("kv tiers: Redis refused EXPIRE (storing paused %.0f s, lookups "
                            "by EXISTS meanwhile): %s", self._store_pause_s, refusal)  # fmt: skip
        except Exception as exc:  # Redis, or a bug: a miss either way, never the batch's error
            with self._lock:  # the writer threads count errors too
                self.redis_counters.errors += 1
            self.breaker.failure(leave, exc)  # and a probe that ends here ends as a failure
            level = logging.DEBUG if isinstance(exc, _FAILURES) else logging.WARNING
            log.log(level, "kv tiers: lookup failed: %r", exc)
            return 0
        self.breaker.success(leave, light=True)
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    def load(self, hashes: Sequence[bytes], budget_s: float | None = None) -> list[memoryview]:
        """Bytes of the longest loadable prefix of ``hashes`` (views, read-only);
        ``budget_s``: the most a Redis load may take (what is left of the engine step's
        time for loads), cutting it short of :meth:`load_budget_s`."""
        out: list[memoryview] = []
        bt = self._block_tokens
        if self.host is not None:
            t0 = time.perf_counter()
            out = self.host.get_prefix(hashes)
            if out:
                c = self.host_counters
                c.loads += 1
                c.hit_tokens += len(out) * bt
                c.load_bytes += sum(v.nbytes for v in out)
                c.load_s += time.perf_counter() - t0
            lost = self._host_lost(hashes, len(out))
            if lost and self._bulk is not None:
                self.redis_counters.query_tokens += lost * bt
        rest = hashes[len(out) :]
        if rest and self._bulk is not None and not self.breaker.rejecting():
            out.extend(self._load_redis(rest, budget_s))
        return out

    def _remember_host_prefix(self, hashes: Sequence[bytes], n: int) -> None:
        """Keep a counted lookup's host prefix (its first ``n`` blocks) for its load."""
        found = self._host_found
        prefix = tuple(hashes[:n])
        for i, h in enumerate(prefix):
            found[h] = (prefix, i)
            found.move_to_end(h)
        # Counted as Redis queries now: an older lookup's host prefix must not count them
        # again at a load that starts there.
        for h in hashes[n:]:
            found.pop(h, None)
        while len(found) > _HOST_FOUND_KEPT:
            found.popitem(last=False)

    def _host_lost(self, hashes: Sequence[bytes], served: int) -> int:
        """Blocks of ``hashes`` a counted lookup found in host memory and the host no
        longer held (it ``served`` the first ones); forgets that lookup's prefix, all of
        it, so that no later load counts them again."""
        entry = self._host_found.get(hashes[0]) if hashes else None
        if entry is None:
            return 0
        prefix, start = entry
        for h in prefix:
            kept = self._host_found.get(h)
            if kept is not None and kept[0] is prefix:  # not a later lookup's
                del self._host_found[h]
        return max(0, min(len(prefix) - start, len(hashes)) - served)

    def load_budget_s(self, blocks: int) -> float:
        """How long a Redis load of ``blocks`` may take: one socket timeout plus the bytes
        at ``redis.load_min_gbps``. The engine waits for a load with every decode of its
        batch, and a Redis slow enough to need longer (throttled, congested, far away)
        costs more than recomputing: the load then keeps what arrived and gives up.

        At most ``MAX_LOAD_S``: a load runs inside an engine step, and a 128k prompt of an
        8B model (8k blocks of 2 MiB) got 69 s, past the worker's stuck-engine limit (60 s),
        which then handed its requests back and exited, and the next replica did the same.
        """
        assert self.redis_config is not None
        rate = self.redis_config.load_min_gbps * 1e9
        budget = self.redis_config.socket_timeout_s + blocks * self.value_bytes / rate
        return min(budget, MAX_LOAD_S)

    def _load_redis(self, hashes: Sequence[bytes], step_s: float | None) -> list[memoryview]:
        c = self.redis_counters
        t0 = time.perf_counter()
        leave = self.breaker.allow()
        if leave is None:
            return []
        own_s = self.load_budget_s(len(hashes))
        # Cut short by the step (its other loads took their time): what arrived counts, and
        # the breaker hears neither a failure nor a success (a cut load says nothing of the
        # rate; a success there cleared the failures of a Redis too slow, which never
        # opened, each step held for its whole budget).
        cut_by_step = step_s is not None and step_s < own_s
        budget_s = max(0.0, step_s) if step_s is not None and cut_by_step else own_s
        deadline = time.monotonic() + budget_s
        step = self.batch_blocks
        group = Borrowers()
        try:
            jobs = [
                self._readers.submit(self._fetch, hashes[i : i + step], group)
                for i in range(0, len(hashes), step)
            ]
        except RuntimeError:  # closed meanwhile: a miss, as the methods promise
            self.breaker.failure(leave)  # a probe must not stay taken
            return []
        out: list[memoryview] = []
        failed: object = None  # why the load ended early
        cut_short = False  # ended early, Redis not to blame: a miss, a bad block, the step
        for job in jobs:
            # Waited on apart from its result: a socket timeout inside the job is a
            # TimeoutError too, and is Redis gone silent, not slow.
            wait([job], timeout=max(0.0, deadline - time.monotonic()))
            try:
                if not job.done():  # slower than recomputing: what came before still counts
                    raise _OverBudget
                views, complete, corrupt = job.result()
            except _OverBudget:
                if cut_by_step:
                    cut_short = True
                    log.info(
                        "kv tiers: a Redis load of %d blocks got the %.2fs its engine step "
                        "had left for loads: %d blocks came, the rest are computed",
                        len(hashes), max(0.0, step_s or 0.0), len(out),
                    )  # fmt: skip
                    break
                failed = "slower than redis.load_min_gbps"
                log.warning(
                    "kv tiers: a Redis load of %d blocks (%.1f MiB) was slower than "
                    "redis.load_min_gbps (%g GB/s): given up after %.2fs, the rest recomputed",
                    len(hashes), len(hashes) * self.value_bytes / 2**20,
                    self.redis_config.load_min_gbps if self.redis_config else 0.0,
                    time.perf_counter() - t0,
                )  # fmt: skip
                break
            except Exception as exc:  # a failed read: what came before still counts
                failed = exc
                log.warning("kv tiers: load failed: %r", exc)
                break
            out.extend(views)
            c.corrupt += corrupt
            if not complete:
                cut_short = True
                break  # a miss or a bad block ends the usable prefix
        for job in jobs:
            job.cancel()
        if failed is not None or cut_short:
            # Free the reader threads (and their connections) that sub-batches past the
            # end still hold: the next load of this step would queue behind them.
            group.abandon()
        if failed is not None:
            with self._lock:  # the writer threads count errors too
                c.errors += 1
            self.breaker.failure(leave, failed)
        else:
            self.breaker.success(leave, light=cut_by_step)
        # Every load that reached Redis, and the time the engine waited for it, found
        # something or not: the time spent on a sick Redis is the time to see.
        c.loads += 1
        c.load_s += time.perf_counter() - t0
        if out:
            c.hit_tokens += len(out) * self._block_tokens
            c.load_bytes += len(out) * self.value_bytes
        return out

    def _fetch(self, hashes: Sequence[bytes], group: Borrowers) -> _Fetched:
        """One sub-batch on a reader thread: MGET into fresh rows, then verify each value.
        The views up to the first miss or corrupt value, whether it got them all, and the
        corrupt count."""
        assert self.identity is not None
        ident = self.identity
        rows = np.empty((len(hashes), self.value_bytes), dtype=np.uint8)
        keys = [ident.key(h) for h in hashes]
        lengths = self._with_connection(lambda conn: conn.mget_into(keys, rows), group)
        views: list[memoryview] = []
        for row, n, name in zip(rows, lengths, hashes, strict=True):
            if n == MISSING:
                return views, False, 0
            try:
                if n < 0:  # TOO_LONG: not read off the wire
                    raise CorruptBlock("value longer than a block")
                views.append(
                    decode_block(row[:n].data, ident.layout, ident.value_fp, name, self._mac_key)
                )
            except CorruptBlock as exc:
                log.warning("kv tiers: corrupt block %s: %s", name.hex(), exc)
                return views, False, 1
        return views, True, 0

    def store_async(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        """Write blocks through to Redis in the background; ``data`` is uint8
        ``[len(hashes), block bytes]`` and belongs to the tiers from now on.

        No "already stored" memory: the engine computes a block only after the tiers
        missed it, and Redis may have lost it since (eviction, TTL, restart).
        """
        if self._bulk is None or not len(hashes):
            return
        c = self.redis_counters
        if self.breaker.rejecting() or self._stores_refused():
            with self._lock:
                c.drops += len(hashes)
            return
        row_bytes = data.nbytes // len(hashes)
        with self._lock:
            # As many blocks, from the first, as the queue has room for: a long prompt's
            # batch can exceed the whole queue, and its leading blocks are still worth it.
            room = max(0, self.store_queue_bytes - self._queued_bytes)
            n = min(len(hashes), room // max(1, row_bytes))
            c.drops += len(hashes) - n
            if n == 0:
                return
            self._queued_bytes += n * row_bytes
        if n < len(hashes):
            # A view would keep the whole export alive, dropped rows too, past the queue's
            # byte bound until the last sub-batch is written.
            data = data[:n].copy()
        step = self.batch_blocks
        for i in range(0, n, step):
            part = data[i : min(i + step, n)]
            try:
                self._writers.submit(
                    self._store, list(hashes[i : i + len(part)]), part, part.nbytes
                )
            except RuntimeError:  # closed meanwhile (an engine thread outliving its worker)
                with self._lock:
                    self._queued_bytes -= part.nbytes
                    c.drops += len(part)

    def skipped(self, blocks: int) -> None:
        """Blocks the engine did not offer while stores were not accepted: drops too."""
        if self._bulk is not None:
            with self._lock:
                self.redis_counters.drops += blocks

    def _stores_refused(self) -> bool:
        return time.monotonic() < self._stores_refused_until

    def _refuse_stores(self) -> None:
        """Pause stores: 1 s after the first refusal, doubling per refusal in a row, 60 s
        at most (Redis under noeviction frees memory only as keys expire)."""
        self._store_pause_s = min(60.0, max(1.0, self._store_pause_s * 2))
        self._stores_refused_until = time.monotonic() + self._store_pause_s

    def _store(self, hashes: list[bytes], data: np.ndarray, nbytes: int) -> None:
        """One sub-batch on a writer thread: headers (checksums), then pipelined SETs that
        send each header and the engine's row as one value."""
        assert self.identity is not None and self.redis_config is not None
        c = self.redis_counters
        with self._lock:
            self._store_busy(+1)
        stored = 0
        failed = False
        leave = None
        try:
            leave = self.breaker.allow()
            if leave is not None:
                ident, ttl = self.identity, self.redis_config.ttl_s
                keys = [ident.key(h) for h in hashes]
                values = [
                    (
                        block_header(
                            ident.layout, ident.value_fp, h, row, self.checksum, self._mac_key
                        ),
                        row,
                    )
                    for h, row in zip(hashes, data, strict=True)
                ]
                try:
                    stored, refusal = self._with_connection(
                        lambda conn: conn.set_many(keys, values, ttl)
                    )
                except _FAILURES as exc:
                    failed = True
                    self.breaker.failure(leave, exc)
                    log.debug("kv tiers: store failed: %r", exc)
                else:
                    # Redis answered: the link takes writes, whatever it said about them.
                    self.breaker.success(leave, write=True)
                    if stored or not refusal:
                        self._store_pause_s = 0.0
                    else:
                        # Every SET refused (OOM under noeviction, READONLY, MISCONF):
                        # stores pause, or they kept copying blocks off the device and
                        # sending them for nothing; reads go on (the server still has them).
                        failed = True
                        self._refuse_stores()
                        log.warning("kv tiers: Redis refused %d stores (storing paused "
                                    "%.0f s): %s", len(keys), self._store_pause_s,
                                    refusal)  # fmt: skip
        except Exception as exc:  # encoding bugs must not kill the writer either
            failed = True
            if leave is not None:  # a probe that ended here must not hold the breaker
                self.breaker.failure(leave)
            log.warning("kv tiers: store failed: %r", exc)
        with self._lock:
            self._store_busy(-1)
            self._queued_bytes -= nbytes
            if failed:
                c.errors += 1
            if stored:
                c.stores += 1
                c.store_blocks += stored
                c.store_bytes += stored * self.value_bytes
            c.drops += len(hashes) - stored

    def _store_busy(self, change: int) -> None:
        """A store sub-batch starts (+1) or ends (-1) on a writer thread; under ``_lock``.

        Redis's ``store_s`` is the wall time at least one was running, as ``load_s`` is a
        load's wall time: summed per sub-batch, two writers side by side counted each
        second twice, and store GB/s read half of what went over the wire.
        """
        now = time.perf_counter()
        if self._stores_running:
            self.redis_counters.store_s += now - self._store_busy_mark
        self._store_busy_mark = now
        self._stores_running += change

    def offload_wanted(self, hashes: Sequence[bytes]) -> list[int]:
        """The indices of the evicted blocks whose bytes the host tier takes: those it does
        not hold (a held one is only made recent: copying it off the device again moved
        its bytes for nothing), and of those only the last as many as it has slots (the
        device evicts the least recently used first; the rest would push one another out
        on arrival). Every evicted block used to be copied into one pinned buffer: a
        long prompt's admission evicting thousands took gigabytes of page-locked memory,
        which torch's host allocator then kept."""
        if self.host is None:
            return []
        wanted = []
        for i, h in enumerate(hashes):
            if h in self.host:
                self.host.get(h)  # made recent, as an offload of it did
            else:
                wanted.append(i)
        return wanted[-self.host.num_slots :] if self.host.num_slots else []

    def offload(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        """Keep blocks the device cache is about to overwrite in host memory."""
        if self.host is None:
            return
        c = self.host_counters
        t0 = time.perf_counter()
        for i, h in enumerate(hashes):
            # One held already (a host hit evicted from the device again) is only refreshed:
            # no bytes move, and counted as stored it inflated the host's store GB/s.
            kept = h in self.host
            if self.host.put(h, data[i]):
                if not kept:
                    c.store_blocks += 1
                    c.store_bytes += self.host.block_bytes
            else:
                c.drops += 1
        c.stores += 1
        c.store_s += time.perf_counter() - t0

    # --- telemetry and shutdown ----------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            redis = snapshot(self.redis_counters)
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
        """Finish queued stores (briefly), then stop the I/O threads and close connections."""
        if self._bulk is not None:
            self.flush(timeout_s=5.0)
        self._io.abandon()  # what is still in flight ends now, not at a trickling server's pace
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writers.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # stores cancelled unwritten: dropped, and counted so
            left = self._queued_bytes
            self._queued_bytes = 0
            if left:
                self.redis_counters.drops += max(1, left // max(1, self.block_bytes))
        if self._bulk is not None:
            self._bulk.close()

    def __enter__(self) -> KVTiers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
