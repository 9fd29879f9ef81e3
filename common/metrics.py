"""The ``qos_*`` Prometheus metrics of every service (DESIGN §7): names, labels, buckets.

One place defines what each service exports, so the dashboard, the tests and the services
agree on a name. Each service keeps a :class:`~prometheus_client.CollectorRegistry` of its
own (tests build many services in one process) and wires it in a few lines:

- gateway (``gateway.metrics``): what the client sees, ``qos_gateway_*``: requests by
  status, TTFT and E2E measured at the HTTP edge, in-flight, fallbacks, live workers.
- worker (``workers.metrics``): the engine's view, the DESIGN names: TTFT, ITL, E2E and
  queue time (``group``, ``model``), running/waiting, KV usage, prefix-cache queries and
  hits per ``tier``, preemptions; GPU utilisation and memory when NVML is importable.
- scheduler (``scheduler.metrics``): ``qos_breaker_state``, ``qos_desired_replicas`` and
  the group windows it judges.

Every service also exports :data:`BUILD_INFO`. Names below are the *family* names; a
counter's samples end in ``_total`` and a histogram's in ``_bucket``/``_sum``/``_count``.
"""

from __future__ import annotations

import logging
import platform
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from common.liveness import LoopBeat, with_liveness
from common.loop_histogram import LoopHistogram

log = logging.getLogger(__name__)

# Bucket edges (seconds) include every default group's SLO (TTFT 100 ms / 200 ms / 5 s,
# E2E p99 200 ms / 500 ms / 60 s) so a histogram_quantile near an SLO is not interpolated
# across a wide bucket.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (  # from 5 ms: a realtime answer on a GPU, or a short one, ends below 50 ms
    0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 45.0, 60.0, 90.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
QUEUE_BUCKETS = TTFT_BUCKETS

REQUEST = ("group", "model")  # the labels of every per-request series


@dataclass(frozen=True)
class Spec:
    """One metric family: what it is called, what it means, its labels (and buckets)."""

    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


