"""Gateways as workers hear them on ``qos.gw.*``: which went silent, which reconnected.

Silent for too long, a gateway has died:
A gateway heartbeats every ``gateway.heartbeat_interval_s`` and stamps its id on each
request (``GenerateRequest.origin``). When it dies (SIGKILL, node loss) its callers'
connections go with it, so the rest of their generations would be computed for nobody
until their deadlines (two minutes by default). The worker aborts a request once its
gateway has been silent for ``worker.orphan_after_s``. Silence while this worker is itself
cut off from NATS does not count: it could not have heard anyone.

A heartbeat also carries the gateway's NATS reconnect count (``common.heartbeat``): when
it changes, the gateway was cut off while this worker was not, and the chunks published
meanwhile are gone; :meth:`GatewayWatch.heard` says so, and the worker resyncs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.recent_ids import RecentIds

# Gateways silent this many thresholds are forgotten (bounded memory with gateway churn).
_FORGET_AFTER = 10


class GatewayWatch:
    def __init__(self, orphan_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._after = orphan_after_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._reconnects: dict[str, int] = {}
        self._listening_since = clock()
        # Gateways forgotten for their silence: a day's worth (the longest deadline), so
        # their requests still queued are still known to be nobody's.
        self._forgotten = RecentIds(ttl_s=86_400.0, max_size=10_000, clock=clock)

    @property
    def enabled(self) -> bool:
        return self._after > 0

    def heard(self, gateway_id: str, reconnects: int | None = None) -> bool:
        """Note a heartbeat; True when its reconnect count differs from the one before, or
        when the first count heard from a gateway is above zero: it reconnected at some
        point, perhaps just now while this worker, new to it, already held its streams (a
        resync of streams it did not miss costs a resume query each, nothing more)."""
        self._seen[gateway_id] = self._clock()
        if reconnects is None:
            return False
        before = self._reconnects.get(gateway_id)
        self._reconnects[gateway_id] = reconnects
        return reconnects > 0 if before is None else before != reconnects

    def cut_off(self) -> None:
        """This worker is not connected: every gateway gets a fresh allowance once it is."""
        self._listening_since = self._clock()

    def orphaned(self, origin: str) -> bool:
        """True when ``origin`` (a request's gateway) has been silent past the threshold."""
        return self.enabled and bool(origin) and self.silent_s(origin) > self._after

    def gone(self, origin: str) -> bool:
        """Orphaned, and heard before: a gateway that beat and stopped (or was forgotten
        for it). One never heard may be new, its first beat still on the way: only the
        reaper judges it, later."""
        if origin in self._forgotten and origin not in self._seen:
            return self.enabled
        return origin in self._seen and self.orphaned(origin)

    def silent_s(self, origin: str) -> float:
        """Seconds since ``origin`` was last heard (or since this worker started listening)."""
        last = max(self._seen.get(origin, float("-inf")), self._listening_since)
        return self._clock() - last

    def known(self) -> list[str]:
        """Gateways heard from and not forgotten yet."""
        return sorted(self._seen)

    @property
    def forget_after_s(self) -> float:
        """Silence after which a gateway is forgotten."""
        return _FORGET_AFTER * max(self._after, 1.0)

    def forget_stale(self) -> None:
        """Forget gateways silent past :attr:`forget_after_s`, counting as :meth:`silent_s`
        does: not while this worker was cut off. A worker back from a long outage forgot
        every gateway, and a live one's requests fetched before its next beat read as a
        forgotten gateway's: aborted."""
        limit = self.forget_after_s
        for gateway_id in [g for g in self._seen if self.silent_s(g) > limit]:
            del self._seen[gateway_id]
            self._reconnects.pop(gateway_id, None)
            self._forgotten.add(gateway_id)
