"""``bench/serve.py --launch sim --quick`` end to end: it starts its stack, drives it, reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import ROOT

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.mark.parametrize("client", ["httpx", "raw"])
def test_quick_sim_run_completes_every_request_and_reports_sane_figures(
    tmp_path: Path, client: str
) -> None:
    out = tmp_path / "serve.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serve", "--launch", "sim", "--quick", "--out", str(out),
         "--slo-ttft-ms", "10000", "--slo-e2e-ms", "60000", "--client", client],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert report["mode"] == "serve" and "--quick" in report["command"]
    machine = report["machine"]
    assert machine["cores"] >= 1 and len(machine["load_avg"]) == 3
    assert "separate process" in machine["load_generator"]

    result, config = report["result"], report["config"]
    assert config["client"] == client
    n = config["num_prompts"]
    assert n > 0 and result["num_prompts"] == n
    assert result["completed"] == n and result["failed"] == 0 and result["errors"] == {}
    assert result["total_output_tokens"] == n * config["output_len"]  # ignore_eos: all of it
    assert 0 < result["request_throughput"] <= 2 * config["request_rate"]
    tokens_per_request = result["output_throughput"] / result["request_throughput"]
    assert abs(tokens_per_request - config["output_len"]) < 0.01 * config["output_len"]
    for name in LATENCIES:
        figures = result[name]
        assert set(figures) == {"mean", "p50", "p90", "p99"}
        assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"], (name, figures)
    # A sim step is 5 ms: a token cannot come faster than that, nor a request before its TTFT.
    assert result["tpot_ms"]["p50"] >= config["sim_base_ms"] * 0.9
    assert result["ttft_ms"]["p50"] < result["e2e_ms"]["p50"]
    assert result["goodput"] == result["request_throughput"]  # generous SLOs: all good
    assert sum(row["requests"] for row in result["per_second"]) == n