# --- worker: per request (observed on the event loop) ------------------------------------
TTFT = Spec(
    "qos_time_to_first_token_seconds",
    "Request creation (gateway publish) to the engine's first token; includes queueing",
    REQUEST, TTFT_BUCKETS,
)  # fmt: skip
ITL = Spec(
    "qos_inter_token_latency_seconds",
    "Time between two consecutive engine outputs of one request, per token",
    REQUEST, ITL_BUCKETS,
)  # fmt: skip
E2E = Spec(
    "qos_e2e_request_latency_seconds",
    "Request creation to its final chunk published (successful requests)",
    REQUEST, E2E_BUCKETS,
)  # fmt: skip
QUEUE_TIME = Spec(
    "qos_request_queue_time_seconds",
    "Request creation to its first scheduling in the engine (JetStream + engine queue)",
    REQUEST, QUEUE_BUCKETS,
)  # fmt: skip
SUCCESS = Spec(
    "qos_request_success",
    "Requests answered, by finish reason (abort: cancelled by its caller; no latency observed)",
    (*REQUEST, "finished_reason"),
)
ERRORS = Spec("qos_request_errors", "Requests answered with an error, by code", (*REQUEST, "code"))
RESUMED = Spec("qos_request_resumed", "Redelivered requests resumed here (attempt > 1)", REQUEST)
ORPHANED = Spec(
    "qos_request_orphaned", "Requests aborted here because their gateway went silent", REQUEST
)
PROMPT_TOKENS = Spec("qos_prompt_tokens", "Prompt tokens of finished requests", REQUEST)
GENERATION_TOKENS = Spec("qos_generation_tokens", "Tokens generated and sent", REQUEST)
GUIDED = Spec(
    "qos_guided_requests",
    "Guided-decoding requests admitted, by kind (json_schema, regex, choice, grammar)",
    (*REQUEST, "kind"),
)
GUIDED_COMPILE = Spec(
    "qos_guided_compile_seconds",
    "Time to make a guided request's matcher (a spec compiled, or a cached one copied)",
    REQUEST,
    (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

# --- worker: engine state (read from the engine's stats at scrape time) -------------------
RUNNING = Spec("qos_num_requests_running", "Requests in the engine's running batch", REQUEST)
WAITING = Spec("qos_num_requests_waiting", "Requests waiting in the engine's queue", REQUEST)
BATCH_CAP = Spec("qos_batch_cap", "Running-batch cap (the breaker lowers it)", REQUEST)
KV_USAGE = Spec("qos_kv_cache_usage_ratio", "Share of the device KV cache blocks in use", REQUEST)
PREFIX_QUERIES = Spec(
    "qos_prefix_cache_queries",
    "Prompt tokens looked up per KV tier (device = G1, host = G2, redis = G3)",
    (*REQUEST, "tier"),
)
PREFIX_HITS = Spec(
    "qos_prefix_cache_hits", "Prompt tokens found (not computed) per KV tier", (*REQUEST, "tier")
)
KV_TIER_BYTES = Spec(
    "qos_kv_tier_bytes", "KV bytes moved per tier and direction (op: load | store)",
    (*REQUEST, "tier", "op"),
)  # fmt: skip
KV_TIER_SECONDS = Spec(
    "qos_kv_tier_seconds",
    "Wall time of those loads and stores (Redis stores: while any was in flight, so bytes "
    "over seconds is the store rate; per call: divide by qos_kv_tier_operations)",
    (*REQUEST, "tier", "op"),
)
KV_TIER_OPS = Spec(
    "qos_kv_tier_operations", "Load calls and store batches per tier", (*REQUEST, "tier", "op")
)
KV_TIER_DROPS = Spec(
    "qos_kv_tier_dropped_blocks",
    "Blocks not written through (queue full, breaker open, no room): recomputed later",
    (*REQUEST, "tier"),
)
KV_TIER_CORRUPT = Spec(
    "qos_kv_tier_corrupt_values",
    "Values that failed to decode (checksum, layout, an unauthenticated value): misses",
    (*REQUEST, "tier"),
)
KV_TIER_ERRORS = Spec(
    "qos_kv_tier_errors", "Tier calls that failed or timed out (misses)", (*REQUEST, "tier")
)
PREEMPTIONS = Spec("qos_num_preemptions", "Requests preempted by the engine", REQUEST)
PRIORITY_PREEMPTIONS = Spec(
    "qos_num_priority_preemptions",
    "Of qos_num_preemptions, those that let a more urgent waiting request in",
    REQUEST,
)
ENGINE_BUSY = Spec(
    "qos_engine_busy_seconds", "Wall time the engine spent in steps that did work", REQUEST
)

# --- worker: the GPU, through NVML (absent, not zero, without it) ----------------------
# The worker's group and model too: a dashboard filtered by group shows its GPUs.
GPU_LABELS = ("gpu", "group", "model")
GPU_UTILIZATION = Spec(
    "qos_gpu_utilization_ratio", "Share of the last sample period a kernel ran (NVML)", GPU_LABELS
)
GPU_MEMORY_USED = Spec("qos_gpu_memory_used_bytes", "GPU memory in use (NVML)", GPU_LABELS)
GPU_MEMORY_TOTAL = Spec("qos_gpu_memory_total_bytes", "GPU memory installed (NVML)", GPU_LABELS)
GPU_SPECS = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL)

# --- gateway: the client's view -----------------------------------------------------------
GW_REQUESTS = Spec(
    "qos_gateway_requests",
    "Finished HTTP generation requests by the group that served them and status code",
    ("group", "status"),
)
GW_TTFT = Spec(
    "qos_gateway_time_to_first_token_seconds",
    "HTTP request arrival to the first token ready for the client",
    REQUEST, TTFT_BUCKETS,
)  # fmt: skip
GW_E2E = Spec(
    "qos_gateway_e2e_request_latency_seconds",
    "HTTP request arrival to the last token (status 200)",
    REQUEST, E2E_BUCKETS,
)  # fmt: skip
GW_IN_FLIGHT = Spec(
    "qos_gateway_requests_in_flight", "Requests admitted to a group and not yet finished",
    ("group",),
)  # fmt: skip
GW_FALLBACKS = Spec(
    "qos_gateway_fallbacks",
    "Requests sent to a fallback group instead of the classified one",
    ("from_group", "to_group", "reason"),
)
GW_TOKENS = Spec("qos_gateway_generation_tokens", "Completion tokens delivered", ("group",))
# Per API key (gateway.api_key_names, else the digest's first 8 hex digits): what each
# tenant used and was refused, bounded by the configured keys.
GW_KEY_REQUESTS = Spec(
    "qos_gateway_key_requests",
    "Admitted generation requests by API key and how they ended (status code)",
    ("key", "status"),
)
GW_KEY_TOKENS = Spec(
    "qos_gateway_key_tokens",
    "Tokens by API key: prompt (each prompt once, of requests that ran) and completion",
    ("key", "kind"),
)
GW_KEY_REFUSED = Spec(
    "qos_gateway_key_refused",
    "Requests refused for the key's own limits: rate (api_key_rate_limit_rps) or "
    "in_flight (api_key_max_in_flight)",
    ("key", "reason"),
)
GW_LIVE_WORKERS = Spec(
    "qos_gateway_live_workers", "Workers per group whose telemetry is recent and says serving",
    ("group",),
)  # fmt: skip
GW_BREAKER = Spec(
    "qos_gateway_breaker_state",
    "Breaker state per group as the gateway sees it (0 closed, 1 half-open, 2 open)",
    ("group",),
)

# --- scheduler ----------------------------------------------------------------------------
BREAKER_STATE = Spec(
    "qos_breaker_state", "Breaker state: 0 closed, 1 half-open, 2 open", ("group",)
)
BREAKER_TRANSITIONS = Spec(
    "qos_breaker_transitions", "Breaker transitions", ("group", "from", "to")
)
DESIRED_REPLICAS = Spec(
    "qos_desired_replicas", "Replicas the rebalancer wants per group", ("group",)
)

# --- every service, with tracing on (read from the span batch at scrape time) -------------
TRACE_SPANS = Spec(
    "qos_trace_spans",
    "Sampled spans by fate: exported, failed (the exporter gave up), dropped (queue full)",
    ("outcome",),
)
TRACE_EXPORT_CPU = Spec(
    "qos_trace_export_cpu_seconds",
    "CPU the span export thread spent encoding and sending (not waiting)",
)
TRACE_QUEUE = Spec("qos_trace_queue_spans", "Sampled spans waiting for the export thread")

# --- every service ------------------------------------------------------------------------
BUILD_INFO = Spec(
    "qos_build_info",
    "Always 1; the labels say what runs",
    ("service", "version", "python", "torch"),
)


def counter(spec: Spec, registry: CollectorRegistry) -> Counter:
    """A :class:`Counter` for ``spec`` in ``registry``."""
    return Counter(spec.name, spec.doc, spec.labels, registry=registry)


def gauge(spec: Spec, registry: CollectorRegistry) -> Gauge:
    """A :class:`Gauge` for ``spec`` in ``registry``."""
    return Gauge(spec.name, spec.doc, spec.labels, registry=registry)


def histogram(spec: Spec, registry: CollectorRegistry) -> LoopHistogram:
    """A histogram for ``spec`` (its buckets) in ``registry``, observed on one thread (the
    service's event loop: :mod:`common.loop_histogram`, no lock per observation)."""
    assert spec.buckets is not None, f"{spec.name} has no buckets"
    return LoopHistogram(spec.name, spec.doc, spec.labels, spec.buckets, registry)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def register_build_info(registry: CollectorRegistry, service: str) -> None:
    """``qos_build_info{service,version,python,torch} 1``; torch's version is read from its
    package metadata, so a gateway that never imports torch does not pay for it here."""
    info = gauge(BUILD_INFO, registry)
    info.labels(service, _version("qosserve"), platform.python_version(), _version("torch")).set(1)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape or probe on stderr."""


class MetricsServer:
    """``/metrics`` of one registry, and ``/livez`` from ``beat`` (:mod:`common.liveness`),
    over HTTP in a daemon thread. Raises OSError when the port cannot be bound."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int = 0,
        host: str = "127.0.0.1",
        beat: LoopBeat | None = None,
    ) -> None:
        app = with_liveness(make_wsgi_app(registry), beat)
        self._server: ThreadingWSGIServer | None = make_server(
            host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler
        )
        threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        ).start()
        self.host = host
        self.port: int = self._server.server_port

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
