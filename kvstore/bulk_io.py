"""Blocking Redis connections that move KV values without copying them in Python.

redis-py hands every value through its parser: socket -> read buffer -> hiredis buffer ->
a new ``bytes``, three copies of each 2 MB block on one event-loop thread, which capped the
tier's loads at about half of what loopback carries (``bench/kvtier.py``). Here an MGET
reply is read with ``recv_into`` straight into the caller's numpy rows (the kernel's copy
is the only one) and a SET is sent with ``sendmsg`` from the caller's header and payload
buffers. Blocking sockets drop the GIL while they wait, so a few threads, one connection
each, keep loopback busy.

Only what the tier needs is spoken: AUTH, SELECT, EXPIRE, MGET, SET ... EX, in RESP2. Any error or
timeout closes the connection (a half-read reply cannot be resumed) and is raised as a
``RedisError`` or ``OSError`` for the caller's breaker.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
from redis.connection import parse_url
from redis.exceptions import ConnectionError, ResponseError

from common.config import RedisConfig
from kvstore.resolver import Resolver, connect

_CHUNK = 1 << 16  # reads of reply headers; whatever payload they catch is copied once

# Reply lengths that are not a value of the expected size.
MISSING = -1  # nil: no such key (or not a string)
TOO_LONG = -2  # a value larger than a row: skipped on the wire, a corrupt block to callers
# The longest reply line read (a header: "$<length>", "*<count>", an error's text): a peer
# that sends bytes without a line's end must not grow the buffer without bound.
MAX_LINE = 1 << 16
# A connection idle longer is closed, not reused: a NAT, load balancer or proxy on the way
# may have dropped the flow without a word, and its first command would then wait out the
# socket timeout on the engine thread and count against the tier's breaker.
MAX_IDLE_S = 30.0
KEEPALIVE_IDLE_S = 15  # TCP keepalive probes from then on (every 5 s, 3 lost: closed)


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


def keepalive_options() -> dict[int, int]:
    """TCP keepalive timings: probes from :data:`KEEPALIVE_IDLE_S` of silence, every 5 s,
    3 lost and the connection is dead (Linux's and macOS's options; elsewhere the system's
    defaults), so a flow dropped on the way is noticed by the kernel, not by a command."""
    wanted = (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    return {getattr(socket, n): v for n, v in wanted if hasattr(socket, n)}


def _keep_alive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in keepalive_options().items():
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class BulkConnection:
    """One blocking connection (TCP, TLS or a Unix socket), authenticated and on its db."""

    def __init__(
        self,
        config: RedisConfig,
        resolver: Resolver | None = None,
        deadline: float | None = None,
    ) -> None:
        """``deadline`` (``time.monotonic()``): by when the connection must be open, logged
        in and on its db (a lookup's, which opening it counts against); None: each step
        within the socket timeout."""
        url = parse_url(config.url)
        timeout = config.socket_timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("redis: no time left to connect")
            timeout = min(timeout, left)
        path = url.get("path")
        if path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(path)
        else:
            # redis-py's defaults for what a URL leaves out (redis://redis/0 has no port).
            host, port = url.get("host", "localhost"), url.get("port", 6379)
            # The name resolves within the socket timeout too: DNS is unbounded otherwise.
            infos = (resolver or Resolver()).addresses(host, port, timeout)
            sock = connect(infos, timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keep_alive(sock)
        if config.url.startswith("rediss://"):
            context = ssl.create_default_context(cafile=config.tls_ca_file)
            if config.tls_cert_file and config.tls_key_file:
                context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
            sock = context.wrap_socket(sock, server_hostname=url.get("host"))
        self._timeout = config.socket_timeout_s
        sock.settimeout(timeout)
        self.sock = sock
        # time.monotonic() by which the command in progress must have its reply (None: each
        # read within the socket timeout only): a server trickling bytes just fast enough
        # for no socket timeout to fire held a lookup, and the engine's step, for as long.
        self.deadline: float | None = deadline  # the log-in's replies keep to it too
        self._pending = bytearray()  # received, not yet parsed
        self._scratch = bytearray(_CHUNK)
        self._spoiled = False  # a reply left half read: never reused
        self.idle_since = time.monotonic()  # set again each time it goes back to its pool
        try:
            # The URL's credentials win over the settings', as redis-py's from_url has it:
            # both clients must log in as the same user.
            password = url.get("password") or config.password
            username = url.get("username") or config.username
            if password or username:  # an ACL user without a password logs in with ""
                auth = [username.encode()] if username else []
                self._simple(_command(b"AUTH", *auth, (password or "").encode()))
            if url.get("db"):
                self._simple(_command(b"SELECT", str(url["db"]).encode()))
        except BaseException:
            self.close()
            raise
        self.deadline = None
        sock.settimeout(self._timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def abort(self) -> None:
        """From another thread: the command in progress fails at once (its blocked read
        sees the end of the stream, its write an error); its borrower closes it after."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    @property
    def spoiled(self) -> bool:
        """A reply was left half read (a value too long to take): close, never reuse."""
        return self._spoiled

    def idle_and_open(self) -> bool:
        """Nothing to read on an idle connection: anything there (EOF after a server
        restart, an error) means it is no longer usable."""
        if self._spoiled:
            return False
        poll = select.poll()
        poll.register(self.sock, select.POLLIN)
        return not self._pending and not poll.poll(0)

    # --- reading -----------------------------------------------------------------------

    @contextlib.contextmanager
    def replies_by(self, deadline: float) -> Iterator[None]:
        """The commands in the block must have their replies by ``deadline``
        (``time.monotonic()``), or :class:`TimeoutError` (the connection is then spoiled,
        never reused)."""
        self.deadline = deadline
        try:
            yield
        finally:
            self.deadline = None
            with contextlib.suppress(OSError):
                self.sock.settimeout(self._timeout)

    def _recv_into(self, buffer: bytearray | memoryview) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self._spoiled = True  # the reply's rest would be the next command's
                raise TimeoutError("redis: the reply did not come within its deadline")
            self.sock.settimeout(min(self._timeout, left))
        return self.sock.recv_into(buffer)

    def _fill(self) -> None:
        n = self._recv_into(self._scratch)
        if n == 0:
            raise ConnectionError("redis closed the connection")
        self._pending += memoryview(self._scratch)[:n]

    def _line(self) -> bytes:
        searched = 0
        while (end := self._pending.find(b"\r\n", max(0, searched - 1))) < 0:
            searched = len(self._pending)
            if searched > MAX_LINE:  # no reply header is this long: not Redis speaking
                self._spoiled = True
                raise ResponseError(f"a reply line over {MAX_LINE} bytes without its end")
            self._fill()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _into(self, out: memoryview) -> None:
        """Fill ``out`` from the buffered bytes, then straight from the socket."""
        have = min(len(self._pending), len(out))
        out[:have] = self._pending[:have]
        del self._pending[:have]
        while have < len(out):
            n = self._recv_into(out[have:])
            if n == 0:
                raise ConnectionError("redis closed the connection")
            have += n

    def _skip(self, n: int) -> None:
        while n > 0:
            if not self._pending:
                self._fill()
            k = min(n, len(self._pending))
            del self._pending[:k]
            n -= k

    def _header(self) -> bytes:
        line = self._line()
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        return line

    def _simple(self, command: bytes) -> None:
        self.sock.sendall(command)
        line = self._header()
        if line[:1] != b"+":
            raise ResponseError(f"unexpected reply {line[:40]!r}")

    # --- the tier's commands -----------------------------------------------------------

    def mget_into(self, keys: Sequence[bytes], out: np.ndarray) -> list[int]:
        """MGET ``keys`` into the rows of ``out`` (uint8 ``[len(keys), row bytes]``, C order);
        per key the value's length, :data:`MISSING` or :data:`TOO_LONG`."""
        self.sock.sendall(_command(b"MGET", *keys))
        line = self._header()
        if line != b"*%d" % len(keys):
            raise ResponseError(f"unexpected MGET reply {line[:40]!r}")
        lengths = []
        for i in range(len(keys)):
            line = self._header()
            if line[:1] != b"$":
                raise ResponseError(f"unexpected MGET element {line[:40]!r}")
            n = int(line[1:])
            if n < 0:
                lengths.append(MISSING)
                continue
            if n > out.shape[1]:
                # Not read off the wire: a value may be 512 MB (anyone who can write to
                # Redis), and the engine waits for this load. The rest of the reply stays
                # unread, so the connection is dropped instead of reused.
                self._spoiled = True
                lengths.append(TOO_LONG)
                lengths += [MISSING] * (len(keys) - i - 1)
                break
            self._into(out[i, :n].data)
            self._skip(2)
            lengths.append(n)
        return lengths

    def expire_many(self, keys: Sequence[bytes], ttl_s: int) -> tuple[list[bool], str]:
        """EXPIRE each key, pipelined: which exist (their TTL is now ``ttl_s``), and the
        server's first refusal ("" for none). EXPIRE is a write: a read-only replica, or a
        primary refusing writes (MISCONF), refuses it where it would still serve reads; all
        replies are read, so the connection stays usable for :meth:`exists_many`."""
        ttl = _bulk(str(ttl_s).encode())
        self.sock.sendall(b"".join(b"*3\r\n" + _bulk(b"EXPIRE") + _bulk(key) + ttl for key in keys))
        return self._counts(b"EXPIRE", len(keys))

    def exists_many(self, keys: Sequence[bytes]) -> tuple[list[bool], str]:
        """EXISTS each key, pipelined (a read: replicas answer it); as :meth:`expire_many`."""
        self.sock.sendall(b"".join(b"*2\r\n" + _bulk(b"EXISTS") + _bulk(key) for key in keys))
        return self._counts(b"EXISTS", len(keys))

    def _counts(self, command: bytes, n: int) -> tuple[list[bool], str]:
        found, refusal = [], ""
        for _ in range(n):
            line = self._line()
            if line[:1] == b"-":
                refusal = refusal or line[1:200].decode(errors="replace")
                found.append(False)
            elif line[:1] == b":":
                found.append(line != b":0")
            else:
                raise ResponseError(f"unexpected {command.decode()} reply {line[:40]!r}")
        return found, refusal

    def set_many(
        self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview | bytes]], ttl_s: int
    ) -> tuple[int, str]:
        """SET each key to the concatenation of its ``parts`` with a TTL, pipelined; the
        values are gathered by the kernel (``sendmsg``), never joined here. How many the
        server took, and its first refusal's text ("" for none: it refuses writes when out
        of memory, read-only or unable to persist)."""
        ex = b"\r\n" + _bulk(b"EX") + _bulk(str(ttl_s).encode())
        for key, value in zip(keys, parts, strict=True):
            size = sum(len(memoryview(p)) for p in value)
            head = b"*5\r\n" + _bulk(b"SET") + _bulk(key) + b"$%d\r\n" % size
            self._send([head, *value, ex])
        stored, refusal = 0, ""
        for _ in keys:
            line = self._line()
            if line[:1] == b"+":
                stored += 1
            elif line[:1] != b"-":
                raise ResponseError(f"unexpected SET reply {line[:40]!r}")
            elif not refusal:
                refusal = line[1:200].decode(errors="replace")
        return stored, refusal

    def _send(self, buffers: list[memoryview | bytes]) -> None:
        if isinstance(self.sock, ssl.SSLSocket):  # no sendmsg on TLS sockets
            for b in buffers:
                self.sock.sendall(b)
            return
        views = [memoryview(b).cast("B") for b in buffers]
        while views:
            sent = self.sock.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]


