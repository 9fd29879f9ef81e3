"""A worker's Prometheus metrics: per-request series and the engine's state at scrape time.

Per-request series (TTFT, ITL, E2E, queue time, finished requests, tokens) are observed on
the event loop as requests move (:mod:`workers.observe`). The engine's state — running
and waiting requests, KV usage, prefix-cache queries and hits per tier, preemptions — is
*read* when Prometheus scrapes (:class:`EngineCollector`), from the snapshot the engine
thread already keeps for telemetry, so serving pays nothing for it. GPU series come from
NVML when it is there (:mod:`common.gpu_metrics`).

Counters read from the engine are totals since the engine started; each scrape credits
what they grew since the last one to the group the replica serves *now*, and every group
it served keeps its series (frozen while it serves another). Labelling the whole total
with the current group made a replica moved A → B → A bring B's work back under A, which
a ``rate()`` over the gap counted as A's. What grew between the move and the next scrape
goes to the new group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common import metrics as m
from common.gpu_metrics import nvml_collector
from workers.engine.outputs import EngineStats


@dataclass(frozen=True)
class EngineView:
    """What the collector reads at scrape time: the replica's group and engine snapshot."""

    group: str
    stats: EngineStats
    batch_cap: int
    busy_s: float
    kv_tier: Any = None  # kvstore.KVTiers when the engine has one: per-tier counters


@dataclass(frozen=True, slots=True)
class RequestSeries:
    """One group's label children of the per-request series (``labels()`` is not free)."""

    ttft: Any
    itl: Any
    e2e: Any
    queue: Any
    prompt_tokens: Any
    generation_tokens: Any
    resumed: Any
    orphaned: Any


class WorkerMetrics:
    """The worker's registry: request series, the engine collector, build info, GPUs."""

    def __init__(
        self,
        model: str,
        view: Callable[[], EngineView | None],
        registry: CollectorRegistry | None = None,
        *,
        gpus: bool = True,
    ) -> None:
        self.model = model
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = m.histogram(m.TTFT, r)
        self.itl = m.histogram(m.ITL, r)
        self.e2e = m.histogram(m.E2E, r)
        self.queue = m.histogram(m.QUEUE_TIME, r)
        self.success = m.counter(m.SUCCESS, r)
        self.errors = m.counter(m.ERRORS, r)
        self.resumed = m.counter(m.RESUMED, r)
        self.orphaned = m.counter(m.ORPHANED, r)
        self.prompt_tokens = m.counter(m.PROMPT_TOKENS, r)
        self.generation_tokens = m.counter(m.GENERATION_TOKENS, r)
        self.guided = m.counter(m.GUIDED, r)
        self.guided_compile = m.histogram(m.GUIDED_COMPILE, r)
        self._series: dict[str, RequestSeries] = {}
        self._outcomes: dict[tuple[str, str, bool], Any] = {}
        r.register(EngineCollector(model, view))
        m.register_build_info(r, "worker")

        def owner() -> tuple[str, str]:
            engine = view()
            return (engine.group if engine is not None else "", model)

        gpu = nvml_collector(owner=owner) if gpus else None
        if gpu is not None:
            r.register(gpu)

    def series(self, group: str) -> RequestSeries:
        """The per-request series of ``group``, looked up once."""
        found = self._series.get(group)
        if found is None:
            labels = (group, self.model)
            found = self._series[group] = RequestSeries(
                ttft=self.ttft.labels(*labels),
                itl=self.itl.labels(*labels),
                e2e=self.e2e.labels(*labels),
                queue=self.queue.labels(*labels),
                prompt_tokens=self.prompt_tokens.labels(*labels),
                generation_tokens=self.generation_tokens.labels(*labels),
                resumed=self.resumed.labels(*labels),
                orphaned=self.orphaned.labels(*labels),
            )
        return found

    def outcome(self, group: str, reason: str, *, error: bool) -> Any:
        """The counter child of a finished request: success by reason, errors by code."""
        key = (group, reason, error)
        child = self._outcomes.get(key)
        if child is None:
            family = self.errors if error else self.success
            child = self._outcomes[key] = family.labels(group, self.model, reason)
        return child


