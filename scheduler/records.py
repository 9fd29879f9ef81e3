"""The values the scheduler keeps in the state bucket (``nats.kv_bucket``, default ``qos_state``).

All are JSON so ``nats kv get`` shows them as they are; all times are unix milliseconds.

``breaker.<group>`` — read by every gateway (:mod:`gateway.workers_view`; missing = closed)
and by a scheduler that (re)starts, which continues the state machine from it::

    {"v": 1, "state": "closed" | "open" | "half_open", "since_ms": int, "reason": str,
     "fallback": str | null, "batch_cap": int, "scheduler": str, "written_ms": int,
     "fence": int, "probe_at_ms": int, "reopens": int}

``batch_cap`` is the cap the group's workers should run at in this state (``open_batch_cap``
while open or half-open, the group's ``max_batch`` once closed).

The leader writes a record when its breaker moves, and writes an open or half-open one
again every :data:`BREAKER_RENEW_S`: a gateway that has not seen a non-closed record
renewed for ``BREAKER_STALE_S`` (:mod:`gateway.workers_view`) reads it as closed, so a group
is not kept out of service by a scheduler that died while its breaker was open.

``desired.<group>`` — for an autoscaler (KEDA/HPA read ``qos_desired_replicas`` too)::

    {"v": 1, "replicas": int, "current": int, "why": str, "ts_ms": int}

``served.<group>`` — written once by the leader when it first sees the group with a live
replica, read by every scheduler as it starts and takes over: a group that lost its last
replica is refilled to its minimum (a group never served may be meant empty), even when it
lost it before this scheduler started::

    {"v": 1, "since_ms": int, "scheduler": str}

``history.<group>`` is :mod:`scheduler.history`'s; ``sched.lease`` is :mod:`scheduler.lease`'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from scheduler.breaker import STATES, State

BREAKER_PREFIX = "breaker."
# How often the leader rewrites an open or half-open breaker record (see above).
BREAKER_RENEW_S = 5.0
# A non-closed record not written for this long is closed to its readers (gateways read
# it so: gateway.workers_view.BREAKER_STALE_S, the same value; workers drop its cap): a
# scheduler that starts after an outage must read it so too, not revive it.
BREAKER_STALE_S = 30.0
DESIRED_PREFIX = "desired."
SERVED_PREFIX = "served."


def breaker_key(group: str) -> str:
    return BREAKER_PREFIX + group


def desired_key(group: str) -> str:
    return DESIRED_PREFIX + group


def served_key(group: str) -> str:
    return SERVED_PREFIX + group


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps({"v": 1, **obj}, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class BreakerRecord:
    state: State
    since_ms: int
    reason: str = ""
    fallback: str | None = None
    batch_cap: int = 0
    scheduler: str = ""
    # When the leader decided this record (wall ms): a deposed leader's write, queued while
    # it was cut off and stored when it got back, reads as old, not as fresh from the server.
    written_ms: int = 0
    # The writing leader's fencing token (Control.fence): a gateway that has seen a record
    # of a later leader ignores this one (a deposed leader's write stored late).
    fence: int = 0
    # An open breaker: when it turns half-open (wall ms; 0 otherwise), for the gateways'
    # Retry-After (its wait grows with each re-open: a fixed 2 s sent clients back 60 times).
    probe_at_ms: int = 0
    # Opens in a row that came soon after the last (its open wait doubles with each): a
    # new leader continues the backoff rather than probe a still-broken group after 10 s.
    reopens: int = 0

    def to_bytes(self) -> bytes:
        return _dump(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes | None) -> BreakerRecord | None:
        """None when absent or unreadable: the group counts as closed, as gateways read it."""
        try:
            obj = json.loads(data or b"")
            state = obj["state"]
            if state not in STATES:
                return None
            return cls(
                state=state,
                since_ms=int(obj.get("since_ms", 0)),
                reason=str(obj.get("reason", "")),
                fallback=obj.get("fallback"),
                batch_cap=int(obj.get("batch_cap", 0)),
                scheduler=str(obj.get("scheduler", "")),
                written_ms=int(obj.get("written_ms", 0)),
                fence=int(obj.get("fence", 0)),
                probe_at_ms=int(obj.get("probe_at_ms", 0)),
                reopens=max(0, int(obj.get("reopens", 0))),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


@dataclass(frozen=True, slots=True)
class DesiredRecord:
    replicas: int
    current: int
    why: str
    ts_ms: int

    def to_bytes(self) -> bytes:
        return _dump(asdict(self))


@dataclass(frozen=True, slots=True)
class ServedRecord:
    since_ms: int  # when a leader first saw the group served
    scheduler: str

    def to_bytes(self) -> bytes:
        return _dump(asdict(self))
