"""Run ``bench/locustfile.py`` headless against a stack this starts on loopback; JSON summary.

``qosserve up`` (real engine with the demo model by default, or ``--engine sim``) on a free
port, then locust for ``-t`` with ``--users``/``--spawn-rate``, CSV files under
``--out-dir`` (``locust_stats.csv`` …), and ``locust.json`` beside them: the command lines,
the machine, and per request kind the counts, failures and TTFT/ITL/E2E percentiles — what
``bench/report.py`` shows. Against a deployment, run locust itself (see the locust file).

    python -m bench.locust_run --users 20 --spawn-rate 5 -t 60s --out-dir bench/results/cpu
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.field_mix import MIX
from bench.serve_stack import machine_info
from bench.up_stack import ROOT, UpStack


def _ms(cell: str | None) -> float | None:
    """A percentile cell: locust writes "N/A" for a row with no requests (None here)."""
    try:
        return float(cell) if cell else None
    except ValueError:
        return None


def summary(rows: list[dict[str, str]]) -> dict[str, Any]:
    """Counts and percentiles per (type, name), and the invalid requests' verdict."""
    by: dict[str, Any] = {}
    for r in rows:
        if r["Name"] == "Aggregated":
            continue
        by[f"{r['Type']} {r['Name']}"] = {
            "requests": int(r["Request Count"]),
            "failures": int(r["Failure Count"]),
            "p50_ms": _ms(r["50%"]),
            "p95_ms": _ms(r["95%"]),
            "p99_ms": _ms(r["99%"]),
            "req_s": float(r["Requests/s"] or 0),
        }
    invalid = {k: v for k, v in by.items() if " invalid " in f" {k} "}
    # A 429 the load retried after its Retry-After (the locust file's own row): shed load,
    # not an answer, so it counts in neither the rate nor the mix.
    shed = {k: v for k, v in by.items() if k.endswith("(429, retried)")}
    posts = {k: v for k, v in by.items() if k.startswith("POST ") and k not in shed}
    total = sum(v["requests"] for v in posts.values())
    # What the field mix is about: each kind's share of the requests sent.
    kinds: dict[str, int] = {}
    for key, v in posts.items():
        kind = key.split()[1]  # "POST conversation turn 2" -> conversation
        kinds[kind] = kinds.get(kind, 0) + v["requests"]
    return {
        "requests": total,
        "failures": sum(v["failures"] for v in posts.values()),
        "req_s": round(sum(v["req_s"] for v in posts.values()), 2),
        # Answered: neither the invalid kind (refused on purpose) nor failures (their rows).
        "valid_req_s": round(
            sum(
                v["req_s"]
                for k, v in posts.items()
                if k not in invalid and not k.endswith("(failed)")
            ),
            2,
        ),
        "invalid_requests": sum(v["requests"] for v in invalid.values()),
        "retried_after_429": sum(v["requests"] for v in shed.values()),
        # None sent proves nothing: "all of none" read True.
        "invalid_answered_4xx": bool(invalid) and all(v["failures"] == 0 for v in invalid.values()),
        "request_share_pct": {k: round(100 * n / total, 1) for k, n in kinds.items()}
        if total
        else {},
        "by_request": by,
    }


# A run whose completed requests are off the mix by more is flagged in its summary.
MIX_TOLERANCE_PTS = 2.0


def target_share_pct() -> dict[str, float]:
    """Each kind's share of the requests sent, as the field mix has it."""
    total = sum(MIX.values())
    return {kind: round(100 * w / total, 1) for kind, w in MIX.items()}


def mix_off_pts(shares: dict[str, float]) -> float:
    """The largest gap, in points, between a kind's share of the requests completed and
    the mix's: requests still running at the stop (long documents, mostly) are not in it,
    so a run can be off the mix though it sent it exactly."""
    target = target_share_pct()
    return round(max(abs(shares.get(k, 0.0) - t) for k, t in target.items()), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.locust_run", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("real", "sim"), default="real")
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--spawn-rate", type=float, default=5)
    p.add_argument("-t", "--run-time", default="60s")
    p.add_argument("--long-tokens", type=int, default=1500, help="the demo model has 2k context")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out-dir", default="bench/results/cpu")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    locust = shutil.which("locust", path=str(Path(sys.executable).parent)) or "locust"
    machine = machine_info()
    with UpStack(engine=args.engine, replicas={"realtime": 1}) as stack:
        argv_l = [locust, "-f", "bench/locustfile.py", "--headless", "--users", str(args.users),
                  "--spawn-rate", str(args.spawn_rate), "--host", stack.url,
                  "--csv", str(out / "locust"), "-t", args.run_time, "--only-summary",
                  "--reset-stats",  # the figures start once every user is spawned
                  "--long-tokens", str(args.long_tokens), "--max-tokens", str(args.max_tokens)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        proc = subprocess.run(argv_l, cwd=ROOT, env=env, capture_output=True, text=True)
    with (out / "locust_stats.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    with (out / "locust_failures.csv").open(newline="") as f:
        failures = [
            f"{r['Occurrences']}x {r['Name']}: {r['Error'][:160]}" for r in csv.DictReader(f)
        ]
    shown = " ".join(["locust", *argv_l[1:]]).replace(stack.url, "http://127.0.0.1:<port>")
    report: dict[str, Any] = {
        "benchmark": "locust",
        "command": " ".join(["python -m bench.locust_run", *(argv or sys.argv[1:])]),
        "locust_command": shown,
        "stack": f"qosserve up --engine {args.engine} (demo model on CPU), one worker per group",
        "machine": {**machine, "load_avg_after": machine_info()["load_avg"]},
        "locust_exit_code": proc.returncode,
        "stats_csv": str(out / "locust_stats.csv"),
        "result": {**summary(rows), "failure_messages": failures},
    }
    result = report["result"]
    off = mix_off_pts(result["request_share_pct"])
    result["mix_off_pts"] = off
    report["summary"] = (
        f"{result['requests']} requests in {args.run_time}: {result['valid_req_s']} valid "
        f"req/s ({result['req_s']} with the invalid ones, answered 4xx), "
        f"shares {result['request_share_pct']} (target {target_share_pct()}"
        + (f"; OFF THE MIX BY {off} POINTS" if off > MIX_TOLERANCE_PTS else "")
        + "), "
        f"{result['retried_after_429']} retried after a 429, "
        f"{result['failures']} failures; {result['invalid_requests']} invalid requests, all 4xx: "
        f"{result['invalid_answered_4xx']}. Locust: `{shown}`."
        + (f" Failures: {'; '.join(failures)}" if failures else "")
    )
    (out / "locust.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
