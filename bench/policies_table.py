"""The side-by-side tables ``bench/policies.py`` prints: the fixed-rate phase per group, the
sweep's short-group E2E p99 per offered rate (SLO misses marked), and each policy's rate at
SLO and saturation throughput against ``dynamic`` and ``dynamic/pool``.
"""

from __future__ import annotations

from typing import Any


def _num(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict[str, Any], rel: dict[str, Any], pool: dict[str, Any] | None = None) -> str:
    """Plain-text tables: the fixed-rate phase, the sweep, and the rates side by side
    (``rel``: ratios against ``dynamic``; ``pool``: against ``dynamic/pool``)."""
    pool = pool or {}
    head = f"{'policy':<13}{'group':<7}{'req/s':>7}{'tok/s':>8}{'good/s':>8}"
    head += f"{'TTFT p50':>10}{'p99':>8}{'E2E p50':>9}{'p99':>8}{'busy':>6}"
    lines = ["fixed rate", head]
    for policy, r in results.items():
        fixed = r["fixed_rate"]
        for group, g in fixed["groups"].items():
            busy = fixed["engine"].get(group, {}).get("busy_fraction", "")
            lines.append(
                f"{policy:<13}{group:<7}{g['req_s']:>7.2f}{g['out_tok_s']:>8.1f}"
                f"{g['goodput_req_s'] or 0:>8.2f}{g['ttft_p50_ms']:>10.0f}{g['ttft_p99_ms']:>8.0f}"
                f"{g['e2e_p50_ms']:>9.0f}{g['e2e_p99_ms']:>8.0f}{busy!s:>6}"
            )
    rates = sorted({s["offered_sessions_s"] for r in results.values() for s in r["sweep"]})
    lines += ["", "sweep: short E2E p99 ms per offered sessions/s (* = SLO missed)"]
    lines.append(f"{'policy':<13}" + "".join(f"{x:>9.3g}" for x in rates))
    for policy, r in results.items():
        by_rate = {s["offered_sessions_s"]: s for s in r["sweep"]}
        cells = []
        for x in rates:
            s = by_rate.get(x)
            p99 = s["groups"].get("short", {}).get("e2e_p99_ms") if s else None
            mark = "" if s is None or s["slo_met"] else "*"
            cells.append(f"{_num(p99, '.0f') + mark:>9}")
        lines.append(f"{policy:<13}" + "".join(cells))
    lines += ["", f"{'policy':<13}{'at SLO /s':>10}{'req/s':>7}{'miss /s':>8}{'x dyn':>7}"
              f"{'[low, high]':>15}{'sat req/s':>10}{'x dyn':>7}{'good/s x dyn':>13}"
              f"{'x pool':>8}{'[low, high]':>15}"]  # fmt: skip
    for policy, r in results.items():
        slo, x, y = r["slo"], rel.get(policy, {}), pool.get(policy, {})
        bounds = f"[{_num(x.get('slo_rate_low'))}, {_num(x.get('slo_rate_high'))}]"
        pool_bounds = f"[{_num(y.get('slo_rate_low'))}, {_num(y.get('slo_rate_high'))}]"
        lines.append(
            f"{policy:<13}{_num(slo['rate_sessions_s'], '.3g'):>10}{_num(slo['req_s']):>7}"
            f"{_num(slo['first_miss_sessions_s'], '.3g'):>8}{_num(x.get('slo_rate')):>7}"
            f"{bounds:>15}{r['saturation_req_s']:>10.2f}{_num(x.get('saturation_req_s')):>7}"
            f"{_num(x.get('fixed_goodput_req_s')):>13}{_num(y.get('slo_rate')):>8}"
            f"{pool_bounds:>15}"
        )
    return "\n".join(lines)