class Borrowers:
    """The connections a group of I/O jobs holds. :meth:`abandon` aborts them (their blocked
    reads and writes fail at once) and keeps the group's later jobs from taking one: a load
    given up by its deadline, or a tier closing, must not leave reader threads held by a
    server that trickles bytes just fast enough for no socket timeout to fire."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[BulkConnection] = set()
        self.abandoned = False

    def enter(self, conn: BulkConnection) -> None:
        with self._lock:
            if self.abandoned:
                raise ConnectionError("kv tier I/O abandoned")
            self._held.add(conn)

    def leave(self, conn: BulkConnection) -> None:
        with self._lock:
            self._held.discard(conn)

    def abandon(self) -> None:
        # Aborted under the lock (a shutdown does not block): outside it, a job could leave
        # and give its connection back, and another borrower's command on it was cut.
        with self._lock:
            self.abandoned = True
            for conn in self._held:
                conn.abort()


class BulkPool:
    """Up to ``size`` idle connections, opened on demand; one borrower at a time each."""

    def __init__(self, config: RedisConfig, size: int, resolver: Resolver | None = None) -> None:
        self.config = config
        self.resolver = resolver or Resolver()  # shared: one lookup in flight, answers kept
        self._idle: queue.LifoQueue[BulkConnection] = queue.LifoQueue(size)

    def take(self, deadline: float | None = None) -> BulkConnection:
        """An idle connection that is still sound, or a new one (open by ``deadline``)."""
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                return BulkConnection(self.config, self.resolver, deadline)
            if time.monotonic() - conn.idle_since <= MAX_IDLE_S and conn.idle_and_open():
                return conn
            conn.close()

    def give(self, conn: BulkConnection) -> None:
        """Return a connection whose last command finished cleanly (close it otherwise)."""
        conn.idle_since = time.monotonic()
        try:
            self._idle.put_nowait(conn)
        except queue.Full:
            conn.close()

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return
