"""``/metrics`` of every service, parsed as Prometheus parses it, after a known load."""

from __future__ import annotations

import sys
import types
import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common import metrics as m
from common.config import Config, WorkerConfig
from common.gpu_metrics import nvml_collector
from common.models import served_name
from tests.observability.conftest import (
    MODEL,
    Samples,
    StartWorker,
    parse_metrics,
    run_requests,
    value,
)
from workers.service import WorkerOptions, WorkerService
from workers.sim import SimEngine

PLAN = {"short": 3, "long": 2}
MAX_TOKENS = 5


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def test_after_n_requests_counters_moved_by_n_and_histograms_hold_n_per_group(
    config: Config, start_worker: StartWorker
) -> None:
    run = await run_requests(config, start_worker, PLAN, MAX_TOKENS)
    gw_before, gw_after = run.gateway
    for group, n in PLAN.items():
        g = {"group": group}
        assert delta(gw_before, gw_after, "qos_gateway_requests_total", status="200", **g) == n
        for hist in ("qos_gateway_time_to_first_token_seconds", m.GW_E2E.name):
            assert delta(gw_before, gw_after, f"{hist}_count", model=MODEL, **g) == n, hist
        tokens = delta(gw_before, gw_after, "qos_gateway_generation_tokens_total", **g)
        assert tokens == n * MAX_TOKENS
        assert value(gw_after, "qos_gateway_requests_in_flight", required=True, **g) == 0

        before, after = run.workers[group]
        labels = {"group": group, "model": MODEL}
        success = delta(
            before, after, "qos_request_success_total", finished_reason="length", **labels
        )
        assert success == n
        for spec in (m.TTFT, m.E2E, m.QUEUE_TIME):
            assert delta(before, after, f"{spec.name}_count", **labels) == n, spec.name
            inf = value(after, f"{spec.name}_bucket", le="+Inf", **labels)
            assert inf == value(after, f"{spec.name}_count", **labels)
        assert delta(before, after, f"{m.ITL.name}_count", **labels) == n * (MAX_TOKENS - 1)
        generated = delta(before, after, "qos_generation_tokens_total", **labels)
        assert generated == n * MAX_TOKENS
        # "req i": BOS + five bytes (i < 10)
        assert delta(before, after, "qos_prompt_tokens_total", **labels) == n * 6
        other = next(o for o in PLAN if o != group)
        assert value(after, f"{m.E2E.name}_count", group=other) == 0  # only its own group

        # The engine's state, read at scrape time.
        for spec in (m.RUNNING, m.WAITING, m.KV_USAGE, m.BATCH_CAP):
            assert (spec.name, frozenset(labels.items())) in after, spec.name
        assert value(after, "qos_batch_cap", **labels) == config.groups[group].max_batch
        device = {**labels, "tier": "device"}
        assert (f"{m.PREFIX_QUERIES.name}_total", frozenset(device.items())) in after
        assert (f"{m.PREFIX_HITS.name}_total", frozenset(device.items())) in after
        assert (f"{m.PREEMPTIONS.name}_total", frozenset(labels.items())) in after
        assert value(after, "qos_build_info", service="worker") == 1

    assert value(gw_after, "qos_build_info", service="gateway") == 1
    assert value(run.scheduler, "qos_build_info", service="scheduler") == 1
    for group in PLAN:
        assert value(run.scheduler, "qos_breaker_state", required=True, group=group) == 0  # closed
        assert ("qos_desired_replicas", frozenset({("group", group)})) in run.scheduler


async def test_workers_on_one_host_get_their_own_port_and_publish_it_in_the_heartbeat(
    config: Config, start_worker: StartWorker
) -> None:
    run = await run_requests(config, start_worker, {"short": 1, "long": 1}, MAX_TOKENS)
    ports = run.ports
    assert len(set(ports.values())) == 2 and 0 not in ports.values()
    for worker_id, port in ports.items():
        assert run.heartbeats[worker_id]["metrics_port"] == port
        assert run.heartbeats[worker_id]["host"]
        # The liveness probe's path, on the same port: the worker's loop beats.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as response:
            assert (response.status, response.read()) == (200, b"ok\n")
    # ... which is what Prometheus's file-SD gets (python -m workers.scrape_targets).
    found = {t["labels"]["worker"]: (t["targets"], t["labels"]["group"]) for t in run.targets}
    assert found == {
        worker_id: ([f"{run.heartbeats[worker_id]['host']}:{port}"], worker_id.removeprefix("w-"))
        for worker_id, port in ports.items()
    }


