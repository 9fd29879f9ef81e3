"""bench.serve's max-rps ramp, against a target whose capacity and bad moments are known."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.serve import mode_max_rps, parse_args
from bench.serve_http import Result


class FakeTarget:
    """Sustains ``capacity`` req/s (p99 5 ms); above it, or during its first ``bad`` loads
    after the warm-up (a neighbour's burst), p99 goes to 200 ms."""

    def __init__(self, capacity: float, bad: int = 0, queue_hidden: bool = False) -> None:
        self.capacity, self.bad, self.loads = capacity, bad, 0
        # Above capacity, completions just come at capacity: a queue too short-lived to
        # show in the p99 (a 6 s step).
        self.queue_hidden = queue_hidden

    async def load(
        self, work: list[Any], offsets: list[float], concurrency: int | None
    ) -> tuple[list[Result], float]:
        self.loads += 1
        duration = max(offsets[-1], 1e-3) if offsets and offsets[-1] != float("inf") else 1.0
        rate = len(work) / duration
        if self.queue_hidden:
            duration = max(duration, len(work) / self.capacity)
            rate = 0.0
        slow = self.loads > 1 and (rate > self.capacity or self.loads <= 1 + self.bad)
        e2e = 0.2 if slow else 0.005
        results = [Result(ok=True, status=200, ttft=e2e, e2e=e2e, output_tokens=4) for _ in work]
        await asyncio.sleep(0)
        return results, duration

    def cpu_seconds(self) -> dict[str, float]:
        return {"load-generator": 0.0}


def _args(start: float) -> Any:
    return parse_args(["--mode", "max-rps", "--base-url", "http://unused", "--request-rate",
                       str(start), "--ramp-factor", "1.25", "--step-s", "2"])  # fmt: skip


async def test_the_ramp_stops_below_the_capacity() -> None:
    report, _ = await mode_max_rps(_args(100), FakeTarget(capacity=300))  # type: ignore[arg-type]
    assert 200 <= report["max_sustained_rps"] <= 300


async def test_a_failed_start_halves_the_rate_instead_of_reporting_nothing() -> None:
    # Too high a start: 850 then 425 fail; 212 holds, and the ramp climbs back to ~300.
    report, _ = await mode_max_rps(_args(850), FakeTarget(capacity=300))  # type: ignore[arg-type]
    offered = [s["offered_rps"] for s in report["steps"]]
    assert offered[:5] == [850.0, 850.0, 425.0, 425.0, 212.5]
    assert 200 <= report["max_sustained_rps"] <= 300


async def test_a_burst_at_the_first_step_costs_steps_not_the_result() -> None:
    report, _ = await mode_max_rps(_args(200), FakeTarget(capacity=300, bad=2))  # type: ignore[arg-type]
    assert report["steps"][0]["p99_ms"] > 50 and report["steps"][1]["p99_ms"] > 50
    assert 200 <= report["max_sustained_rps"] <= 300


async def test_a_step_offered_over_capacity_is_not_held_on_a_queue_its_p99_hides() -> None:
    """At 0.9 of the nominal rate, a step offered up to 10 % over capacity passed (its 6 s
    queue had no time to show in the p99) and the capacity read as a rate held."""
    args = parse_args(["--mode", "max-rps", "--base-url", "http://unused", "--request-rate",
                       "250", "--ramp-factor", "1.05", "--step-s", "4"])  # fmt: skip
    report, _ = await mode_max_rps(args, FakeTarget(capacity=300, queue_hidden=True))  # type: ignore[arg-type]
    held = [s["offered_rps"] for s in report["steps"] if s["held"]]
    assert held and max(held) <= 300 / 0.97
    assert report["max_sustained_rps"] <= 300
