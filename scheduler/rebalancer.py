"""The rebalancer: a pure decision from a fleet snapshot to desired replicas and moves.

:func:`decide` takes one :class:`GroupView` per group, the memory of the previous call
(:class:`RebalancerState`) and the time, and returns a :class:`Decision`: the replicas each
group should have (published as ``qos_desired_replicas{group}`` and ``desired.<group>`` for
an autoscaler) and, for a fixed fleet, at most one :class:`Move` of an idle replica.

**Desired replicas** of a group, the largest of:

- the demand now: ``ceil(concurrency / (max_batch × target_utilization))``, concurrency
  being the window's mean of running + waiting + queued requests (KEDA's lag rule in
  requests: a replica is full at ``target_utilization`` of its batch);
- the demand the hour-of-week history expects now or in the coming hour, same rule;
- ``replicas + 1`` while the group's p99 is over its SLO with work queued (no headroom);
- the group's minimum; and at most ``max_replicas``.

**A move** takes an idle replica (serving, nothing running or waiting) from a *source* —
no backlog (its queue depth known), closed breaker, more replicas than both its minimum
and its desired count and never its last one, the most SLO headroom (lowest p99 / SLO) —
to the *destination* with the most backlog per batch slot (``backlog / max_batch``) among
groups with a backlog that want more replicas, then to a group that fell below its
minimum (its last replica died). The replica must hold the sequences the destination
serves now (``GroupView.seq_need``): a worker whose KV cache holds 32k tokens moved into a
group whose replicas serve 128k would cut the group's limit (the gateway limits a group to
what its live workers serve) and fail the long requests already queued.
Hysteresis: the same (source, destination) pair must win ``move_after_ticks`` calls in a
row, so input that flaps between groups never moves anything; after a move, neither group
gives up a replica and the moved worker does not move again for ``cooldown_s`` (unless
the move is not seen done in time: :mod:`scheduler.moves` lifts the groups' cooldowns).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One live worker as the rebalancer needs it."""

    worker: str
    running: int = 0
    waiting: int = 0
    serving: bool = True
    capacity: int = 0  # the longest sequence its engine holds; 0 = not said (any)

    @property
    def idle(self) -> bool:
        return self.serving and self.running == 0 and self.waiting == 0


@dataclass(frozen=True, slots=True)
class GroupView:
    """One group's figures at this decision."""

    name: str
    replicas: tuple[ReplicaView, ...] = ()
    backlog: int = 0  # queued requests no replica works on
    concurrency: float = 0.0  # mean running + waiting + queued over the window
    p99_ms: float = 0.0
    slo_ms: float = 1.0
    max_batch: int = 1
    min_replicas: int = 1
    forecast: float = 0.0  # expected concurrency from the hour-of-week history
    breaker: str = "closed"
    # The sequence length a replica moved here must hold: what the group's live replicas
    # serve now (its max_seq_len, or less); 0 = none serves it: any replica beats none,
    # the one that holds the longest sequences first.
    seq_need: int = 0
    rank: int = 0  # the group's rank: lower is served first (realtime before short)
    # False while JetStream did not say how deep the group's queue is (its backlog then
    # reads 0): such a group gives up no replica and keeps its desired count.
    depth_known: bool = True
    # Whether the group had a live replica since this scheduler began: one that lost its
    # last is refilled to its minimum; one never served here may be meant empty.
    was_served: bool = False

    @property
    def serving(self) -> int:
        return sum(1 for r in self.replicas if r.serving)

    @property
    def headroom(self) -> float:
        """1 − p99/SLO: 1 idle, 0 at the SLO, negative over it."""
        return 1.0 - self.p99_ms / self.slo_ms if self.slo_ms > 0 else 0.0


@dataclass(frozen=True, slots=True)
class RebalanceSettings:
    move_replicas: bool = True
    move_after_ticks: int = 3
    cooldown_s: float = 60.0
    target_utilization: float = 0.8
    max_replicas: int = 64


@dataclass(frozen=True, slots=True)
class Move:
    """Send ``assign_group(dst)`` to ``worker``, now serving ``src``."""

    worker: str
    src: str
    dst: str
    reason: str


@dataclass(frozen=True, slots=True)
class RebalancerState:
    """What :func:`decide` remembers between calls."""

    pair: tuple[str, str] | None = None  # the (source, destination) that won last time
    streak: int = 0  # how many calls in a row it won
    # "group:<name>" / "worker:<id>" -> time until which it gives up no replica
    cooldown_until: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    desired: dict[str, int]
    moves: tuple[Move, ...]
    state: RebalancerState
    why: dict[str, str]  # group -> what set its desired count


