"""The highest offered rate at which a batching policy still meets the SLO, from a rate sweep.

The field study compares policies by the request rate each sustains *at the same SLO*. Here a
sweep step (one offered rate, a few seconds of the field mix) **meets the SLO** when

- every judged group that carried requests in the step (``realtime`` and ``short``, the
  interactive groups the issue names) has an E2E p99 within its group's ``slo_e2e_p99_ms``
  (``common.config``; short: 500 ms, realtime: 200 ms),
- the ``long`` group's TTFT p99 is within its ``slo_ttft_ms`` (5 s): a step of a few
  seconds drains whatever queued before it is judged, so a rate the long group cannot keep
  up with shows first as its requests' wait, which this bounds (its E2E is not judged:
  documents take seconds by design), and
- at least 99 % of the step's requests completed, all groups together and each judged
  group on its own (a policy that sheds long documents must not pass on the strength of
  the short questions around them: long is a fifth of the mix, so a quarter of its requests
  could fail inside a pooled 99 %, and the TTFT p99 of the rest looked fine; a group whose
  every request failed has no p99 to judge and fails here), and
- where the step says how late its load went out, the send lag's p99 is within a tenth
  (``LAG_SHARE``) of the tightest SLO among the judged groups that carried requests: the
  load generator shares the cores with the stack, latencies are timed from the send, and a
  generator behind its schedule neither offered the rate nor measured what users would see.

A policy's **rate at SLO** is the highest offered rate ``r`` such that every step at or below
``r`` met the SLO: the first miss ends it, so a lucky pass above a miss (noise on a shared
machine) does not count. The true rate lies in ``[rate, first_miss)``. There is no
interpolation between steps: p99 latency bends sharply upward near saturation, so a line
through a passing and a failing step puts the crossing wherever the bend happens to fall.
Steps should therefore be close (a geometric sweep), and ratios carry the bracket: the
policy's rate against the baseline's, and the lowest and highest ratio the brackets allow.

A p99 over fewer than a hundred requests is close to their maximum, which makes a low-rate
step a stricter test than a long run at the same rate would be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

JUDGED_GROUPS = ("realtime", "short")
TTFT_JUDGED_GROUPS = ("long",)
MIN_COMPLETED = 0.99


# A step whose load went out later than this share of the tightest judged SLO (p99) did
# not offer its rate: it is a miss, whatever its latencies say.
LAG_SHARE = 0.1


@dataclass(frozen=True)
class StepFigures:
    """What the SLO check needs from one sweep step."""

    offered: float  # sessions per second
    req_s: float  # requests completed per second
    sent: int  # requests sent, all groups
    completed: int  # of those, completed
    e2e_p99_ms: Mapping[str, float]  # per group that completed at least one request
    ttft_p99_ms: Mapping[str, float] = field(default_factory=dict)  # the same groups
    sent_by_group: Mapping[str, int] = field(default_factory=dict)
    completed_by_group: Mapping[str, int] = field(default_factory=dict)
    send_lag_p99_ms: float | None = None  # how late the load went out; None: not known


@dataclass(frozen=True)
class StepVerdict:
    offered: float
    met: bool
    why: str  # what missed; empty when met


@dataclass(frozen=True)
class RateAtSlo:
    """A policy's rate at SLO and the step above it; None where the sweep gives no bound."""

    rate: float | None  # None: the lowest step already missed
    req_s: float | None  # completed req/s in the step at ``rate``
    first_miss: float | None  # None: every step met the SLO (the sweep did not reach the limit)
    steps: tuple[StepVerdict, ...]


def check_step(
    step: StepFigures,
    slo_e2e_p99_ms: Mapping[str, float],
    groups: Sequence[str] = JUDGED_GROUPS,
    min_completed: float = MIN_COMPLETED,
    slo_ttft_ms: Mapping[str, float] | None = None,
) -> StepVerdict:
    """Whether ``step`` meets the SLO (see the module docstring), and why not.
    ``slo_ttft_ms`` None: no TTFT rule (the long group's wait is not judged)."""
    misses = []
    if step.sent == 0 or step.completed < min_completed * step.sent:
        misses.append(f"{step.completed}/{step.sent} completed")
    ttft_slos = slo_ttft_ms or {}
    for group in (*groups, *(g for g in TTFT_JUDGED_GROUPS if g in ttft_slos)):
        sent = step.sent_by_group.get(group, 0)
        done = step.completed_by_group.get(group, 0)
        if sent and done < min_completed * sent:
            misses.append(f"{group} {done}/{sent} completed")
    for group in groups:
        p99 = step.e2e_p99_ms.get(group)
        if p99 is not None and p99 > slo_e2e_p99_ms[group]:
            misses.append(f"{group} E2E p99 {p99:.0f} > {slo_e2e_p99_ms[group]:.0f} ms")
    for group in (g for g in TTFT_JUDGED_GROUPS if g in ttft_slos):
        p99 = step.ttft_p99_ms.get(group)
        if p99 is not None and p99 > ttft_slos[group]:
            misses.append(f"{group} TTFT p99 {p99:.0f} > {ttft_slos[group]:.0f} ms")
    lag = step.send_lag_p99_ms
    judged = [slo_e2e_p99_ms[g] for g in groups if g in step.e2e_p99_ms]  # that carried any
    if lag is not None and judged and lag > LAG_SHARE * min(judged):
        # The offered rate was not offered: the load generator fell behind its schedule,
        # and latencies timed from the late sends read better than the users' would.
        misses.append(f"load sent late (p99 {lag:.0f} ms)")
    return StepVerdict(step.offered, not misses, "; ".join(misses))


def rate_at_slo(
    steps: Sequence[StepFigures],
    slo_e2e_p99_ms: Mapping[str, float],
    groups: Sequence[str] = JUDGED_GROUPS,
    min_completed: float = MIN_COMPLETED,
    slo_ttft_ms: Mapping[str, float] | None = None,
) -> RateAtSlo:
    """The highest offered rate below the first step (by rate) that misses the SLO."""
    ordered = sorted(steps, key=lambda s: s.offered)
    verdicts = tuple(
        check_step(s, slo_e2e_p99_ms, groups, min_completed, slo_ttft_ms) for s in ordered
    )
    rate = req_s = first_miss = None
    for step, verdict in zip(ordered, verdicts, strict=True):
        if not verdict.met:
            first_miss = step.offered
            break
        rate, req_s = step.offered, step.req_s
    return RateAtSlo(rate, req_s, first_miss, verdicts)


def ratio_at_slo(policy: RateAtSlo, base: RateAtSlo) -> dict[str, float | None]:
    """``policy``'s rate at SLO over ``base``'s, with the bounds the two brackets allow.

    The true rates lie in ``[rate, first_miss)``, so the true ratio lies between
    ``low = policy.rate / base.first_miss`` and ``high = policy.first_miss / base.rate``.
    ``ratio`` is None when either rate is missing; ``low`` is 0 and ``high`` None (unbounded)
    where a bracket is open.
    """
    ratio = policy.rate / base.rate if policy.rate and base.rate else None
    low = policy.rate / base.first_miss if policy.rate and base.first_miss else 0.0
    high = policy.first_miss / base.rate if policy.first_miss and base.rate else None
    return {
        "ratio": _round(ratio),
        "low": _round(low),
        "high": _round(high),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
