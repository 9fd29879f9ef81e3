"""The tier's own Redis connection against a real redis-server: values land in the caller's
rows, odd replies (a miss, a value too long for a row) keep the connection in step, and
credentials, database and dead connections are handled like redis-py would."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
from redis.exceptions import ResponseError

from common.config import RedisConfig
from common.services import RedisServer
from kvstore.bulk_io import (
    KEEPALIVE_IDLE_S,
    MAX_IDLE_S,
    MAX_LINE,
    MISSING,
    TOO_LONG,
    Borrowers,
    BulkConnection,
    BulkPool,
)
from kvstore.identity import KVLayout
from kvstore.resolver import AddrInfo, Resolver
from kvstore.tiers import KVTiers

LAYOUT = KVLayout(block_size=4, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)


def test_mget_lands_values_in_the_callers_rows_and_an_oversized_one_ends_the_reply(
    redis_config: RedisConfig,
) -> None:
    """An oversized value (anyone with Redis access may write 512 MB) was read off the wire
    in full while the engine waited for the load; now the reply stops there, the keys after
    it count as misses, and the connection, left mid-reply, is never reused."""
    raw = redis.Redis.from_url(redis_config.url)
    big = bytes(range(256)) * 1024  # 256 KiB: spans many reads
    raw.set(b"b:small", b"x" * 100)
    raw.set(b"b:big", big)
    raw.set(b"b:huge", b"h" * (len(big) + 1))
    raw.close()
    rows = np.zeros((4, len(big)), dtype=np.uint8)
    conn = BulkConnection(redis_config)
    try:
        assert conn.mget_into([b"b:small", b"b:none", b"b:big"], rows) == [100, MISSING, len(big)]
        assert rows[0, :100].tobytes() == b"x" * 100 and rows[2].tobytes() == big
        assert conn.mget_into([b"b:small"], rows) == [100]  # in step after a full reply
        assert not conn.spoiled and conn.idle_and_open()
        rows[:] = 0
        assert conn.mget_into([b"b:huge", b"b:small"], rows) == [TOO_LONG, MISSING]
        assert not rows.any()  # not read into the row
        assert conn.spoiled and not conn.idle_and_open()  # mid-reply: closed, never reused
    finally:
        conn.close()


def test_set_many_sends_each_value_from_its_parts_with_the_ttl(
    redis_config: RedisConfig,
) -> None:
    conn = BulkConnection(redis_config)
    payload = np.arange(1 << 18, dtype=np.uint32).view(np.uint8)  # 1 MiB
    try:
        parts = [(b"head-a", payload), (b"head-b", memoryview(b"tail"))]
        assert conn.set_many([b"s:a", b"s:b"], parts, ttl_s=50) == (2, "")
        assert conn.expire_many([b"s:a", b"s:none", b"s:b"], 60) == ([True, False, True], "")
    finally:
        conn.close()
    raw = redis.Redis.from_url(redis_config.url)
    assert raw.get(b"s:a") == b"head-a" + payload.tobytes()
    assert raw.get(b"s:b") == b"head-btail"
    assert 50 < raw.ttl(b"s:a") <= 60
    raw.close()


def test_password_and_database_from_the_config_and_a_wrong_password_is_an_error(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    server = fresh_redis_server(password="r3dis-pw")
    url = server.url.removesuffix("/0") + "/3"
    with KVTiers(RedisConfig(url=url, password="r3dis-pw")) as tiers:
        tiers.bind("dummy:tiny", 0, LAYOUT)
        data = np.ones((2, LAYOUT.block_bytes), dtype=np.uint8)
        hashes = [b"a" * 16, b"b" * 16]
        tiers.store_async(hashes, data)
        assert tiers.flush() and tiers.lookup(hashes) == 2
        assert [bytes(v) for v in tiers.load(hashes)] == [bytes(r) for r in data]
        assert tiers.identity is not None
        key = tiers.identity.key(hashes[0])
    raw = redis.Redis.from_url(url, password="r3dis-pw")
    assert raw.exists(key) == 1
    raw.close()
    with pytest.raises(ResponseError):
        BulkConnection(RedisConfig(url=url, password="wrong"))
    # The URL's password wins over the setting's, as in redis-py's from_url: both clients
    # log in alike (the raw path failed where redis-py connected).
    in_url = url.replace("redis://", "redis://:r3dis-pw@")
    assert redis.Redis.from_url(in_url, password="wrong").ping()
    BulkConnection(RedisConfig(url=in_url, password="wrong")).close()


def test_a_url_without_a_port_means_redis_py_s_6379() -> None:
    """redis://redis/0 has no port: redis-py takes 6379, the raw path raised KeyError and
    the tier never reached Redis."""
    asked: list[tuple[str, int]] = []

    def unknown(host: str, port: int, **_: object) -> list[AddrInfo]:
        asked.append((host, port))
        raise socket.gaierror(socket.EAI_NONAME, "no such name in this test")

    with pytest.raises(socket.gaierror):
        BulkConnection(RedisConfig(url="redis://redis-host/0"), Resolver(lookup=unknown))
    assert asked == [("redis-host", 6379)]


def test_a_slow_name_lookup_holds_a_connect_no_longer_than_the_socket_timeout(
    redis_config: RedisConfig,
) -> None:
    """getaddrinfo has no timeout: with DNS down, the engine thread's tier lookup waited
    for the C library's retries. Now it fails after the socket timeout, one lookup stays in
    flight for everyone, and its answer serves the connections that follow."""
    port = int(redis_config.url.rsplit(":", 1)[1].split("/")[0])
    answered = threading.Event()
    asked: list[str] = []

    def slow(host: str, port: int, **kw: object) -> list[AddrInfo]:
        asked.append(host)
        answered.wait(30)
        return socket.getaddrinfo("127.0.0.1", port, **kw)  # type: ignore[arg-type]

    config = RedisConfig(url=f"redis://redis.example:{port}/0", socket_timeout_s=0.2)
    pool = BulkPool(config, size=2, resolver=Resolver(lookup=slow))
    for _ in range(3):
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match=r"redis\.example"):
            pool.take()
        assert time.perf_counter() - t0 < 2.0
    assert asked == ["redis.example"]  # one lookup, not one per attempt
    answered.set()
    deadline = time.monotonic() + 10
    while True:  # the lookup's thread stores its answer
        try:
            conn = pool.take()
            break
        except TimeoutError:
            assert time.monotonic() < deadline
    assert conn.expire_many([b"k"], 10) == ([False], "")
    pool.give(conn)
    pool.close()
    assert asked == ["redis.example"]


def test_an_expired_answer_serves_while_the_next_lookup_is_slow() -> None:
    answers = iter([0.0, 5.0])
    gate = threading.Event()

    def lookup(host: str, port: int, **_: object) -> list[AddrInfo]:
        delay = next(answers)
        if delay:
            gate.wait(delay)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    resolver = Resolver(ttl_s=0.0, lookup=lookup)
    first = resolver.addresses("redis", 6379, timeout=5)
    t0 = time.perf_counter()
    assert resolver.addresses("redis", 6379, timeout=0.1) == first  # expired, DNS slow
    assert time.perf_counter() - t0 < 1.0
    gate.set()


def test_an_expired_answer_serves_while_lookups_fail() -> None:
    calls = iter([None, socket.gaierror(socket.EAI_AGAIN, "SERVFAIL")])

    def lookup(host: str, port: int, **_: object) -> list[AddrInfo]:
        failure = next(calls)
        if failure is not None:
            raise failure
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    resolver = Resolver(ttl_s=0.0, lookup=lookup)
    first = resolver.addresses("redis", 6379, timeout=5)
    assert resolver.addresses("redis", 6379, timeout=5) == first  # DNS down: the last answer


def test_the_pool_drops_connections_the_server_closed_while_they_were_idle(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    server = fresh_redis_server()
    pool = BulkPool(RedisConfig(url=server.url), size=2)
    conn = pool.take()
    assert conn.expire_many([b"k"], 10) == ([False], "")
    pool.give(conn)
    server.restart()
    fresh = pool.take()
    assert fresh is not conn  # the closed one was noticed, not handed out
    assert fresh.expire_many([b"k"], 10) == ([False], "")
    pool.give(fresh)
    pool.close()


def test_abandon_never_aborts_a_connection_its_job_has_already_given_back() -> None:
    """The connections were aborted after the lock was let go: a job finishing meanwhile
    gave its connection back to the pool, and the abort then cut another borrower's command."""
    borrowers = Borrowers()
    events: list[str] = []
    threads: list[threading.Thread] = []

    class Conn:
        def abort(self) -> None:
            # The job finishes while its connection is being aborted.
            leaving = threading.Thread(
                target=lambda: (borrowers.leave(self), events.append("left"))
            )  # type: ignore[arg-type]
            threads.append(leaving)
            leaving.start()
            leaving.join(0.3)
            events.append("aborted")

    conn = Conn()
    borrowers.enter(conn)  # type: ignore[arg-type]
    borrowers.abandon()
    threads[0].join(5)  # the job's leave, once abandon lets it
    assert events == ["aborted", "left"]


