"""bench/locustfile.py headless against a sim-engine stack on loopback: CSV out, every invalid
request answered 4xx, no failure (no 5xx, no hang), TTFT and ITL recorded as events."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bench.field_mix import INVALID_KINDS
from bench.up_stack import ROOT, UpStack


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_headless_run_writes_csv_refuses_every_invalid_request_with_4xx_and_never_fails(
    tmp_path: Path,
) -> None:
    locust = shutil.which("locust", path=str(Path(sys.executable).parent)) or shutil.which("locust")
    assert locust is not None, "locust comes with the dev extra"
    prefix = tmp_path / "report"
    with UpStack(engine="sim", replicas={"realtime": 0}) as stack:
        proc = subprocess.run(
            [locust, "-f", "bench/locustfile.py", "--headless", "--users", "6",
             "--spawn-rate", "6", "--host", stack.url, "--csv", str(prefix), "-t", "15s",
             "--only-summary", "--long-tokens", "300", "--max-tokens", "16",
             # More invalid requests than the field's 5 %, so every kind is sent in 15 s.
             "--mix", "invalid=40"],
            cwd=ROOT, env={k: v for k, v in os.environ.items() if not k.startswith("QOS_")},
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        gateway_log = stack.child_log("gateway", chars=2_000_000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for suffix in ("stats", "failures", "stats_history", "exceptions"):
        assert (tmp_path / f"report_{suffix}.csv").is_file(), suffix
    assert rows(tmp_path / "report_failures.csv") == [], "a request failed (5xx, 2xx, hang)"

    stats = [r for r in rows(tmp_path / "report_stats.csv") if r["Name"] != "Aggregated"]
    invalid = {
        r["Name"].removeprefix("invalid "): r for r in stats if r["Name"].startswith("invalid")
    }
    assert len(invalid) >= len(INVALID_KINDS) - 1, f"kinds sent: {sorted(invalid)}"
    assert all(r["Failure Count"] == "0" for r in invalid.values())
    assert sum(int(r["Request Count"]) for r in invalid.values()) >= 20

    by_type: dict[str, set[str]] = {}
    for r in stats:
        by_type.setdefault(r["Type"], set()).add(r["Name"])
    for kind in ("TTFT", "ITL"):
        assert {"short", "long_doc", "conversation turn 2"} <= by_type.get(kind, set()), kind
    # The gateway's access log agrees: no 5xx at all (the tail covers the end of the run).
    assert "status=4" in gateway_log and not re.search(r"status=5\d\d", gateway_log)
