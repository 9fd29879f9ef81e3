"""G3: KV blocks in Redis, shared by every node, behind a circuit breaker.

``redis.asyncio`` (hiredis parses replies when installed) over a bounded, blocking
connection pool. A batch is cut into sub-batches of about ``batch_bytes`` that run
concurrently, one pipelined round trip each (MGET to read, SET ... EX to write, no MULTI:
blocks are independent and content-addressed, so there is nothing to make atomic).
Several connections in flight are what keep loopback busy: one connection waits for the
server to copy a value while another parses the previous reply.

The breaker makes Redis optional at run time: timeouts and connection errors open it,
and while it is open every call is an immediate miss (reads) or no-op (writes) instead of
a stall per request. After ``open_s`` one probe goes through; success closes it, failure
reopens it for twice as long (up to ``max_open_s``). Nothing here raises into callers.

:class:`~kvstore.tiers.KVTiers` uses the breaker but moves values over
:mod:`kvstore.bulk_io` (no parser copies); ``RedisTier`` is the redis.asyncio transport
that ``bench/kvtier.py`` measures next to it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from common.config import RedisConfig
from kvstore.bulk_io import keepalive_options
from kvstore.identity import KVIdentity

log = logging.getLogger(__name__)

T = TypeVar("T")

# Failures a breaker counts: the server or the network, not a bad reply to one command.
_FAILURES = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class BreakerPass:
    """Leave for one call, from :meth:`CircuitBreaker.allow`; its answer goes back with it."""

    epoch: int  # the breaker's state change it was given under
    issued: float = 0.0  # the breaker's clock when it was given


class CircuitBreaker:
    """CLOSED -> (``failures_to_open`` consecutive failures) -> OPEN for ``open_s`` ->
    HALF_OPEN (one probe) -> CLOSED on success, OPEN again (twice as long) on failure.

    An answer counts only in the state its call was let through in: a slow call from
    before the breaker opened must not close it (nor keep it open longer), and while it is
    half-open only the probe decides. Failures of calls that were in flight together count
    once: one stall of the server (a fork, a slow command) failed every call it held, and
    two writer threads' sub-batches opened the breaker, which one failure does not. A
    failure ``failure_memory_s`` after the last one starts the count again: successful
    stores do not clear it (module's ``success``), and two stalls hours apart in a group
    that rarely loads are no outage.

    Thread-safe: :class:`kvstore.tiers.KVTiers` calls it from the engine thread (lookups,
    loads) and its writer threads (stores); :class:`RedisTier` from its event loop."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(
        self,
        failures_to_open: int = 2,
        open_s: float = 2.0,
        max_open_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        failure_memory_s: float = 30.0,
    ) -> None:
        self.failures_to_open = failures_to_open
        self.failure_memory_s = failure_memory_s
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self.clock = clock
        self.state = self.CLOSED
        self.num_opens = 0
        self._failures = 0
        self._open_s = open_s
        self._reopen_at = 0.0
        self._probing = False
        self._epoch = 0  # state changes so far: which passes still count
        self._failed_at = float("-inf")  # when the last counted failure came
        self._lock = threading.Lock()

    def rejecting(self) -> bool:
        """True while calls must not even be tried (read-only: safe from any thread)."""
        if self.state == self.OPEN:
            return self.clock() < self._reopen_at
        return self.state == self.HALF_OPEN and self._probing

    def allow(self) -> BreakerPass | None:
        """Leave for a call now, or None. Turns an expired OPEN into HALF_OPEN with one
        probe. Give the pass back to :meth:`success` or :meth:`failure`."""
        with self._lock:
            return self._allow()

    def _allow(self) -> BreakerPass | None:
        if self.state == self.CLOSED:
            return BreakerPass(self._epoch, self.clock())
        if self.state == self.OPEN and self.clock() >= self._reopen_at:
            self._enter(self.HALF_OPEN)
        if self.state == self.HALF_OPEN and not self._probing:
            self._probing = True
            return BreakerPass(self._epoch, self.clock())
        return None

    def _enter(self, state: str) -> None:
        self.state = state
        self._epoch += 1
        self._probing = False

    def _counts(self, leave: BreakerPass | None) -> bool:
        """Whether an answer speaks for the current state (None: a caller's own verdict)."""
        return leave is None or leave.epoch == self._epoch

    def success(
        self, leave: BreakerPass | None = None, light: bool = False, write: bool = False
    ) -> None:
        """A call went through. ``light``: a small one (an EXPIRE lookup), which says
        little about the big ones: it neither clears the failures loads and stores have
        counted (a link that passes small commands and times out on 2 MiB values must
        still open the breaker) nor closes a half-open one; it only frees the probe, for
        the next load or store to take. ``write``: a store, which has no deadline: it
        closes a half-open breaker but, closed, does not clear the failures counted, or a
        link slow enough that every load ran past its budget kept the breaker closed as
        long as write-through finished a batch between two loads (each load then held the
        engine's step for its whole budget)."""
        with self._lock:
            if not self._counts(leave):
                return
            if write and self.state == self.CLOSED:
                return
            if not light:
                self._success()
            elif self.state == self.HALF_OPEN:
                self._probing = False

    def _success(self) -> None:
        if self.state != self.CLOSED:
            log.info("redis tier: breaker closed")
            self._enter(self.CLOSED)
        self._failures = 0
        self._open_s = self.base_open_s

    def failure(self, leave: BreakerPass | None = None, cause: object = None) -> None:
        """A call failed; ``cause`` (an exception or text) goes into the warning when the
        breaker opens: the failures themselves are logged quietly, one per call."""
        with self._lock:
            if not self._counts(leave):
                return
            if leave is not None and self.state == self.CLOSED and leave.issued < self._failed_at:
                return  # in flight with the failure counted last: the same stall
            self._failure(cause)

    def _failure(self, cause: object = None) -> None:
        now = self.clock()
        if now - self._failed_at > self.failure_memory_s:
            self._failures = 0  # long after the last: a failure on its own
        self._failed_at = now
        self._failures += 1
        if self.state == self.HALF_OPEN or self._failures >= self.failures_to_open:
            if self.state == self.HALF_OPEN:
                self._open_s = min(self._open_s * 2, self.max_open_s)
            elif self.state == self.CLOSED:
                self.num_opens += 1
                why = f": {cause!r}" if cause is not None else ""
                log.warning("redis tier: breaker open for %.1fs%s", self._open_s, why)
            if self.state != self.OPEN:
                self._enter(self.OPEN)
            self._reopen_at = self.clock() + self._open_s


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it comes with uvicorn[standard]): its transports copy less,
    so less CPU per GB moved (``bench/kvtier.py``, ``event_loop``); asyncio otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def connection_pool(config: RedisConfig, read_size: int) -> aredis.BlockingConnectionPool:
    """A pool of at most ``max_connections`` (plus the breaker's probe: see RedisTier).

    redis-py's own retries are off: the breaker decides when to try again, and a retry
    with back-off inside one call would stall the engine thread that waits for it. Waiting
    for a free connection is our own queue, not a sick server, so it gets no short timeout.
    """
    kwargs: dict[str, object] = dict(
        max_connections=config.max_connections + 1,
        timeout=None,
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=config.socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
        # Large reads: a 2 MB value in a few syscalls instead of 32 (the default is 64 KiB).
        socket_read_size=read_size,
        username=config.username,
        password=config.password,
    )
    if not config.url.startswith("unix://"):  # a Unix socket's connection takes no keepalive
        # A flow dropped on the way (NAT, load balancer) without a word is noticed by the
        # kernel, and the pool replaces the connection before a command waits on it.
        kwargs["socket_keepalive"] = True
        kwargs["socket_keepalive_options"] = keepalive_options()
    if config.url.startswith("rediss://"):
        # Said, not left to redis-py's default, which before 6.0 did not check the name
        # (the bulk client does: both must refuse a certificate issued for another host).
        kwargs["ssl_check_hostname"] = True
    if config.tls_ca_file:
        kwargs["ssl_ca_certs"] = config.tls_ca_file
    if config.tls_cert_file and config.tls_key_file:
        kwargs["ssl_certfile"], kwargs["ssl_keyfile"] = config.tls_cert_file, config.tls_key_file
    return aredis.BlockingConnectionPool.from_url(config.url, **kwargs)


