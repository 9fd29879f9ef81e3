"""PNG plots for ``bench/serve.py --plot DIR``: latency CDFs, throughput over time, the ramp.

matplotlib is optional: without it :func:`draw` draws nothing and says so in the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class Timed(Protocol):
    """What a plotted request needs (``bench.serve.Result``)."""

    ok: bool
    ttft: float | None
    e2e: float


def draw(
    folder: Path, mode: str, series: Mapping[str, Sequence[Timed]], result: dict[str, Any]
) -> list[str] | str:
    """Write the mode's plots into ``folder``; their paths, or why there are none."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plots"
    folder.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, results in series.items():
        for label, values in (
            (f"{name} E2E", [r.e2e for r in results if r.ok]),
            (f"{name} TTFT", [r.ttft for r in results if r.ok and r.ttft]),
        ):
            if values and (label.endswith("E2E") or mode == "serve"):
                ms = sorted(v * 1e3 for v in values)
                ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=label)
    ax.set(
        xscale="log",
        xlabel="latency (ms)",
        ylabel="fraction of requests",
        title=f"bench.serve --mode {mode}: latency CDF",
    )
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labels would overlap
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    written.append(_save(fig, folder / f"serve_{mode}_latency_cdf.png"))

    timeline = result.get("per_second")
    if timeline:
        fig, ax = plt.subplots(figsize=(7, 4))
        t = [row["t"] for row in timeline]
        ax.plot(t, [row["requests"] for row in timeline], label="requests/s")
        ax2 = ax.twinx()
        ax2.plot(t, [row["tokens"] for row in timeline], color="tab:orange", label="tokens/s")
        ax.set(xlabel="time (s)", ylabel="completed requests/s", title="throughput over time")
        ax2.set_ylabel("output tokens/s")
        fig.legend(loc="upper right")
        written.append(_save(fig, folder / f"serve_{mode}_throughput.png"))

    steps = result.get("steps")
    if steps:
        fig, ax = plt.subplots(figsize=(7, 4))
        offered = [s["offered_rps"] for s in steps]
        ax.plot(offered, [s["achieved_rps"] for s in steps], "o-", label="achieved req/s")
        ax.plot(offered, offered, "--", color="grey", label="offered")
        ax2 = ax.twinx()
        ax2.plot(offered, [s["p99_ms"] for s in steps], "s-", color="tab:red", label="p99 E2E")
        ax2.axhline(result["max_p99_ms"], color="tab:red", linestyle=":")
        ax.set(xlabel="offered req/s", ylabel="achieved req/s", title="max-rps ramp")
        ax2.set_ylabel("p99 E2E (ms)")
        fig.legend(loc="lower right", bbox_to_anchor=(0.88, 0.15))
        written.append(_save(fig, folder / "serve_max_rps_ramp.png"))
    return written


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
