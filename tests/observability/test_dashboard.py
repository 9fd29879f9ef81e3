"""deploy/observability: the dashboard asks only for series the services export; configs load."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from common import metrics as m
from common.config import Config
from tests.observability.conftest import StartWorker, run_requests

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
METRIC = re.compile(r"\bqos_[a-z0-9_]+\b")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
SCRAPE_LABELS = {"instance", "job", "service", "le"}  # added by Prometheus or histograms
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL string in the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and "query" in value:
                yield value["query"]
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


async def test_every_promql_expression_names_only_series_the_services_export(
    config: Config, start_worker: StartWorker
) -> None:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    run = await run_requests(config, start_worker, {"short": 2, "long": 1}, max_tokens=3)
    specs = {spec.name: spec for spec in vars(m).values() if isinstance(spec, m.Spec)}
    labels: dict[str, set[str]] = {}  # sample name -> label names
    for text in run.texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
            # A family with no sample yet (no error happened) is still exported, empty.
            spec_labels = set(specs[family.name].labels) if family.name in specs else set()
            for suffix in SUFFIXES.get(family.type, ("",)):
                labels.setdefault(family.name + suffix, set()).update(spec_labels)
    # GPU series exist only where NVML does, tracing's own only with tracing on: their
    # names and labels come from the specs (a counter's samples end in _total).
    only_sometimes = [(spec, "") for spec in m.GPU_SPECS] + [
        (m.TRACE_SPANS, "_total"), (m.TRACE_EXPORT_CPU, "_total"), (m.TRACE_QUEUE, "")
    ]  # fmt: skip
    for spec, suffix in only_sometimes:
        labels.setdefault(spec.name + suffix, set()).update(spec.labels)

    exprs = list(expressions(dashboard))
    assert len(exprs) >= 25
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        names = METRIC.findall(expr)
        assert names, f"no qos_* series in {expr!r}"
        unknown = [n for n in names if n not in labels]
        assert not unknown, f"{unknown} in {expr!r} are not exported"
        known = set().union(*(labels[n] for n in names)) | SCRAPE_LABELS
        for clause in BY.findall(expr):
            missing = {label.strip() for label in clause.split(",")} - known
            assert not missing, f"by ({clause}) in {expr!r}: {missing} not on {names}"


def test_the_dashboard_covers_design_section_7() -> None:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    titles = " | ".join(p["title"] for p in dashboard["panels"])
    for topic in ("TTFT", "Inter-token", "E2E", "Requests/s", "Queue depth", "Running batch",
                  "KV cache usage", "hit rate per tier", "Breaker state", "Replicas per group",
                  "GPU utilisation"):  # fmt: skip
        assert topic in titles, topic
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["group"]["includeAll"]


def test_prometheus_collector_and_grafana_provisioning_configs_load() -> None:
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert set(jobs) == {"qosserve-gateway", "qosserve-scheduler", "qosserve-workers"}
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())
    assert jobs["qosserve-workers"]["file_sd_configs"]
    # A target label named like one the services export is renamed exported_<name> on the
    # series (honor_labels off): qos_build_info's own "service" read as exported_service.
    exported = {label for spec in vars(m).values() if isinstance(spec, m.Spec)
                for label in spec.labels}  # fmt: skip
    for job in jobs.values():
        for target in job.get("static_configs", []):
            assert not set(target.get("labels", {})) & exported, job["job_name"]

    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert set(collector["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and "debug" in pipeline["exporters"]
    assert set(pipeline["exporters"]) <= set(collector["exporters"])
    assert set(pipeline["processors"]) <= set(collector["processors"])

    provisioning = DEPLOY / "grafana-provisioning"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"
    provider = yaml.safe_load((provisioning / "dashboards" / "qosserve.yaml").read_text())
    assert provider["providers"][0]["type"] == "file"


def _dashboard_expressions() -> list[str]:
    return list(expressions(json.loads((DEPLOY / "grafana-dashboard.json").read_text())))


def test_the_5xx_panel_leaves_out_the_workers_caller_errors() -> None:
    """qos_request_errors_total counts every error a worker answered, a client's over-long
    prompt (400) too: plotted unfiltered under a "5xx" title, it disagreed with the
    breakers, which rightly ignore caller errors."""
    from common.errors import _BY_CODE

    worker_errors = [e for e in _dashboard_expressions() if "qos_request_errors_total" in e]
    assert worker_errors
    caller = sorted(code for code, cls in _BY_CODE.items() if cls.http_status < 500)
    for expr in worker_errors:
        excluded = re.search(r'code!~"([^"]+)"', expr)
        assert excluded is not None, expr
        assert all(re.fullmatch(excluded.group(1), code) for code in caller), expr
        assert not re.fullmatch(excluded.group(1), "internal_error")


def test_per_replica_busy_time_is_averaged_over_the_groups_current_replicas() -> None:
    """A replica moved away keeps exporting its old group's busy counter (frozen): avg by
    (group) over the rate counted it as an idle member, and the group looked less busy."""
    busy = [e for e in _dashboard_expressions() if "qos_engine_busy_seconds_total" in e]
    assert busy
    for expr in busy:
        assert not re.search(r"\b(avg|min|max)\s+by\s*\([^)]*\)\s*\(\s*rate\(qos_engine_busy", expr)