def desired_replicas(g: GroupView, settings: RebalanceSettings) -> tuple[int, str]:
    """How many replicas ``g`` should have, and which rule said so."""
    per_replica = max(1.0, g.max_batch * settings.target_utilization)
    candidates = [
        (g.min_replicas, "minimum"),
        (math.ceil(g.concurrency / per_replica - 1e-9), "demand"),
        (math.ceil(g.forecast / per_replica - 1e-9), "history"),
    ]
    if g.p99_ms > g.slo_ms and g.backlog > 0:
        candidates.append((g.serving + 1, "slo"))
    if not g.depth_known:  # its backlog is not known to be 0: not a reason to shrink
        candidates.append((g.serving, "queue depth unknown"))
    count, why = max(candidates, key=lambda c: c[0])
    return max(0, min(count, settings.max_replicas)), why


def decide(
    groups: Sequence[GroupView],
    state: RebalancerState,
    settings: RebalanceSettings,
    now: float,
) -> Decision:
    """Desired replicas per group and at most one move; see the module docstring."""
    desired: dict[str, int] = {}
    why: dict[str, str] = {}
    for g in groups:
        desired[g.name], why[g.name] = desired_replicas(g, settings)
    cooldown = {k: t for k, t in state.cooldown_until.items() if t > now}
    pair = _best_pair(groups, desired, cooldown) if settings.move_replicas else None
    if pair is None:
        return Decision(desired, (), RebalancerState(None, 0, cooldown), why)
    streak = state.streak + 1 if state.pair == pair else 1
    if streak < settings.move_after_ticks:
        return Decision(desired, (), RebalancerState(pair, streak, cooldown), why)
    by_name = {g.name: g for g in groups}
    src, dst = by_name[pair[0]], by_name[pair[1]]
    worker = _idle_worker(src, cooldown, dst.seq_need)
    assert worker is not None  # _best_pair only picks sources that have one
    need = (
        f"backlog {dst.backlog}" if dst.backlog > 0 else f"below its minimum of {dst.min_replicas}"
    )
    move = Move(
        worker,
        src.name,
        dst.name,
        f"{dst.name} {need} with {dst.serving} replicas (wants "
        f"{desired[dst.name]}); {src.name} idle with headroom {src.headroom:.2f}",
    )
    until = now + settings.cooldown_s
    cooldown.update(
        {f"worker:{worker}": until, f"group:{src.name}": until, f"group:{dst.name}": until}
    )
    return Decision(desired, (move,), RebalancerState(None, 0, cooldown), why)


def _idle_worker(g: GroupView, cooldown: Mapping[str, float], seq_need: int = 0) -> str | None:
    """An idle replica of ``g`` that may move and holds ``seq_need`` tokens (by name); with
    no need known (``seq_need`` 0: the destination has no live replica), the one holding
    the longest sequences (a 32k one would cap a 128k group's limit and fail its queue)."""
    idle = [
        r
        for r in g.replicas
        if r.idle
        and f"worker:{r.worker}" not in cooldown
        and (r.capacity == 0 or r.capacity >= seq_need)
    ]
    if not idle:
        return None
    if seq_need == 0:  # capacity 0 is "not said": it holds whatever its group serves
        return min(idle, key=lambda r: (-(r.capacity or math.inf), r.worker)).worker
    return min(r.worker for r in idle)


def _best_pair(
    groups: Sequence[GroupView],
    desired: Mapping[str, int],
    cooldown: Mapping[str, float],
) -> tuple[str, str] | None:
    # Groups with a backlog first, by rank (realtime before short), then the most backlog
    # per batch slot; then groups that lost replicas below their minimum (one whose last
    # replica died gets no backlog: the gateway refuses its requests with a 503 while it
    # has no live worker). Each in turn, so one no idle replica can hold (long's 131k)
    # does not block the next. (A group never served, or with min_replicas 0, is not
    # filled without a backlog: it may be meant empty, scaled to zero by KEDA, its
    # traffic going to its fallback.)
    destinations = sorted(
        (
            g
            for g in groups
            if desired[g.name] > g.serving
            and (g.backlog > 0 or (g.was_served and g.serving < g.min_replicas))
        ),
        key=lambda g: (g.backlog == 0, g.rank, -g.backlog / g.max_batch, g.name),
    )
    for dst in destinations:
        sources = [
            g
            for g in groups
            if g.name != dst.name
            and g.backlog == 0
            and g.depth_known
            and g.breaker == "closed"
            and g.headroom > 0  # within its SLO: one over it keeps what it has
            and f"group:{g.name}" not in cooldown
            and g.serving - 1 >= max(1, g.min_replicas, desired[g.name])
            and _idle_worker(g, cooldown, dst.seq_need) is not None
        ]
        if sources:
            src = max(sources, key=lambda g: (g.headroom, g.serving - desired[g.name], g.name))
            return src.name, dst.name
    return None
