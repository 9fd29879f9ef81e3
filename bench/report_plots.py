"""The PNGs ``bench/report.py`` draws (matplotlib, headless); False when it cannot draw."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def policies(doc: dict[str, Any], png: Path) -> bool:
    """Left: saturation req/s per policy; right: short's E2E p99 over the sweep vs its SLO."""
    plt = _pyplot()
    if plt is None:
        return False
    results = doc["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    left.bar(names, [results[p]["saturation_req_s"] for p in names], color="#4c72b0")
    left.set_ylabel("saturation req/s (all groups)")
    left.set_title("most req/s sustained in the sweep")
    for p in names:
        steps = [s for s in results[p]["sweep"] if "short" in s["groups"]]
        xs = [s["offered_sessions_s"] for s in steps]
        ys = [s["groups"]["short"]["e2e_p99_ms"] for s in steps]
        right.plot(xs, ys, marker="o", label=p)
    slo = doc["workload"].get("slos_ms", {}).get("short")
    if slo:
        right.axhline(slo[1], ls="--", lw=0.8, color="grey", label="short E2E p99 SLO")
    right.set_xlabel("offered sessions/s")
    right.set_ylabel("short E2E p99 (ms)")
    right.set_xscale("log")
    rates = sorted({s["offered_sessions_s"] for p in names for s in results[p]["sweep"]})
    right.set_xticks(rates, [f"{x:.3g}" for x in rates], fontsize=8)
    right.minorticks_off()
    right.set_yscale("log")
    right.set_title("the sweep: where each policy crosses the SLO")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


def golden(doc: dict[str, Any], png: Path) -> bool:
    """EM and ROUGE-L per policy (KV auto) against the field study's bar."""
    plt = _pyplot()
    if plt is None:
        return False
    rows = [(p, r["auto"]) for p, r in doc["results"].items() if "exact_match" in r.get("auto", {})]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["exact_match"] for _, r in rows], 0.4, label="EM")
    ax.bar([x + 0.2 for x in xs], [r["rouge_l"] for _, r in rows], 0.4, label="ROUGE-L")
    ax.axhline(doc["bar"]["exact_match"], ls="--", lw=0.8, color="C0")
    ax.axhline(doc["bar"]["rouge_l"], ls="--", lw=0.8, color="C1")
    ax.set_xticks(list(xs), [p for p, _ in rows])
    ax.set_ylim(0, 1.05)
    ax.set_title("golden set through the served stack vs transformers greedy")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True
