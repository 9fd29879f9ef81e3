"""Ids seen lately, bounded in time and number: aborts a worker has not fetched yet, requests
a gateway has finished with."""

from __future__ import annotations

import time
from collections.abc import Callable


class RecentIds:
    """Ids seen in the last ``ttl_s`` seconds, at most ``max_size`` of them (oldest go first).

    A worker remembers aborts of requests not fetched yet, so a later fetch drops them; a
    gateway, the requests it finished, so a redelivered one is dropped at once.
    """

    def __init__(
        self,
        ttl_s: float = 600.0,
        max_size: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl_s
        self._max = max_size
        self._clock = clock
        self._seen: dict[str, float] = {}

    def add(self, key: str) -> None:
        now = self._clock()
        self._seen.pop(key, None)
        self._seen[key] = now
        while len(self._seen) > self._max or (
            self._seen and now - next(iter(self._seen.values())) >= self._ttl
        ):
            self._seen.pop(next(iter(self._seen)))

    def __contains__(self, key: object) -> bool:
        at = self._seen.get(key) if isinstance(key, str) else None
        return at is not None and self._clock() - at < self._ttl
