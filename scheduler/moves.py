"""Moves ordered and not yet seen done: an ``assign_group`` is a wish until a report says so.

The order goes over core NATS and nothing acknowledges it; a worker may drop it (the
message lost, its clock reading it as stale, a group it was not configured with, a bind
that failed and went back). A move is done once a report shows the worker *serving* in
its destination: a worker names its new group as it starts binding, and reports it while
still draining, so a bind that failed and went back read as done. One not seen serving there
by its deadline, its replica not still draining in its
source group (a request it held runs to its end), failed: the cooldowns it set on its two
groups are lifted and its worker is kept out of moves for a cooldown, so the next idle
replica gets the turn. Before, the move counted as made, and once the cooldown ran out the
same replica (idle ones are picked by name) was ordered again, and again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from scheduler.rebalancer import Move, RebalancerState

# A worker's drain grace by default (``--grace-s``): an idle replica drains at once, but a
# request fetched just before the order runs to its end (or the grace) before the move.
MOVE_DRAIN_S = 30.0


@dataclass(frozen=True, slots=True)
class PendingMove:
    """A move ordered at some time, to be seen done by ``deadline``."""

    move: Move
    deadline: float
    cooldown_until: float  # what the order set on its worker and both groups


# A worker seen in its destination but still binding there, past the move's deadline: how
# much longer it has to come up serving before the move counts failed.
BIND_GRACE_S = 30.0


class PendingMoves:
    """The moves ordered and not yet settled, one per worker."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._pending: dict[str, PendingMove] = {}

    def ordered(self, move: Move, now: float, cooldown_until: float) -> None:
        self._pending[move.worker] = PendingMove(move, now + self.deadline_s, cooldown_until)

    def settle(
        self, reports: Mapping[str, tuple[str, str]], now: float
    ) -> tuple[list[PendingMove], list[PendingMove]]:
        """(done, failed): the moves whose worker now reports serving in its destination
        (``reports``: worker -> (group, state) of its latest report), and those past their
        deadline without that. A worker still draining in its source group is not past it:
        a request it held runs to its end (the long group drains for a minute), and a move
        counted failed then let a second replica leave the same group. Nor, for
        :data:`BIND_GRACE_S` more, is one already in its destination, still binding (its
        binds retry with backoff) after draining to near the deadline. Both leave the
        pending set."""
        done, failed = [], []
        for p in self._pending.values():
            group, state = reports.get(p.move.worker, ("", ""))
            binding = group == p.move.dst and state == "draining"
            if group == p.move.dst and state == "serving":
                done.append(p)
            elif (
                now >= p.deadline
                and not (group == p.move.src and state == "draining")
                and not (binding and now < p.deadline + BIND_GRACE_S)
            ):
                failed.append(p)
        for p in (*done, *failed):
            del self._pending[p.move.worker]
        return done, failed

    def clear(self) -> None:
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)


def after_failure(
    state: RebalancerState, failed: PendingMove, now: float, exclude_s: float
) -> RebalancerState:
    """``state`` with the failed move's group cooldowns lifted (those a later move did not
    extend) and its worker kept out of moves until ``now + exclude_s``."""
    move = failed.move
    cooldown = dict(state.cooldown_until)
    for key in (f"group:{move.src}", f"group:{move.dst}"):
        if cooldown.get(key, 0.0) <= failed.cooldown_until:
            cooldown.pop(key, None)
    cooldown[f"worker:{move.worker}"] = now + exclude_s
    return replace(state, cooldown_until=cooldown)