class EngineCollector(Collector):
    """The engine's gauges and counters, built from an :class:`EngineView` per scrape."""

    def __init__(self, model: str, view: Callable[[], EngineView | None]) -> None:
        self._model = model
        self._view = view
        # Counter totals at the last scrape, by (family, labels after group and model), and
        # what each group was credited: (family, group, those labels) -> value.
        self._seen: dict[tuple[str, tuple[str, ...]], float] = {}
        self._credited: dict[tuple[str, str, tuple[str, ...]], float] = {}
        self._lock = threading.Lock()  # scrapes may come on several server threads

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        if view is None:  # not started yet: nothing to say
            return
        yield from self._families(view)

    def _families(self, view: EngineView | None = None) -> Iterator[Metric]:
        samples = _samples(view, self._model) if view is not None else {}
        families = []
        with self._lock:  # built whole under it, yielded after
            for spec, kind in _ENGINE_FAMILIES:
                family = kind(spec.name, spec.doc, labels=list(spec.labels))
                current = samples.get(spec.name, [])
                if kind is CounterMetricFamily and view is not None:
                    current = self._by_group(spec.name, current)
                for labels, value in current:
                    family.add_metric(labels, value)
                families.append(family)
        yield from families

    def _by_group(
        self, name: str, totals: list[tuple[list[str], float]]
    ) -> list[tuple[list[str], float]]:
        """Credit each total's growth since the last scrape to its (current) group; every
        group's credited value, the groups this replica served before included."""
        for labels, total in totals:
            group, rest = labels[0], tuple(labels[2:])
            grown = total - self._seen.get((name, rest), 0.0)
            self._seen[name, rest] = total
            key = (name, group, rest)
            self._credited[key] = self._credited.get(key, 0.0) + max(grown, 0.0)
        return [
            ([group, self._model, *rest], value)
            for (family, group, rest), value in self._credited.items()
            if family == name
        ]


_ENGINE_FAMILIES: tuple[tuple[m.Spec, type[Any]], ...] = (
    (m.RUNNING, GaugeMetricFamily),
    (m.WAITING, GaugeMetricFamily),
    (m.KV_USAGE, GaugeMetricFamily),
    (m.BATCH_CAP, GaugeMetricFamily),
    (m.PREEMPTIONS, CounterMetricFamily),
    (m.PRIORITY_PREEMPTIONS, CounterMetricFamily),
    (m.ENGINE_BUSY, CounterMetricFamily),
    (m.PREFIX_QUERIES, CounterMetricFamily),
    (m.PREFIX_HITS, CounterMetricFamily),
    (m.KV_TIER_BYTES, CounterMetricFamily),
    (m.KV_TIER_SECONDS, CounterMetricFamily),
    (m.KV_TIER_OPS, CounterMetricFamily),
    (m.KV_TIER_DROPS, CounterMetricFamily),
    (m.KV_TIER_CORRUPT, CounterMetricFamily),
    (m.KV_TIER_ERRORS, CounterMetricFamily),
)


def _samples(view: EngineView, model: str) -> dict[str, list[tuple[list[str], float]]]:
    """Family name → (label values, value) of one scrape."""
    s, base = view.stats, [view.group, model]
    tiers = _tiers(view)

    def per_op(load: str, store: str) -> list[tuple[list[str], float]]:
        return [([*base, t, op], getattr(c, field)) for t, c in tiers
                for op, field in (("load", load), ("store", store))]  # fmt: skip

    return {
        m.RUNNING.name: [(base, s.num_running)],
        m.WAITING.name: [(base, s.num_waiting)],
        m.KV_USAGE.name: [(base, s.kv_usage)],
        m.BATCH_CAP.name: [(base, view.batch_cap)],
        m.PREEMPTIONS.name: [(base, s.num_preemptions)],
        m.PRIORITY_PREEMPTIONS.name: [(base, s.num_priority_preemptions)],
        m.ENGINE_BUSY.name: [(base, view.busy_s)],
        # G1 (the device cache), then the KV tiers present.
        m.PREFIX_QUERIES.name: [([*base, "device"], s.prefix_cache_queries)]
        + [([*base, t], c.query_tokens) for t, c in tiers],
        m.PREFIX_HITS.name: [([*base, "device"], s.prefix_cache_hits)]
        + [([*base, t], c.hit_tokens) for t, c in tiers],
        m.KV_TIER_BYTES.name: per_op("load_bytes", "store_bytes"),
        m.KV_TIER_SECONDS.name: per_op("load_s", "store_s"),
        m.KV_TIER_OPS.name: per_op("loads", "stores"),
        m.KV_TIER_DROPS.name: [([*base, t], c.drops) for t, c in tiers],
        m.KV_TIER_CORRUPT.name: [([*base, t], c.corrupt) for t, c in tiers],
        m.KV_TIER_ERRORS.name: [([*base, t], c.errors) for t, c in tiers],
    }


def _tiers(view: EngineView) -> list[tuple[str, Any]]:
    """(tier, its counters) of the KV tiers present below the device cache."""
    tier = view.kv_tier
    if tier is None:
        return []
    stats = tier.stats()
    present = [("host", stats.host_capacity_blocks > 0, stats.host),
               ("redis", getattr(tier, "redis_config", None) is not None, stats.redis)]  # fmt: skip
    return [(name, counters) for name, here, counters in present if here]
