"""The leader lease: which scheduler replica acts, kept as ``sched.lease`` in the state bucket.

Any number of scheduler replicas may run; the one holding the lease acts (breaker state,
control messages, desired replicas, history), the others only watch. The value is JSON
``{"holder": <scheduler id>, "expires_ms": <unix ms>, "renewed_ms": <unix ms>}``.

Every write is a compare-and-set on the key's revision (``kv.create`` when absent,
``kv.update(key, value, last=revision)`` otherwise), so of two replicas racing for it
exactly one wins. The holder renews it every ``renew_s``; another replica takes it over
once ``expires_ms`` has passed (a holder that died or lost NATS). Expiry is by wall clock
in the value, so replicas need clocks that agree to well under ``ttl_s`` (NTP does).
A holder that stops cleanly writes an expired value so a standby takes over at its next
renewal instead of waiting out the TTL; nothing deletes the key. A holder whose renewal is
slow (a JetStream call can take longer than the TTL) stops counting itself the holder
(:meth:`Lease.valid`) a margin before the expiry it last wrote, when a standby may take
over, so two replicas never act at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats.js.errors
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)

LEASE_KEY = "sched.lease"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    holder: str
    expires_ms: int
    renewed_ms: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"holder": self.holder, "expires_ms": self.expires_ms, "renewed_ms": self.renewed_ms},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes | None) -> LeaseRecord | None:
        """None for a value that does not decode (it is then free to take)."""
        try:
            obj = json.loads(data or b"")
            return cls(str(obj["holder"]), int(obj["expires_ms"]), int(obj.get("renewed_ms", 0)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


class Lease:
    """``await lease.refresh()`` acquires, renews or takes over; True while held."""

    def __init__(
        self,
        kv: KeyValue,
        holder: str,
        ttl_s: float,
        *,
        key: str = LEASE_KEY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kv = kv
        self.holder = holder
        self.ttl_s = ttl_s
        self.key = key
        self._clock = clock
        self.held = False
        self.current: LeaseRecord | None = None  # the last value seen
        # Terms this replica began: a renewal over any write but our own last one (another
        # replica held it meanwhile, unseen by a holder whose calls were slow, not failing)
        # begins a new one, and the service then starts afresh as on any takeover.
        self.term = 0
        # The lease's revision when this replica's current term began: the bucket's
        # revisions only rise, so a later leader's fence is always higher (a fencing token
        # for its commands and records).
        self.fence = 0
        self._revision: int | None = None  # of our last write
        self._written: bytes | None = None  # its value: found stored, a write whose ack was lost

    def valid(self) -> bool:
        """Held, and the expiry last written is more than a margin away (a quarter of the
        TTL, at most 0.5 s: room for the replicas' clocks to disagree)."""
        if not self.held or self.current is None or self.current.holder != self.holder:
            return False
        margin_ms = min(500.0, self.ttl_s * 250)
        return self.current.expires_ms - margin_ms > self._clock() * 1000

    def _record(self, ttl_s: float) -> LeaseRecord:
        now_ms = int(self._clock() * 1000)
        return LeaseRecord(self.holder, now_ms + int(ttl_s * 1000), now_ms)

    async def refresh(self) -> bool:
        """One round: take the lease when free or stale, renew it when ours.

        When NATS cannot be reached the lease counts as held only until the expiry last
        written: by then a standby that can reach NATS may have taken it over.
        """
        try:
            return await self._refresh()
        except Exception as exc:
            now_ms = int(self._clock() * 1000)
            ours = self.current is not None and self.current.holder == self.holder
            log.warning("lease refresh failed: %s", exc)
            return self._set(ours and self.current is not None and self.current.expires_ms > now_ms,
                             self.current)  # fmt: skip

    async def _refresh(self) -> bool:
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        mine = self._record(self.ttl_s)
        ours = entry is not None and (
            entry.revision == self._revision
            or (entry.value is not None and entry.value == self._written)
        )
        try:
            self._written = mine.to_bytes()
            if entry is None:
                revision = await self.kv.create(self.key, mine.to_bytes())
            else:
                seen = LeaseRecord.from_bytes(entry.value)
                self.current = seen
                taken = seen is not None and seen.expires_ms > mine.renewed_ms
                if seen is not None and taken and seen.holder != self.holder:
                    return self._set(False, seen)
                revision = await self.kv.update(self.key, mine.to_bytes(), last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return self._set(False, self.current)  # another replica wrote first
        if not ours or not self.held:
            self.term += 1
            self.fence = revision
        self._revision = revision
        return self._set(True, mine)

    async def release(self) -> None:
        """Give the lease up now (a clean stop): write it expired, if it is still ours."""
        if not self.held:
            return
        self.held = False
        try:
            entry = await self.kv.get(self.key)
            seen = LeaseRecord.from_bytes(entry.value)
            if seen is not None and seen.holder == self.holder:
                await self.kv.update(self.key, self._record(0).to_bytes(), last=entry.revision)
                self._revision = self._written = None
        except Exception as exc:  # a standby takes over after the TTL anyway
            log.info("lease release failed: %s", exc)

    def _set(self, held: bool, record: LeaseRecord | None) -> bool:
        if held != self.held:
            log.info(
                "scheduler %s %s the lease%s",
                self.holder,
                "holds" if held else "lost",
                "" if held or record is None else f" (held by {record.holder})",
            )
        self.held, self.current = held, record
        return held
