"""API keys: ``Authorization: Bearer <key>`` checked against configured sha256 digests,
each key with a request rate limit of its own.

Only digests are configured (``gateway.api_key_sha256``), so the config file holds no
secret. Every configured digest is compared with :func:`hmac.compare_digest`, so the time
taken says nothing about which key or how much of it matched. No digests configured means
the gateway is open; :func:`warn_if_open` logs that once at start-up.

With ``gateway.api_key_rate_limit_rps`` set, each key has a token bucket of that rate
(``api_key_rate_limit_burst`` deep): a request over it is refused with 429
``rate_limit_exceeded`` and a ``Retry-After`` of when the next token is due, before it
costs anything else. Limits are per gateway process.

With ``gateway.api_key_max_in_flight`` set, each key may have that many requests (each
choice and prompt of a response counts) in flight at once (:class:`KeySlots`, taken with
the group's slots at admission, given back when the request lands): beyond it, 429.

``gateway.api_key_groups`` binds a key to the instance groups it may use: :meth:`ApiKeys.check`
returns them, and classification and admission keep its requests inside them (403
``permission_denied`` for a group it names and may not use).

``gateway.api_key_min_priority`` bounds how urgent a key's requests may say they are
(:meth:`KeyGrant.priority`: 403 ``priority_not_allowed`` beyond it; a request naming none
runs at the floor when that is above 0): a key asking for
the most urgent priority was served before every other tenant's requests in its group and
made their running ones the preemption victims.

``gateway.cache_isolation: api_key`` gives each key a prefix-cache namespace of its own
(:attr:`KeyGrant.cache_namespace`, derived from its digest): one team's requests then never
reuse, and so can never time, the KV blocks of another's prompts.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial

from common.errors import (
    AuthenticationError,
    InvalidRequestError,
    PermissionDeniedError,
    RateLimitError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyGrant:
    """What an accepted request's key may do: the groups it may use (None: every group), its
    prefix-cache namespace ("": the cache everyone shares) and the most urgent priority it
    may ask for."""

    groups: frozenset[str] | None = None
    cache_namespace: str = ""
    min_priority: int | None = None  # the most urgent priority it may ask for; None: any
    slots: KeySlots | None = field(default=None, compare=False)  # None: no in-flight cap
    name: str = ""  # what the qos_gateway_key_* metrics count it under; "": an open gateway

    def priority(self, asked: int | None) -> int:
        """The priority a request of this key runs at: what it asked for (0 if nothing, or
        the key's floor when that is above 0), or 403 ``priority_not_allowed`` for one more
        urgent than the floor."""
        floor = self.min_priority
        if asked is None:
            return 0 if floor is None else max(0, floor)
        if floor is not None and asked < floor:
            raise PermissionDeniedError(
                f"this API key may not ask for priority {asked} (lower is more urgent; "
                f"the most urgent it may ask for is {floor})",
                code="priority_not_allowed",
                param="priority",
            )
        return asked


class KeySlots:
    """The requests one key has in flight through this gateway, at most ``limit``: its
    share of the groups' slots, so one tenant's long streams or wide batches cannot fill a
    group's ``max_pending`` for everyone else (the rate limit bounds arrivals, not
    occupancy)."""

    __slots__ = ("held", "limit", "on_full")

    def __init__(self, limit: int, on_full: Callable[[], None] = lambda: None) -> None:
        self.limit = limit
        self.held = 0
        self.on_full = on_full  # told of each 429 (the key's refusals metric)

    def take(self, count: int = 1) -> None:
        """Hold ``count`` more, or raise as :meth:`shed_if_full` does."""
        self.shed_if_full(count)
        self.held += count

    def give_back(self, count: int = 1) -> None:
        self.held -= count

    def shed_if_full(self, count: int = 1) -> None:
        """Raise, taking nothing, where ``count`` more could not be held: 400 for more than
        the key may ever hold (a 429 would invite retries for ever), else 429 while it holds
        too many. Also checked before a request's prompt is rendered and tokenized, which a
        one-key flood spent on requests sure to be refused."""
        if count > self.limit:
            raise InvalidRequestError(
                f"{count} choices and prompts exceed this API key's limit of {self.limit} "
                "requests in flight",
                param="n",
            )
        if self.held + count > self.limit:
            raise self._full()

    def _full(self) -> RateLimitError:
        self.on_full()
        return RateLimitError(
            f"this API key has {self.held} requests in flight, its limit is {self.limit}",
            retry_after_s=1.0,
            code="rate_limit_exceeded",
        )


OPEN_GRANT = KeyGrant()


def cache_namespace(digest: bytes) -> str:
    """A key's prefix-cache namespace: 32 hex digits, one-way from its digest, the same on
    every gateway (so a key's prefixes are shared across gateways and workers)."""
    return hashlib.blake2b(digest, digest_size=16, person=b"qos-kv-namespace").hexdigest()


def key_digest(key: str) -> str:
    """The sha256 hex digest to put in ``gateway.api_key_sha256`` for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; :meth:`take` one or say when."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> float:
        """0.0 when a token was taken; else the seconds until one is due."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class ApiKeys:
    """The accepted keys (as digests); ``check`` raises 401 (or 429 over a key's rate)."""

    def __init__(
        self,
        digests: Iterable[str],
        *,
        rate_per_s: float = 0.0,
        burst: int = 0,
        groups: Mapping[str, Iterable[str]] | None = None,
        min_priority: Mapping[str, int] | None = None,
        isolate_cache: bool = False,
        max_in_flight: int = 0,
        names: Mapping[str, str] | None = None,
        on_refused: Callable[[str, str], None] = lambda key, reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``names``: per digest, the name its metrics go under (else its first 8 hex
        digits); ``on_refused(name, reason)``: told of each 429 for the key's own limits
        (``rate``, ``in_flight``)."""
        wrong = ValueError("gateway.api_key_sha256 entries must be sha256 hex digests")
        try:
            self._digests = [bytes.fromhex(d.strip().lower()) for d in digests]
        except ValueError:
            raise wrong from None
        if any(len(d) != 32 for d in self._digests):
            raise wrong
        # Per key (same order as the digests): the groups it may use; None = every group.
        by_digest = {
            bytes.fromhex(d.strip().lower()): frozenset(g) for d, g in (groups or {}).items()
        }
        floors = {bytes.fromhex(d.strip().lower()): p for d, p in (min_priority or {}).items()}
        named = {bytes.fromhex(d.strip().lower()): n for d, n in (names or {}).items()}
        self._on_refused = on_refused
        self._grants = []
        for d in self._digests:
            name = named.get(d) or d.hex()[:8]
            slots = None
            if max_in_flight > 0:
                slots = KeySlots(max_in_flight, partial(on_refused, name, "in_flight"))
            self._grants.append(
                KeyGrant(
                    by_digest.get(d),
                    cache_namespace(d) if isolate_cache else "",
                    floors.get(d),
                    slots,
                    name,
                )
            )
        self._buckets: list[TokenBucket] | None = None
        if rate_per_s > 0:
            depth = burst or max(1, math.ceil(rate_per_s))
            self._buckets = [TokenBucket(rate_per_s, depth, clock) for _ in self._digests]

    @property
    def open(self) -> bool:
        return not self._digests

    def warn_if_open(self) -> None:
        if self.open:
            log.warning(
                "no API keys configured (gateway.api_key_sha256): the gateway accepts every request"
            )

    def check(self, authorization: str | None, *, rate_limited: bool = True) -> KeyGrant:
        """Accept the request and return what its key may do, or raise
        :class:`AuthenticationError` (401) or, for a key over its rate,
        :class:`RateLimitError` (429). ``rate_limited=False``: a cheap read (the model
        list) that takes nothing from the key's bucket: UIs and uptime checks that poll it
        spent the budget of the key's generations."""
        if self.open:
            return OPEN_GRANT
        if not authorization:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
            )
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("malformed Authorization header: expected 'Bearer <key>'")
        digest = hashlib.sha256(key.strip().encode()).digest()
        matched = -1
        for i, accepted in enumerate(self._digests):
            # No early exit: every key costs the same.
            if hmac.compare_digest(digest, accepted):
                matched = i
        if matched < 0:
            raise AuthenticationError("incorrect API key provided")
        if self._buckets is not None and rate_limited:
            wait_s = self._buckets[matched].take()
            if wait_s > 0:
                self._on_refused(self._grants[matched].name, "rate")
                raise RateLimitError(
                    "this API key is over its request rate limit "
                    f"({self._buckets[matched].rate:g} requests/s)",
                    retry_after_s=wait_s,
                    code="rate_limit_exceeded",
                )
        return self._grants[matched]
