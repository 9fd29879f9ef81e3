"""bench/report.py on a results folder made here: sections, missing benchmarks, plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import build

ROOT = Path(__file__).resolve().parents[2]


def _step(offered: float, short_e2e_p99_ms: float) -> dict:
    row = {"req_s": 2.0, "out_tok_s": 50.0, "goodput_req_s": 1.0, "ttft_p50_ms": 100.0,
           "ttft_p99_ms": 300.0, "e2e_p50_ms": 400.0, "e2e_p99_ms": short_e2e_p99_ms,
           "completed": 20, "failed": 0}  # fmt: skip
    return {
        "offered_sessions_s": offered,
        "groups": {"short": row, "all": row},
        "engine": {"short": {"busy_fraction": 0.5}},
        "errors": {},
    }


def _policies() -> dict:
    def result(sweep: list[dict]) -> dict:
        return {
            "fixed_rate": _step(2, 900.0),
            "sweep": sweep,
            "saturation_req_s": 2.0,
            "saturation_out_tok_s": 50.0,
        }

    return {
        "benchmark": "policies",
        "command": "python -m bench.policies --quick",
        "machine": {"cores": 2},
        "workload": {
            "mix": "the mix",
            "rate_sessions_s": 2,
            "duration_s": 6,
            "sweep_factors": [1, 2],
            "step_s": 4,
            "slos_ms": {"short": [200, 500]},
        },
        "results": {
            # short's E2E p99 SLO is 500 ms: dynamic misses at once, continuous at 4/s.
            "dynamic": result([_step(2, 900.0), _step(4, 900.0)]),
            "continuous": result([_step(2, 300.0), _step(4, 900.0)]),
        },
        "ratios_vs_dynamic": {
            "dynamic": {"saturation_req_s": 1.0},
            "continuous": {"saturation_req_s": 1.0},
        },
    }


def test_report_has_every_benchmark_a_line_for_missing_ones_and_the_plots(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "policies.json").write_text(json.dumps(_policies()))
    (cpu / "mystery.json").write_text(json.dumps({"figure": 3.5, "nested": {"ratio": 0.25}}))
    (cpu / "locust_stats.csv").write_text(
        "Type,Name,Request Count,Failure Count,Median Response Time,95%,99%\n"
        "TTFT,short,10,0,20,40,50\n"
        ",Aggregated,99,0,11,140,360\n"
    )
    (cpu / "broken.json").write_text("{not json")
    report = build(tmp_path).read_text()

    assert report.startswith("# qosserve benchmark report")
    assert "## cpu results" in report
    assert "Command: `python -m bench.policies --quick`" in report
    assert "| continuous | all | 2 |" in report
    # Rate at SLO: continuous 2/s (first miss 4/s), dynamic none; no ratio, at least 2/2.
    # No dynamic/pool in this run: its columns are empty.
    assert "| continuous | 2 | 2 | 4 | — | 1–∞ | — | — | 2 | 1 |" in report
    assert "| dynamic | — | — | 2 | — | 0–∞ | — | — | 2 | 1 |" in report
    assert "Field-study comparison" not in report
    assert "![policies](cpu/policies.png)" in report and (cpu / "policies.png").stat().st_size > 0
    for missing in (
        "engine",
        "kernels",
        "serve",
        "kvtier",
        "incident",
        "golden",
        "tracing_overhead",
    ):
        assert f"### {missing}\n\nNo result in `cpu/`" in report, missing
    assert "| TTFT | short | 10 | 0 |" in report
    assert "Aggregated" not in report  # requests, timing events and 4xx pooled: meaningless
    assert "`figure` = 3.5" in report and "`nested.ratio` = 0.25" in report
    assert "CPUs" in report  # the machine that built it


def test_an_empty_results_folder_says_so(tmp_path: Path) -> None:
    assert "No results in" in build(tmp_path).read_text()


def test_the_replicas_section_is_a_table_with_the_busiest_processes(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    row = {"replicas": 2, "max_sustained_rps": 250.0, "vs_one_replica": 1.95,
           "scaling_efficiency": 0.975, "device_bound_rps": 289.0, "share_of_device_bound": 0.865,
           "cpu_util_at_top_step": {"worker-0": 0.2, "gateway": 0.4, "nats-server": 0.1,
                                    "load-generator": 0.05}}  # fmt: skip
    doc = {"benchmark": "replicas", "command": "python -m bench.replicas",
           "result": {"per_count": [row], "device_bound_rps_per_replica": 144.5}}  # fmt: skip
    (cpu / "replicas.json").write_text(json.dumps(doc))
    report = build(tmp_path).read_text()
    assert "Device bound per replica (cost model): 144.5 req/s." in report
    busiest = "gateway 0.40, worker-0 0.20, nats-server 0.10"  # the top three, busiest first
    assert f"| 2 | 250 | - | 1.95 | 0.975 | 0.865 | {busiest} |" in report  # no steps kept


def test_a_note_written_into_a_result_is_shown_once_under_its_command(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    note = "Latency here carries an artifact fixed later; req/s does not."
    doc = {"benchmark": "tracing_overhead", "note": note, "command": "python -m x",
           "result": {"req_per_s": 650.0}}  # fmt: skip
    (cpu / "tracing_overhead-x.json").write_text(json.dumps(doc))
    text = build(cpu).read_text()
    assert text.count(note) == 1
    section = text[text.index("tracing_overhead-x.json") :]
    assert section.index("Command: `python -m x`") < section.index(f"Note: {note}")
    assert "`result.req_per_s` = 650.0" in section


def test_an_engine_result_records_its_command_and_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's JSON kept no command: the report printed the default one beside every
    engine result, GPU --fixed-batch runs included, and no result said which code ran."""
    from bench import engine

    monkeypatch.setattr(engine, "run_policies", lambda ns: {"policies": {}})
    out = tmp_path / "engine.json"
    engine.main(["--num-seqs", "4", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "engine"
    assert doc["command"] == f"python -m bench.engine --num-seqs 4 --out {out}"
    assert len(doc["git"]["commit"]) == 40 and isinstance(doc["git"]["dirty"], bool)


def test_the_report_builds_as_a_command_over_the_field_study_comparison(tmp_path: Path) -> None:
    """`python -m bench.report`, as the README runs it: helpers defined below its
    ``__main__`` block were missing then (a NameError on any policies result with the
    field-study comparison), while tests importing the module never saw it."""
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    stored = ROOT / "bench" / "results" / "cpu" / "policies_field-bymix-lag.json"
    (cpu / "policies_field.json").write_text(stored.read_text())
    done = subprocess.run(
        [sys.executable, "-m", "bench.report", "--results", str(cpu)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Field-study comparison:" in (cpu / "REPORT.md").read_text()
