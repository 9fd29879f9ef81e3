"""Host names resolved off the caller's thread, with a bounded wait and a short cache.

The KV tier asks Redis on the engine thread (a lookup at admission), and a new connection
resolves the server's name with ``getaddrinfo``, which no socket timeout bounds: with the
cluster's DNS down, a resolver's usual ``timeout:5 attempts:2`` over a few search domains
holds the call for tens of seconds, and the engine with it, long enough for the worker's
stuck-engine watchdog to end the process. Here a name is resolved on a daemon thread;
the caller waits at most its socket timeout (then fails like an unreachable Redis, which
the tier's breaker turns into misses), and the answer, when it comes, serves the
connections that follow for ``ttl_s`` (a restarted Redis pod may come back elsewhere).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

AddrInfo = tuple[Any, ...]  # one getaddrinfo row: family, type, proto, canonname, sockaddr
Lookup = Callable[..., Sequence[AddrInfo]]


class Resolver:
    """``getaddrinfo`` for TCP, one lookup in flight per name, answers kept ``ttl_s``."""

    def __init__(self, ttl_s: float = 30.0, lookup: Lookup = socket.getaddrinfo) -> None:
        self.ttl_s = ttl_s
        self._lookup = lookup
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, int], tuple[float, Sequence[AddrInfo]]] = {}
        self._pending: dict[tuple[str, int], Future[Sequence[AddrInfo]]] = {}

    def addresses(self, host: str, port: int, timeout: float) -> Sequence[AddrInfo]:
        """Where ``host:port`` is; ``OSError`` when the name does not resolve in ``timeout``
        seconds (the lookup goes on, for the next caller) or does not exist."""
        key = (host, port)
        with self._lock:
            answer = self._answers.get(key)
            if answer is not None and time.monotonic() - answer[0] < self.ttl_s:
                return answer[1]
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = Future()
                # A daemon thread, not an executor: a lookup hung in the C library must not
                # hold the process at exit.
                threading.Thread(
                    target=self._resolve, args=(key, future), name="kv-dns", daemon=True
                ).start()
        try:
            return future.result(timeout)
        except FutureTimeout:
            if answer is not None:
                return answer[1]  # an expired answer beats none while DNS is slow
            raise TimeoutError(f"resolving {host!r} took over {timeout:g}s") from None
        except OSError:
            if answer is not None:
                return answer[1]  # or failing (SERVFAIL during a DNS outage)
            raise

    def _resolve(self, key: tuple[str, int], future: Future[Sequence[AddrInfo]]) -> None:
        try:
            infos = self._lookup(key[0], key[1], type=socket.SOCK_STREAM)
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            future.set_exception(exc)
            return
        with self._lock:
            self._answers[key] = (time.monotonic(), infos)
            del self._pending[key]
        future.set_result(infos)


def connect(infos: Sequence[AddrInfo], timeout: float) -> socket.socket:
    """A TCP connection to the first of ``infos`` that answers (``create_connection``'s
    loop, over addresses already resolved), all of them within ``timeout`` together: each
    given the whole of it, a name with unreachable addresses (an AAAA record without a
    route) held the engine thread that many times over. Each address gets its share of
    what is left, so a silent first one cannot keep a live second from being tried."""
    error: OSError | None = None
    deadline = time.monotonic() + timeout
    for i, (family, kind, proto, _, address) in enumerate(infos):
        left = deadline - time.monotonic()
        if left <= 0:
            error = error or TimeoutError("timed out")
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left / (len(infos) - i))
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error if error is not None else OSError("the name resolved to no address")