def test_without_nvml_gpu_series_are_absent_not_zero(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML absent, whatever this machine has
    assert nvml_collector() is None
    from workers.metrics import WorkerMetrics

    text = generate_latest(WorkerMetrics(MODEL, lambda: None).registry).decode()
    assert "qos_gpu_" not in text


def test_nvml_collector_exports_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for NVML's Python binding (not for anything this project talks to).
    devices = [("GPU-aaa", 37, 10, 80), ("GPU-bbb", 90, 70, 80)]

    def handle(i: int) -> int:
        return i

    fake: Any = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetCount = lambda: len(devices)
    fake.nvmlDeviceGetHandleByIndex = handle
    fake.nvmlDeviceGetUUID = lambda h: devices[h][0]
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=devices[h][1])
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=devices[h][2] << 30, total=devices[h][3] << 30
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)

    everything = nvml_collector(env={}, owner=lambda: ("long", MODEL))
    only_b = nvml_collector(env={"CUDA_VISIBLE_DEVICES": "GPU-bbb"})
    assert everything is not None and only_b is not None
    registry = CollectorRegistry()
    registry.register(everything)
    samples = parse_metrics(generate_latest(registry).decode())
    assert value(samples, "qos_gpu_utilization_ratio", gpu="0") == pytest.approx(0.37)
    assert value(samples, "qos_gpu_utilization_ratio", gpu="1") == pytest.approx(0.90)
    assert value(samples, "qos_gpu_memory_used_bytes", gpu="1") == 70 << 30
    assert value(samples, "qos_gpu_memory_total_bytes", gpu="0") == 80 << 30
    # Labelled with what the worker serves, so a dashboard filtered by group shows its GPUs.
    assert value(samples, "qos_gpu_utilization_ratio", required=True, gpu="1", group="long",
                 model=MODEL) == pytest.approx(0.90)  # fmt: skip
    assert [label for label, _ in only_b._devices] == ["1"]
    assert nvml_collector(env={"CUDA_VISIBLE_DEVICES": "1"}) is not None


def test_inter_token_latency_is_the_engines_pace_not_the_loops() -> None:
    """Timed when the loop handled each output: a loop 60 ms behind a 20 ms engine handled
    three steps' outputs microseconds apart, one 60 ms gap and two of none (p50 near 0,
    p99 high, just under load). Each output now says when the engine had it."""
    from common.protocol import GenerateRequest, RequestParams
    from workers.engine.outputs import RequestDelta, RequestMetrics
    from workers.observe import WorkerObserver
    from workers.outbox import Flight

    registry = CollectorRegistry()
    observer = WorkerObserver(worker_id="w0", model=MODEL, view=lambda: None, tracer=None,
                              registry=registry, gpus=False)  # fmt: skip
    msg = types.SimpleNamespace(subject="qos.req.short", headers=None)
    req = GenerateRequest(id="cmpl-itl", group="short", reply="r", prompt_token_ids=[1, 2],
                          params=RequestParams(max_tokens=4))  # fmt: skip
    st = Flight(req, msg, 1, 1000.0)
    observer.fetched(st, msg, "short")
    metrics = RequestMetrics(1000.0, 1000.001, 1000.002, 1000.02, 0, 0)
    for i in range(4):  # handled together, made 20 ms apart
        observer.output(
            st,
            RequestDelta(
                "cmpl-itl@1",
                [7],
                "x",
                at=1000.02 + 0.02 * i,
                first_token_metrics=metrics if i == 0 else None,
            ),
        )
    samples = parse_metrics(generate_latest(registry).decode())
    name = "qos_inter_token_latency_seconds"
    count = value(samples, f"{name}_count", required=True, group="short", model=MODEL)
    total = value(samples, f"{name}_sum", required=True, group="short", model=MODEL)
    assert count == 3 and total == pytest.approx(0.06)


def test_engine_counters_credit_each_group_with_what_it_did() -> None:
    """Engine totals since start were labelled with the group served now: a replica moved
    A -> B -> A brought B's preemptions back under A, which a rate() over the gap counted."""
    from workers.engine.outputs import EngineStats
    from workers.metrics import EngineCollector, EngineView

    def view(group: str, preemptions: int) -> EngineView:
        stats = EngineStats(0, 0, 16, 16, 0.0, 0.0, 0, 0, preemptions, 0, 0, 0, 0)
        return EngineView(group, stats, 4, float(preemptions))

    current = [view("short", 10)]
    registry = CollectorRegistry()
    registry.register(EngineCollector(MODEL, lambda: current[0]))

    def preempted(group: str) -> float:
        samples = parse_metrics(generate_latest(registry).decode())
        return value(samples, "qos_num_preemptions_total", required=True, group=group, model=MODEL)

    assert preempted("short") == 10
    current[0] = view("long", 15)  # moved: 5 more while it served long
    assert (preempted("short"), preempted("long")) == (10, 5)
    current[0] = view("short", 20)  # and back
    assert (preempted("short"), preempted("long")) == (15, 5)


@pytest.mark.parametrize(("spec", "served"), [("demo", "pystd-tiny"), ("dummy:tiny", "dummy:tiny")])
def test_a_worker_labels_its_series_with_the_name_the_gateway_serves(
    spec: str, served: str
) -> None:
    """A worker of ``--model demo`` labelled its series model="demo" while the gateway's
    said "pystd-tiny": a dashboard joining the two on ``model`` matched nothing."""
    config = Config(worker=WorkerConfig(model=spec))
    engine = SimEngine(max_batch_size=2, max_seq_len=64)
    service = WorkerService(config, engine, WorkerOptions(group="short", worker_id="w-label"))
    assert service.observer.metrics.model == served == served_name(spec)
