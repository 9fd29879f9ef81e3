"""The loop histogram exposes exactly what prometheus_client's Histogram does."""

from __future__ import annotations

import math
import random
import threading

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.loop_histogram import LoopHistogram
from common.metrics import ITL_BUCKETS

EDGES = ITL_BUCKETS  # includes values equal to edges below: "le" is inclusive


def _lines(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_exposition_equals_prometheus_clients_histogram() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("qos_x_seconds", "Doc", ("group", "model"), EDGES, ours)
    reference = Histogram(
        "qos_x_seconds", "Doc", ("group", "model"), buckets=EDGES, registry=theirs
    )
    rng = random.Random(7)
    values = [rng.choice(EDGES) for _ in range(200)] + [rng.uniform(0, 100) for _ in range(800)]
    values += [0.0, 1e9, EDGES[0], EDGES[-1]]
    for i, value in enumerate(values):
        labels = ("short", "m") if i % 3 else ("long", "m")
        loop.labels(*labels).observe(value)
        reference.labels(*labels).observe(value)
    assert _lines(ours) == _lines(theirs)


def test_a_count_is_that_many_observations() -> None:
    registry = CollectorRegistry()
    h = LoopHistogram("qos_itl_seconds", "Doc", ("group",), EDGES, registry)
    h.labels("short").observe(0.012, 5)
    h.labels("short").observe(0.3)
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    samples = {(s.name, s.labels.get("le")): s.value for s in families["qos_itl_seconds"].samples}
    assert samples[("qos_itl_seconds_count", None)] == 6
    assert math.isclose(samples[("qos_itl_seconds_sum", None)], 0.012 * 5 + 0.3)
    assert samples[("qos_itl_seconds_bucket", "0.01")] == 0
    assert samples[("qos_itl_seconds_bucket", "0.015")] == 5
    assert samples[("qos_itl_seconds_bucket", "0.3")] == 6
    assert samples[("qos_itl_seconds_bucket", "+Inf")] == 6


def test_a_scrape_during_observations_is_self_consistent() -> None:
    """The writer thread observes while another scrapes: +Inf always equals _count and the
    buckets never decrease from one scrape to the next."""
    registry = CollectorRegistry()
    child = LoopHistogram("qos_e2e_seconds", "Doc", ("group",), EDGES, registry).labels("g")
    done = threading.Event()

    def write() -> None:
        rng = random.Random(1)
        for _ in range(200_000):
            child.observe(rng.uniform(0, 2))
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    previous: list[float] = []
    mid_run = 0  # scrapes that caught the writer part-way: what the test is about
    while not done.is_set():
        (family,) = text_string_to_metric_families(generate_latest(registry).decode())
        buckets = [s.value for s in family.samples if s.name.endswith("_bucket")]
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        mid_run += 0 < count < 200_000
        assert buckets[-1] == count
        assert buckets == sorted(buckets)
        if previous:
            assert all(a >= b for a, b in zip(buckets, previous, strict=True))
        previous = buckets
    writer.join()
    assert mid_run > 0


def test_bad_buckets_and_labels_are_refused() -> None:
    registry = CollectorRegistry()
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("qos_a_seconds", "Doc", (), (0.2, 0.1), registry)
    h = LoopHistogram("qos_b_seconds", "Doc", ("group",), (0.1, float("inf")), registry)
    with pytest.raises(ValueError, match="takes labels"):
        h.labels("a", "b")
    with pytest.raises(ValueError, match="Duplicated"):
        LoopHistogram("qos_b_seconds", "Doc", ("group",), (0.1,), registry)