class RedisTier:
    """Blocks by hash in one Redis, for one worker identity. Create and use it on one
    event loop (the tier thread's); every method returns a miss or False on failure."""

    def __init__(
        self,
        config: RedisConfig,
        identity: KVIdentity,
        breaker: CircuitBreaker | None = None,
        batch_bytes: int = 8 << 20,
        read_size: int = 1 << 20,
    ) -> None:
        self.config = config
        self.identity = identity
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.value_bytes = identity.layout.block_bytes + 64
        # Blocks per pipelined round trip: big values in few commands, never one huge reply.
        self.batch_blocks = max(1, batch_bytes // self.value_bytes)
        self._client = aredis.Redis(connection_pool=connection_pool(config, read_size))
        # Sub-batches in flight never outnumber the connections, so nobody waits on the
        # pool; writes take at most half, so a lookup at admission (on the engine's critical
        # path) never queues behind a burst of write-through. The pool's one spare
        # connection is for the small EXPIRE pipelines of lookups.
        writers = max(1, config.max_connections // 2)
        self._writers = asyncio.Semaphore(writers)
        self._readers = asyncio.Semaphore(max(1, config.max_connections - writers))
        self.num_failures = 0
        self.num_rejected = 0  # calls the open breaker answered without trying
        self.num_store_errors = 0  # SETs the server refused (e.g. out of memory)

    async def close(self) -> None:
        await self._client.aclose()

    def _chunks(self, items: Sequence[bytes]) -> list[Sequence[bytes]]:
        step = self.batch_blocks
        return [items[i : i + step] for i in range(0, len(items), step)]

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T | None:
        """``await call()`` through the breaker; None when refused or failed."""
        leave = self.breaker.allow()
        if leave is None:
            self.num_rejected += 1
            return None
        try:
            result = await call()
        except _FAILURES as exc:
            self.num_failures += 1
            self.breaker.failure(leave)
            log.debug("redis tier: %s: %s", type(exc).__name__, exc)
            return None
        except BaseException:
            # Cancelled, or a bug: still an answer to the breaker, whose half-open probe
            # would otherwise stay taken and refuse every call for good.
            self.breaker.failure(leave)
            raise
        self.breaker.success(leave)
        return result

    async def prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, Redis holds (0 on any failure).

        EXPIRE answers "exists" and refreshes the TTL in one command, so blocks that keep
        being hit outlive ones that are only ever written.
        """
        if not hashes:
            return 0
        keys = [self.identity.key(h) for h in hashes]
        ttl = self.config.ttl_s

        async def run() -> list[object]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.expire(key, ttl)
            return list(await pipe.execute())

        found = await self._guarded(run)
        if found is None:
            return 0
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    async def get(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """Values of ``hashes`` (None = absent); all None when Redis cannot be reached."""
        if not hashes:
            return []
        keys = [self.identity.key(h) for h in hashes]

        async def run() -> list[bytes | None]:
            parts = await asyncio.gather(*(self._mget(c) for c in self._chunks(keys)))
            return [v if isinstance(v, bytes) else None for part in parts for v in part]

        values = await self._guarded(run)
        if values is None:
            return [None] * len(hashes)
        return values

    async def _mget(self, keys: Sequence[bytes]) -> list[object]:
        async with self._readers:
            return list(await self._client.mget(keys))

    async def set(self, hashes: Sequence[bytes], values: Sequence[memoryview | bytes]) -> int:
        """Write blocks with the TTL; how many the server took (0 on failure)."""
        if not hashes:
            return 0
        items = [(self.identity.key(h), v) for h, v in zip(hashes, values, strict=True)]
        ttl = self.config.ttl_s
        step = self.batch_blocks

        async def one(batch: Sequence[tuple[bytes, memoryview | bytes]]) -> list[object]:
            async with self._writers:
                pipe = self._client.pipeline(transaction=False)
                for key, value in batch:
                    pipe.set(key, value, ex=ttl)
                return list(await pipe.execute(raise_on_error=False))

        async def run() -> list[object]:
            parts = await asyncio.gather(
                *(one(items[i : i + step]) for i in range(0, len(items), step))
            )
            return [r for part in parts for r in part]

        results = await self._guarded(run)
        if results is None:
            return 0
        refused = sum(1 for r in results if isinstance(r, ResponseError))
        self.num_store_errors += refused
        return len(results) - refused
