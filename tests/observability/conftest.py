"""Observability fixtures: the gateway app under uvicorn, in-process sim workers, spans in
memory, and ``/metrics`` scraped over HTTP and parsed as Prometheus does."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from common.config import Config, NatsConfig, WorkerConfig
from common.tracing import init_tracing
from tests.gateway.conftest import gateway_config
from workers.service import WorkerOptions, WorkerService
from workers.sim import SimCost, SimEngine

FAST = SimCost(base_s=0.0, prefill_s_per_token=0.0, decode_s_per_seq=0.0)
SLOW = SimCost(base_s=0.03, prefill_s_per_token=0.0, decode_s_per_seq=0.0)
MODEL = "dummy:tiny"


@pytest.fixture
def config(nats_config: NatsConfig) -> Config:
    """The gateway tests' groups (realtime/short/long), fast worker telemetry, short ack_wait."""
    base = gateway_config(nats_config)
    return base.model_copy(
        update={
            "nats": base.nats.model_copy(update={"ack_wait_s": 2.0}),
            "worker": WorkerConfig(telemetry_interval_s=0.2, coalesce_ms=2.0),
        }
    )


@dataclass
class Traced:
    """A tracer provider that keeps finished spans in memory (exported as each one ends)."""

    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    async def wait_for(
        self, predicate: Callable[[list[ReadableSpan]], bool], timeout_s: float = 5.0
    ) -> list[ReadableSpan]:
        """The finished spans once ``predicate`` holds (a worker ends its span after the
        ack, which can be after the client has its last byte)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate(spans := self.spans()):
            if loop.time() > deadline:
                names = [(s.name, s.attributes.get("qos.attempt")) for s in spans]
                raise AssertionError(f"spans never matched; finished: {names}")
            await asyncio.sleep(0.02)
        return spans


@pytest.fixture
def traced() -> Iterator[Traced]:
    """Spans in memory through :func:`common.tracing.init_tracing` (not the global provider)."""
    exporter = InMemorySpanExporter()
    provider = init_tracing("qosserve-test", exporter=exporter, batch=False, set_global=False)
    assert provider is not None
    yield Traced(provider, exporter)
    provider.shutdown()


StartWorker = Callable[..., Awaitable[WorkerService]]


@pytest.fixture
async def start_worker(config: Config) -> AsyncIterator[StartWorker]:
    """``await start_worker(worker_id, group="short", cost=FAST, tracer_provider=None)``."""
    started: list[WorkerService] = []

    async def start(
        worker_id: str,
        group: str = "short",
        cost: SimCost = FAST,
        tracer_provider: TracerProvider | None = None,
    ) -> WorkerService:
        gc = config.groups[group]
        engine = SimEngine(
            max_batch_size=gc.max_batch, max_seq_len=gc.max_seq_len, cost=cost, vocab_size=259
        )
        options = WorkerOptions(group=group, worker_id=worker_id, model=MODEL, fetch_timeout_s=0.25)
        service = WorkerService(config, engine, options, tracer_provider=tracer_provider)
        await service.start()
        started.append(service)
        return service

    yield start
    await asyncio.gather(*(s.stop(grace_s=0) for s in started))


async def wait_live(http: httpx.AsyncClient, *groups: str, timeout_s: float = 10.0) -> None:
    """Until the gateway's view has a live worker in each of ``groups``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        health = (await http.get("/health")).json()["groups"]
        if all(health[g]["live_workers"] >= 1 for g in groups):
            return
        if loop.time() > deadline:
            raise AssertionError(f"no live worker in {groups}: {health}")
        await asyncio.sleep(0.05)


async def stream_completion(http: httpx.AsyncClient, path: str, **body: Any) -> list[str]:
    """POST a streamed completion; the SSE ``data:`` payloads, ``[DONE]`` included."""
    events: list[str] = []
    async with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Exposition text → {(sample name, labels): value}, through Prometheus's own parser."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def scrape_port(port: int) -> str:
    """``GET /metrics`` of a worker or scheduler (their servers run in a thread)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def value(samples: Samples, name: str, required: bool = False, **labels: str) -> float:
    """The one sample named ``name`` whose labels include ``labels`` (0 when absent, unless
    ``required``: a gauge read as 0 must exist, or a renamed series would pass)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    assert found or not required, f"{name} {labels}: no such sample"
    return found[0] if found else 0.0