def test_a_reply_line_that_never_ends_is_an_error_not_a_growing_buffer() -> None:
    """A peer that is not Redis (or one tampered with on a plaintext link) streaming bytes
    without a line's end grew the buffer until the worker ran out of memory, rescanning it
    all at every read."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def babble() -> None:
        peer, _ = listener.accept()
        with peer:
            peer.recv(1024)
            with contextlib.suppress(OSError):
                for _ in range(64):  # 4 MiB at most, 64 KiB a read
                    peer.sendall(b"*" + b"9" * (1 << 16))

    talker = threading.Thread(target=babble, daemon=True)
    talker.start()
    conn = BulkConnection(RedisConfig(url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=2))
    try:
        with pytest.raises(ResponseError, match="without its end"):
            conn.mget_into([b"k"], np.zeros((1, 8), dtype=np.uint8))
        assert conn.spoiled and len(conn._pending) < 4 * MAX_LINE
    finally:
        conn.close()
        listener.close()
        talker.join(timeout=5)


def test_the_pool_closes_a_connection_idle_too_long_and_keeps_tcp_alive(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flow a NAT or load balancer dropped while idle looks open to the poll: its first
    command waited out the socket timeout on the engine thread and counted against the
    breaker. Idle past the limit, a connection is replaced; TCP keepalive watches the rest."""
    pool = BulkPool(RedisConfig(url=redis_server.url), size=2)
    conn = pool.take()
    assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
    pool.give(conn)
    assert pool.take() is conn  # just idle: reused
    pool.give(conn)
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + MAX_IDLE_S + 1)
    fresh = pool.take()
    assert fresh is not conn and fresh.expire_many([b"k"], 10) == ([False], "")
    pool.give(fresh)
    pool.close()


