"""A Prometheus histogram for values observed on one thread: an event loop's request hooks.

``prometheus_client.Histogram.observe`` takes a lock for the sum and another for the
bucket, after walking the bucket edges in Python: ~1.5 µs. A worker observes the
inter-token latency of every token it streams, so at zero engine cost that was the
largest part of its per-request hooks. Here an observation is a C ``bisect`` and two
additions (~0.2 µs), and :meth:`LoopHistogramChild.observe` takes a count, so a delta of
``n`` tokens with one gap is one call.

The price is the writer: observations must come from one thread at a time (the services
observe on their event loop). The scrape, on the metrics server's thread, copies the
bucket counts in one step under the GIL and derives ``_count`` from that copy, so a
scrape is always self-consistent (``_count`` equals the ``+Inf`` bucket); ``_sum`` may
trail by the observation in progress. The exposition is prometheus_client's: the same
family, ``le`` labels written by its own formatter, without the ``_created`` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class LoopHistogramChild:
    """The counts of one label set."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``count`` observations of ``value`` (seconds)."""
        # bisect_left: the first edge >= value, i.e. the bucket "le" that first holds it.
        self._counts[bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def snapshot(self) -> tuple[list[int], float]:
        """(per-bucket counts, sum): the counts copied in one step."""
        return list(self._counts), self._sum


class LoopHistogram(Collector):
    """A labelled histogram family registered in ``registry``, for one writer thread."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be distinct and increasing: {buckets!r}")
        if bounds[-1] == float("inf"):
            bounds = bounds[:-1]  # +Inf is always there
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = bounds
        self._edges = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogramChild:
        """The child of these label values (look it up once and keep it: this is a dict
        lookup, the observation is cheaper)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values!r}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopHistogramChild(self.bounds)
        return child

    def describe(self) -> Iterator[Metric]:
        """The family with no samples: lets the registry reject a second metric of the name."""
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            counts, total = child.snapshot()
            cumulative, running = [], 0
            for edge, n in zip(self._edges, counts, strict=True):
                running += n
                cumulative.append((edge, running))
            family.add_metric(list(values), cumulative, total)
        yield family
