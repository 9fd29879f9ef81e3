"""Ids seen lately, bounded in time and number: aborts a worker has not fetched yet, requests
a gateway has finished with."""

from __future__ import annotations

import time
from collections import OrderedDict
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
        # Oldest first. An OrderedDict: popping a plain dict's first entries leaves dead slots
        # that every later "first" skips (an add cost 15 -> 69 us as a 100k set filled).
        self._seen: OrderedDict[str, float] = OrderedDict()

    def add(self, key: str) -> None:
        now = self._clock()
        self._seen[key] = now
        self._seen.move_to_end(key)
        while len(self._seen) > self._max or (
            self._seen and now - next(iter(self._seen.values())) >= self._ttl
        ):
            self._seen.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        at = self._seen.get(key) if isinstance(key, str) else None
        return at is not None and self._clock() - at < self._ttl