@contextlib.contextmanager
def _silent_address() -> Iterator[AddrInfo]:
    """An address whose connects are never answered: a listener with a full backlog."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    filler = []
    for _ in range(3):
        sock = socket.socket()
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect(hole.getsockname())
        filler.append(sock)
    time.sleep(0.1)
    try:
        yield (socket.AF_INET, socket.SOCK_STREAM, 6, "", hole.getsockname())
    finally:
        for sock in (*filler, hole):
            sock.close()


def test_a_name_with_several_unreachable_addresses_holds_a_connect_one_timeout() -> None:
    """Each address was given the whole socket timeout: a name resolving to a few that
    never answer (an AAAA record without a route) held the engine thread that many times;
    and a live address behind a silent one must still be reached within it."""
    from kvstore.resolver import connect

    with _silent_address() as silent:
        t0 = time.monotonic()
        with pytest.raises(OSError):
            connect([silent] * 4, 0.3)
        assert time.monotonic() - t0 < 0.6  # one timeout, not four (1.2 s)
        with socket.socket() as live:
            live.bind(("127.0.0.1", 0))
            live.listen()
            reachable: AddrInfo = (socket.AF_INET, socket.SOCK_STREAM, 6, "", live.getsockname())
            connect([silent, reachable], 0.3).close()  # the first took it all before