@dataclass
class Scrapes:
    """``/metrics`` of each service before and after a run of requests."""

    gateway: tuple[Samples, Samples]
    workers: dict[str, tuple[Samples, Samples]]  # by group
    scheduler: Samples
    texts: list[str]  # every exposition text scraped after the run
    heartbeats: dict[str, dict[str, Any]]  # worker id -> heartbeat JSON
    ports: dict[str, int]  # worker id -> metrics port
    targets: list[dict[str, Any]]  # file-SD entries from the heartbeats


async def run_requests(
    config: Config, start_worker: StartWorker, plan: dict[str, int], max_tokens: int
) -> Scrapes:
    """One worker per group of ``plan`` and a scheduler; ``plan[group]`` requests through the
    gateway (streamed and not, alternately); every service scraped before and after."""
    import json

    from common.nats import connect, ensure_kv
    from common.services import free_port
    from scheduler.service import SchedulerService
    from tests.gateway.conftest import serve
    from workers.scrape_targets import scrape_targets

    sched_cfg = config.model_copy(
        update={
            "scheduler": config.scheduler.model_copy(
                update={"metrics_port": free_port(), "tick_interval_s": 0.2,
                         "rebalance_interval_s": 0.3}
            )
        }
    )  # fmt: skip
    workers = {group: await start_worker(f"w-{group}", group) for group in plan}
    scheduler = SchedulerService(sched_cfg, scheduler_id="sched-obs")
    await scheduler.start()
    try:
        async with (
            serve(config) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            await wait_live(http, *plan)
            gw_before = parse_metrics((await http.get("/metrics")).text)
            w_before = {
                g: parse_metrics(await asyncio.to_thread(scrape_port, w.observer.metrics_port))
                for g, w in workers.items()
            }
            for group, n in plan.items():
                for i in range(n):
                    body = {"model": MODEL, "prompt": f"req {i}", "max_tokens": max_tokens}
                    if i % 2:
                        assert await stream_completion(http, f"/v1/{group}/completions", **body)
                    else:
                        response = await http.post(f"/v1/{group}/completions", json=body)
                        assert response.status_code == 200, response.text
            gw_after, w_after = await _settled(http, workers, plan)
            gw_text = (await http.get("/metrics")).text
        sched_text = await _scheduler_scrape(sched_cfg.scheduler.metrics_port, list(plan))
        w_texts = [
            await asyncio.to_thread(scrape_port, w.observer.metrics_port) for w in workers.values()
        ]
        nc = await connect(config.nats, "obs-heartbeats")
        kv = await ensure_kv(nc.jetstream(), config.nats)
        heartbeats = {
            w.worker_id: json.loads((await kv.get(f"workers.{w.worker_id}")).value or b"{}")
            for w in workers.values()
        }
        targets = await scrape_targets(nc.jetstream(), config.nats.kv_bucket)
        await nc.close()
    finally:
        await scheduler.stop()
    return Scrapes(
        gateway=(gw_before, gw_after),
        workers={g: (w_before[g], w_after[g]) for g in workers},
        scheduler=parse_metrics(sched_text),
        texts=[gw_text, sched_text, *w_texts],
        heartbeats=heartbeats,
        ports={w.worker_id: w.observer.metrics_port for w in workers.values()},
        targets=targets,
    )


async def _settled(
    http: httpx.AsyncClient, workers: dict[str, WorkerService], plan: dict[str, int]
) -> tuple[Samples, dict[str, Samples]]:
    """Scrapes once every request is counted (a worker counts after its ack, the gateway
    after the last byte), then once more to show nothing else moves."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        gw = parse_metrics((await http.get("/metrics")).text)
        ws = {
            g: parse_metrics(await asyncio.to_thread(scrape_port, w.observer.metrics_port))
            for g, w in workers.items()
        }
        done = all(
            value(gw, "qos_gateway_e2e_request_latency_seconds_count", group=g) >= n
            and value(ws[g], "qos_e2e_request_latency_seconds_count", group=g) >= n
            for g, n in plan.items()
        )
        if done or loop.time() > deadline:
            await asyncio.sleep(0.2)
            gw = parse_metrics((await http.get("/metrics")).text)
            ws = {
                g: parse_metrics(await asyncio.to_thread(scrape_port, w.observer.metrics_port))
                for g, w in workers.items()
            }
            return gw, ws
        await asyncio.sleep(0.05)


async def _scheduler_scrape(port: int, groups: list[str]) -> str:
    """The scheduler's ``/metrics`` once it has published breaker and desired replicas."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        text = await asyncio.to_thread(scrape_port, port)
        samples = parse_metrics(text)
        if (
            all(("qos_desired_replicas", frozenset({("group", g)})) in samples for g in groups)
            or loop.time() > deadline
        ):
            return text
        await asyncio.sleep(0.1)
