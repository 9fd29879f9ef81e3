"""Which of a caller's open streams have heard nothing from their worker for a while.

A final chunk lost on core NATS without a reconnect or a slow consumer (a cluster route
that flapped under the two clients) leaves no gap to notice: nothing comes after it, and
the stream waited for its deadline although its worker had finished. So the caller lists
its streams silent for :data:`IDLE_ASK_S` in an extra heartbeat message
(:func:`~common.heartbeat.idle_payload`), the most recently heard first, and a worker that
finished one of them lately re-sends what the caller lacks (``workers.resync``). A worker
that is still on one, or never had it, only looks an id up: a stream that is merely slow
(a long prompt, a queue, a preemption) costs nothing.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

# Silent this long, a stream is listed: well inside the time a worker keeps a finished
# request for a resync (workers.resync.KEEP_S, 6 s), one heartbeat interval included.
IDLE_ASK_S = 2.0
# At most this many per heartbeat: the most recently heard, whose final chunk may just have
# been lost (one queued for minutes is likelier still queued).
IDLE_LIST_MAX = 256


class IdleStreams:
    """Call :meth:`heard` when a stream opens and at each chunk, :meth:`forget` at its end."""

    __slots__ = ("_clock", "_heard")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heard: dict[str, float] = {}

    def heard(self, request_id: str) -> None:
        self._heard[request_id] = self._clock()

    def forget(self, request_id: str) -> None:
        self._heard.pop(request_id, None)

    def took_chunk(self, request_id: str, ended: bool) -> None:
        """A chunk came: the stream is heard now, or, ``ended``, no longer watched."""
        if ended:
            self.forget(request_id)
        else:
            self.heard(request_id)

    def __len__(self) -> int:
        return len(self._heard)

    def idle(self, min_s: float = IDLE_ASK_S, limit: int = IDLE_LIST_MAX) -> list[str]:
        """Streams silent for ``min_s`` or more, the most recently heard first."""
        cutoff = self._clock() - min_s
        quiet = ((at, rid) for rid, at in self._heard.items() if at <= cutoff)
        return [rid for _, rid in heapq.nlargest(limit, quiet)]
