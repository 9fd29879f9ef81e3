"""Admission control: which group takes a classified request now, or why none can.

For a request classified into group ``g`` (see :mod:`gateway.classifier`), the candidates
are ``g`` and then its ``fallback`` chain (``realtime → short → long`` by default). The
first candidate that passes all of these takes it:

1. its breaker is not ``open`` (``half_open`` admits ``breaker.half_open_share`` of the
   traffic, counted deterministically, and passes the rest down the chain);
2. it has a live worker (:class:`~gateway.workers_view.WorkersView`);
3. the request fits its ``max_seq_len`` (the classifier checked ``g`` itself).

Then the chosen group's own cap applies: at most ``max_pending`` requests in flight
through this gateway, else **429** with ``Retry-After``. When no candidate passes, the
request waits up to ``min(deadline, wait_s)`` (2 s) for a worker of any candidate to
appear, holding a waiter's slot of ``g`` (at most ``max_pending`` waiters, counted apart
from admitted requests: counted with them, waiters for a dead fallback filled a half-open
group and left its probes no room); then **503** with
``Retry-After``. A route that is not ``g`` records why (``no_worker``, ``breaker_open``,
``breaker_half_open``, ``too_many``) for the response header and the fallback counter.

When every group a key may use is serving and full, a request is answered 429 before its
prompt is rendered and tokenized (:meth:`Admission.shed_if_all_full`): whatever its group,
it would be refused.

A response of several choices (OpenAI's ``n``, a batch of prompts) takes its slots at once,
in one group: one whose ``max_pending`` could never hold them is passed over, and a
half-open group takes it only with a turn for each choice (so, at a share under 1, never).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from common.config import Config
from common.errors import RateLimitError, ServiceUnavailableError
from gateway.auth import KeySlots
from gateway.workers_view import WorkersView

ADMISSION_WAIT_S = 2.0
RETRY_AFTER_FULL_S = 1.0
RETRY_AFTER_UNAVAILABLE_S = 2.0
RETRY_AFTER_MAX_S = 60.0  # the openai client honours a Retry-After up to 60 s


@dataclass(frozen=True, slots=True)
class Route:
    """Where an admitted request goes, and, for a fallback, from where and why."""

    group: str
    requested: str
    reason: str | None = None  # None = the requested group itself
    key: KeySlots | None = field(default=None, compare=False)  # the key's slots it holds

    @property
    def is_fallback(self) -> bool:
        return self.group != self.requested


class Admission:
    """Per-group in-flight counts and the routing decision; one per gateway process."""

    def __init__(
        self, config: Config, view: WorkersView, *, wait_s: float = ADMISSION_WAIT_S
    ) -> None:
        self._groups = config.groups
        self._view = view
        self._wait_s = wait_s
        self._in_flight: dict[str, int] = dict.fromkeys(config.groups, 0)  # admitted
        self._waiting: dict[str, int] = dict.fromkeys(config.groups, 0)
        self._half_open_seen: dict[str, int] = dict.fromkeys(config.groups, 0)
        self._chains = {name: self._chain(name) for name in config.groups}

    def _chain(self, group: str) -> list[str]:
        chain = [group]
        nxt = self._groups[group].fallback
        while nxt is not None and nxt not in chain:
            chain.append(nxt)
            nxt = self._groups[nxt].fallback
        return chain

    def seq_limit(self, group: str) -> int:
        """The longest request ``group`` takes now (see :meth:`WorkersView.seq_limit`)."""
        return self._view.seq_limit(group, self._groups[group].max_seq_len)

    def max_model_len(
        self, groups: Collection[str] | None = None, allowed: Collection[str] | None = None
    ) -> int:
        """The longest request any of ``groups`` (None: all) takes now, of those a key
        ``allowed`` may use (all of them when it may use none)."""
        names = list(self._groups) if groups is None else list(groups)
        names = [n for n in names if allowed is None or n in allowed] or names
        return max(self.seq_limit(name) for name in names)

    def shed_if_all_full(self, allowed: Collection[str] | None = None) -> None:
        """429 at once when every group the key may use is serving and full: whatever group
        the request is classified into, admission would refuse it, and under a flood each
        such request had its chat template rendered and its prompt tokenized first."""
        names = [g for g in self._groups if allowed is None or g in allowed]
        if names and all(
            self._view.is_live(g)
            and self._view.breaker(g) != "open"
            and self._in_flight[g] >= self._groups[g].max_pending
            for g in names
        ):
            self._take(names[0])  # raises its 429

    def in_flight(self, group: str) -> int:
        """Requests holding a slot of ``group``: admitted, or waiting for a route."""
        return self._in_flight.get(group, 0) + self._waiting.get(group, 0)

    async def admit(
        self,
        group: str,
        need_tokens: int,
        time_left_s: float,
        allowed: Collection[str] | None = None,
        count: int = 1,
        key: KeySlots | None = None,
    ) -> Route:
        """Choose the group for a request needing ``need_tokens`` of context, and take a
        slot in it; release it with :meth:`release`. Raises 429/503 errors. ``allowed``:
        the groups the caller's key may use (a fallback outside them is not taken).
        ``count``: slots taken together, in one group (a response's choices and prompts:
        admitted one by one they could land in different groups, or half of them).
        ``key``: the caller's key's own cap, taken first and held with the group's."""
        if key is None:
            return await self._admit(group, need_tokens, time_left_s, allowed, count)
        key.take(count)
        try:
            route = await self._admit(group, need_tokens, time_left_s, allowed, count)
        except BaseException:
            key.give_back(count)
            raise
        return replace(route, key=key)

    async def _admit(
        self,
        group: str,
        need_tokens: int,
        time_left_s: float,
        allowed: Collection[str] | None,
        count: int,
    ) -> Route:
        # A half-open group's turn is decided once per request, however often it is asked.
        turns: dict[str, bool] = {}
        route = self._pick(group, need_tokens, turns, allowed, count)
        if route is None:
            try:  # a waiter holds a slot of its own kind: waiting is bounded by max_pending
                self._take(group, self._waiting)
            except RateLimitError:
                usable = [c for c in self._chains[group] if allowed is None or c in allowed]
                if any(
                    self._view.is_live(c)
                    and self._view.breaker(c) != "open"
                    and need_tokens <= self.seq_limit(c)  # else no retry could be served
                    for c in usable
                ):
                    limit = self._groups[group].max_pending
                    raise RateLimitError(  # full, and served: come back shortly
                        f"instance group {group!r} has {limit} requests waiting for a "
                        "worker already",
                        retry_after_s=RETRY_AFTER_FULL_S,
                    ) from None
                # Full of requests stuck since its workers went away: no worker is the news.
                raise self._unavailable(group, allowed) from None
            try:
                route = await self._wait_for_route(
                    group, need_tokens, turns, allowed, time_left_s, count
                )
            finally:
                self._waiting[group] -= 1
            if route is None:
                # A last look: only workers coming live wake the wait, and a breaker that
                # closed (or a record gone stale) meanwhile would have lost its request.
                route = self._pick(group, need_tokens, turns, allowed, count)
            if route is None:
                full = self._full_half_open(group, need_tokens, allowed, count)
                if full is not None:  # served, only full: come back shortly
                    self._take(full, count=count)  # raises its 429
                raise self._unavailable(group, allowed)
        self._take(route.group, count=count)
        return route

    async def _wait_for_route(
        self,
        group: str,
        need_tokens: int,
        turns: dict[str, bool],
        allowed: Collection[str] | None,
        time_left_s: float,
        count: int = 1,
    ) -> Route | None:
        """Pick again as the chain's groups come live, until min(deadline, wait) passes.
        Waits only on groups the key may use and that are not live yet: a live group this
        request cannot use (breaker open, another team's) ended the wait at once, and any
        report of one woke it to a single last try."""
        end = time.monotonic() + min(time_left_s, self._wait_s)
        while (left := end - time.monotonic()) > 0:
            pending = [
                c
                for c in self._chains[group]
                if (allowed is None or c in allowed) and not self._view.is_live(c)
            ]
            if not pending or not await self._view.wait_live(pending, left):
                return None
            route = self._pick(group, need_tokens, turns, allowed, count)
            if route is not None:
                return route
        return None

    def _full_half_open(
        self, group: str, need_tokens: int, allowed: Collection[str] | None, count: int
    ) -> str | None:
        """The first group of the chain the request could use that was passed over only
        because it is half-open and full (:meth:`_pick` leaves it its probes' room): the
        request is then told to come back (429), not that nobody serves it (503)."""
        for c in self._chains[group]:
            if (
                (allowed is None or c in allowed)
                and self._view.breaker(c) == "half_open"
                and self._view.is_live(c)
                and need_tokens <= self.seq_limit(c)
                and count <= self._groups[c].max_pending
                and self._in_flight[c] + count > self._groups[c].max_pending
            ):
                return c
        return None

    def _unavailable(
        self, group: str, allowed: Collection[str] | None = None
    ) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            f"no worker of instance group {group!r} (or its fallbacks) is available",
            retry_after_s=self._retry_after_unavailable(group, allowed),
        )

    def _retry_after_unavailable(self, group: str, allowed: Collection[str] | None = None) -> float:
        """2 s, or, when every group of the chain the key may use is shut by an open
        breaker that says when it probes, until the first probes (at most a minute): the
        wait grows with each re-open, and a fixed 2 s sent clients back into the same 503
        up to 60 times. A group the key may not use says nothing of when it is served."""
        chain = [c for c in self._chains[group] if allowed is None or c in allowed]
        waits = [self._view.opens_for_s(c) for c in chain or self._chains[group]]
        known = [w for w in waits if w is not None]
        if not known or len(known) < len(waits):
            return RETRY_AFTER_UNAVAILABLE_S
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_UNAVAILABLE_S, min(known)))

    def release(self, route: Route, count: int = 1) -> None:
        """Give back ``count`` slots ``route`` took (its group's and its key's)."""
        self._in_flight[route.group] -= count
        if route.key is not None:
            route.key.give_back(count)

    def _take(self, group: str, counts: dict[str, int] | None = None, count: int = 1) -> None:
        """``count`` slots of ``group`` in ``counts`` (the admitted ones by default), or a
        429."""
        counts = self._in_flight if counts is None else counts
        limit = self._groups[group].max_pending
        if counts[group] + count > limit:
            raise RateLimitError(
                f"instance group {group!r} is at its limit of {limit} pending requests",
                retry_after_s=RETRY_AFTER_FULL_S,
            )
        counts[group] += count

    def _pick(
        self,
        group: str,
        need_tokens: int,
        turns: dict[str, bool],
        allowed: Collection[str] | None = None,
        count: int = 1,
    ) -> Route | None:
        """The group to serve the request (``count`` slots of it), or None."""
        reason: str | None = None
        for candidate in self._chains[group]:
            if allowed is not None and candidate not in allowed:
                continue
            state = self._view.breaker(candidate)
            if state == "open":
                reason = reason or "breaker_open"
                continue
            if not self._view.is_live(candidate):
                reason = reason or "no_worker"
                continue
            # The request's own group too: a worker that came live while it waited may
            # serve less than the limit it was classified under (it would cut the answer).
            if need_tokens > self.seq_limit(candidate):
                reason = reason or "too_long"
                continue
            # A response of more choices than a (fallback) group ever holds: its 429 would
            # never clear.
            if count > self._groups[candidate].max_pending:
                reason = reason or "too_many"
                continue
            # Last: only a request the half-open group could serve spends one of its turns,
            # and not when the group is full (the probe would be a 429, not a probe).
            if state == "half_open":
                if self._in_flight[candidate] + count > self._groups[candidate].max_pending:
                    reason = reason or "full"
                    continue
                if candidate not in turns:
                    turns[candidate] = self._half_open_turn(candidate, count)
                if not turns[candidate]:
                    reason = reason or "breaker_half_open"
                    continue
            return Route(candidate, group, None if candidate == group else reason)
        return None

    def _half_open_turn(self, group: str, count: int = 1) -> bool:
        """Deterministic share: request i is admitted when floor(i * share) steps up. A
        response of ``count`` choices counts as ``count`` requests and needs a turn for
        each: at a share under 1 it is never a probe (one turn let a batch of hundreds
        into a group still recovering), and goes down the chain or waits."""
        share = self._groups[group].breaker.half_open_share
        seen = self._half_open_seen[group]
        self._half_open_seen[group] = seen + count
        return int((seen + count) * share) - int(seen * share) >= count
