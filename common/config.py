"""One typed configuration object for every service.

Defaults come from DESIGN §3 (the field study's instance groups). A YAML file (``--config``
or ``QOS_CONFIG``) overrides them, then ``QOS_*`` environment variables override that:
``QOS_NATS__URL=nats://h:4222`` sets ``nats.url``; ``QOS_GROUPS__SHORT__MAX_BATCH=8`` sets
``groups.short.max_batch``. Values in variables are parsed as YAML (scalars, or flow lists and maps
such as ``[a, b]``). An unknown key
or a bad value fails at start-up with a :class:`ConfigError` naming it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from common.errors import ConfigError

ENV_PREFIX = "QOS_"
_SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
# Keys whose variables are taken as raw strings, never parsed (nor quoted in errors).
SECRET_KEYS = frozenset({"password", "token", "alert_webhook_url", "kv_mac_secret"})
Policy = Literal["static", "dynamic", "continuous", "hybrid"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BreakerConfig(_Strict):
    """Per-group circuit breaker (field study: 10 samples, mean p99 > 500 ms → open, cap 4)."""

    window_samples: int = Field(10, ge=1)
    min_samples: int = Field(5, ge=1)
    p99_threshold_ms: float = Field(500.0, gt=0)
    error_rate_threshold: float = Field(0.2, gt=0, le=1)
    open_batch_cap: int = Field(4, ge=1)
    wait_open_s: float = Field(10.0, gt=0)
    half_open_share: float = Field(0.25, gt=0, le=1)
    close_after_healthy: int = Field(3, ge=1)
    # Which latency the breaker watches; its threshold is never below the group's SLO of
    # that kind (slo_e2e_p99_ms / slo_ttft_ms): a group meeting its SLO is healthy. "e2e"
    # also sees a hung group (requests running, none finishing); with "ttft" a hung group
    # reports no first tokens at all, and only its error rate (deadline errors) trips it.
    p99_kind: Literal["e2e", "ttft"] = "e2e"
    # The error rate is judged only over at least this many finished requests.
    min_requests: int = Field(10, ge=1)


class GroupConfig(_Strict):
    """An instance group: its limits, SLOs, policy and fallback."""

    max_batch: int = Field(ge=1)
    max_seq_len: int = Field(ge=16)
    slo_ttft_ms: float = Field(gt=0)
    slo_e2e_p99_ms: float = Field(gt=0)
    policy: Policy = "hybrid"
    # continuous/hybrid: while requests run, new ones wait up to this many times the last
    # admitting step's duration (10 ms at most) so that they prefill together (EngineArgs;
    # 0 = never wait).
    prefill_delay_factor: float = Field(0.0, ge=0, le=100)
    # Queued + running requests the gateway admits before it sheds with 429.
    max_pending: int = Field(64, ge=1)
    fallback: str | None = None
    # Lower routes first when the classifier has a choice.
    rank: int = 0
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)


def default_groups() -> dict[str, GroupConfig]:
    """The field study's three groups (DESIGN §3)."""
    return {
        "realtime": GroupConfig(
            max_batch=1,
            max_seq_len=1024,
            slo_ttft_ms=100,
            slo_e2e_p99_ms=200,
            policy="continuous",
            max_pending=8,
            fallback="short",
            rank=0,
        ),
        "short": GroupConfig(
            max_batch=16,
            max_seq_len=4096,
            slo_ttft_ms=200,
            slo_e2e_p99_ms=500,
            policy="hybrid",
            prefill_delay_factor=1.0,  # README "Prefill delay": it pays for hybrid on a GPU
            max_pending=256,
            fallback="long",
            rank=1,
        ),
        "long": GroupConfig(
            max_batch=2,
            max_seq_len=131072,
            slo_ttft_ms=5000,
            slo_e2e_p99_ms=60000,
            policy="hybrid",
            prefill_delay_factor=1.0,
            max_pending=16,
            fallback=None,
            rank=2,
        ),
    }


class NatsConfig(_Strict):
    """Connection, credentials/TLS and the JetStream names (DESIGN §2)."""

    url: str = "nats://127.0.0.1:4222"
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # TLS before any NATS byte (the server's tls { handshake_first: true }): without it the
    # client upgrades only when the server's INFO asks, which a man in the middle can strip.
    tls_handshake_first: bool = False
    # Where replies to this connection arrive (pulled requests, JetStream API answers).
    # Unset: _INBOX_<service> (gateway, worker, scheduler), so deploy/nats/permissions.conf
    # can keep each service out of the others' replies, which carry prompts.
    inbox_prefix: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")

    @field_validator("url")
    @classmethod
    def _nats_url(cls, value: str) -> str:
        # Several servers comma-separated (a cluster's seeds, tried in turn); the value
        # stays out of the message (a URL may carry a password).
        urls = _split_urls(value)
        if not urls or any(
            not url.startswith(("nats://", "tls://", "ws://", "wss://")) for url in urls
        ):
            raise ValueError("must be nats://, tls://, ws:// or wss:// URLs, comma-separated")
        websocket = [url.startswith(("ws://", "wss://")) for url in urls]
        if any(websocket) and not all(websocket):
            raise ValueError("cannot mix websocket (ws://, wss://) and nats:// or tls:// URLs")
        return value

    subject_prefix: str = Field("qos", pattern=r"^[A-Za-z0-9_-]+$")
    stream: str = Field("QOS_REQ", pattern=r"^[A-Za-z0-9_-]+$")
    kv_bucket: str = Field("qos_state", pattern=r"^[A-Za-z0-9_-]+$")
    # Copies JetStream keeps of the request stream and the state bucket when it creates them:
    # 3 on a 3-node cluster survives losing a server (1 = a single server's data). Existing
    # ones keep theirs (a warning says when they differ).
    replicas: int = Field(1, ge=1, le=5)
    ack_wait_s: float = Field(30.0, gt=0)
    max_deliver: int = Field(5, ge=1)
    duplicate_window_s: float = Field(120.0, gt=0)
    max_payload_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    connect_timeout_s: float = Field(5.0, gt=0)
    reconnect_wait_s: float = Field(0.5, gt=0)
    max_reconnect_attempts: int = -1  # -1 = forever: services outlive a NATS restart
    # A link that dies without a close (a powered-off node, a partition dropping packets)
    # shows only as pongs that stop: declared dead after this many pings unanswered, ~15-20 s
    # (nats-py's defaults, 120 s and 2, kept a gateway answering 200 for four minutes).
    ping_interval_s: float = Field(5.0, gt=0)
    max_outstanding_pings: int = Field(3, ge=1)

    @property
    def servers(self) -> list[str]:
        """``url`` as a server list: a cluster's seeds, comma-separated, tried in turn."""
        return _split_urls(self.url)


def _split_urls(value: str) -> list[str]:
    return [url.strip() for url in value.split(",") if url.strip()]


# What a Redis URL may hold: both the tier's clients read these and nothing else.
_REDIS_URL_PARTS = {"host", "port", "db", "username", "password", "path", "connection_class"}


class RedisConfig(_Strict):
    """The shared cold KV tier."""

    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    # A client certificate, for a server that asks for one (redis-server's TLS default,
    # tls-auth-clients yes, refuses every client without); both or neither.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_connections: int = Field(16, ge=1)
    ttl_s: int = Field(3600, ge=1)
    socket_timeout_s: float = Field(0.5, gt=0)
    # A prefix load from Redis slower than this (GB/s, plus one socket timeout) is given up:
    # the engine's batch waits for it, and recomputing is faster (loopback: ~2 GB/s).
    load_min_gbps: float = Field(0.25, gt=0)
    # A secret every worker shares: KV values in Redis are then authenticated (a keyed
    # blake2b), so one who can write to Redis but lacks it cannot plant KV under a prompt's
    # key. Set it wherever Redis is not private to the workers.
    kv_mac_secret: str | None = Field(None, min_length=16)  # empty: a mistake, not "off"

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        # The message leaves the value out: a URL may carry a password.
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        from redis.connection import parse_url

        # Query options (?ssl_cert_reqs=none, ?socket_timeout=3) would hold for redis-py's
        # connections and not for the tier's own (kvstore/bulk_io.py): refused, not split.
        try:
            extra = set(parse_url(value)) - _REDIS_URL_PARTS
        except ValueError:
            raise ValueError("not a valid Redis URL") from None
        if extra:
            raise ValueError(
                f"URL options {', '.join(sorted(extra))} are not supported: use the redis.* "
                "settings (socket_timeout_s, tls_ca_file, tls_cert_file, tls_key_file)"
            )
        return value

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> RedisConfig:
        # A CA file with a redis:// URL would connect in plaintext and send AUTH in clear.
        for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(self, key) and not self.url.startswith("rediss://"):
                raise ValueError(f"redis.{key} is set: the URL must be rediss:// (TLS)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("redis.tls_cert_file and redis.tls_key_file must be set together")
        return self


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # sha256 hex digests of accepted API keys; empty = open (a warning is logged at start).
    api_key_sha256: list[str] = Field(default_factory=list)
    # Per key (its digest): the instance groups it may use, by name or by length routing,
    # fallbacks included (another team's key kept off realtime, say). A key not listed may
    # use every group.
    api_key_groups: dict[str, list[str]] = Field(default_factory=dict)
    # Per API key: sustained requests/s and burst (a token bucket each); 0 = unlimited.
    # A key over its rate gets 429 rate_limit_exceeded with Retry-After.
    api_key_rate_limit_rps: float = Field(0.0, ge=0)
    api_key_rate_limit_burst: int = Field(0, ge=0)  # 0 = one second's worth (at least 1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    default_deadline_ms: int = Field(120_000, ge=100)
    default_max_tokens: int = Field(256, ge=1)
    # Sampling fields a request leaves out: "model" takes the model folder's
    # generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty),
    # as transformers and vLLM do; "openai": OpenAI's neutral ones (1.0, 1.0, off...).
    sampling_defaults: Literal["model", "openai"] = "model"
    # Refuse (400) chat messages whose text holds a special token's text (<|eot_id|>...):
    # tokenized as the token, as transformers does, it lets a user close their turn and
    # write a system one. Off by default, as in transformers and vLLM.
    reject_control_tokens: bool = False
    # "shared": every request may reuse every cached prompt prefix (system prompts, RAG
    # documents: the cheap path). "api_key": each key's requests reuse only their own key's
    # prefixes, on the workers and in the Redis tier, so no team can tell from a fast first
    # token what another team sent. A request's cache_salt narrows either further.
    cache_isolation: Literal["shared", "api_key"] = "shared"
    # On SIGTERM: streams still open this long after are ended with a 503 / an error event
    # the client can act on (a second before the server would cut them); the long group's
    # documents take their time, so give its SLO. Kubernetes' grace period must exceed it.
    shutdown_grace_s: float = Field(30.0, ge=1.0)
    # Origins browsers may call the API from (CORS; ["*"] for any); empty = no CORS headers.
    cors_allow_origins: list[str] = Field(default_factory=list)
    served_model_name: str | None = None
    # Published on qos.gw.<gateway id> so workers can tell a dead gateway's requests
    # (nobody will read their answers) from live ones; see worker.orphan_after_s.
    heartbeat_interval_s: float = Field(1.0, gt=0)
    # How often the gateway checks that the request stream and the group consumers still
    # exist, and recreates them if not (gateway/stream_keeper.py).
    jetstream_check_s: float = Field(10.0, gt=0)

    @field_validator("api_key_sha256")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        # Checked here, not when the gateway starts: a key pasted in plain text stopped it
        # with a traceback after the model had loaded.
        if any(not _SHA256_HEX.match(d.strip()) for d in value):
            raise ValueError(
                "each entry must be the SHA-256 hex digest of a key (64 hex digits), not the "
                "key: python -c \"import hashlib; print(hashlib.sha256(b'KEY').hexdigest())\""
            )
        return value


class WorkerConfig(_Strict):
    model: str = "demo"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    dtype: Literal["auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16"] = "auto"
    # KV cache size. None = sized for the device: 0.5 GiB on a CPU; on a GPU what is left of
    # this worker's share of the GPU (gpu_memory_utilization) once a profile forward has
    # measured the weights and activations, as vLLM does.
    kv_cache_gib: float | None = Field(None, gt=0)
    # This worker's share of its GPU's memory (weights, activations and KV), vLLM's
    # per-instance meaning: workers sharing one GPU each take a part (`qosserve up` divides
    # 0.9 among the workers it starts on one device).
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # KV cache storage: auto = the model dtype; int8 / fp8_e4m3 halve KV memory (one scale per
    # token per KV head). On the demo model int8 changes 2-4 % of greedy golden answers and
    # fp8 8-10 % (bench/kvquant.py; README "Status"): prefer int8 where memory binds.
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = "auto"
    telemetry_interval_s: float = Field(1.0, gt=0)
    # Latency percentiles in telemetry cover requests finished in the last this-many seconds.
    latency_window_s: float = Field(3.0, gt=0)
    coalesce_ms: float = Field(5.0, ge=0)
    metrics_port: int = Field(0, ge=0, le=65535)  # 0 = pick a free one
    # KV tiers below the device cache (DESIGN §5): host memory (G2) and the shared Redis
    # (G3, at redis.url). Off by default so a lone worker never waits on a Redis that is
    # not there; `qosserve up`, compose and Kubernetes switch the Redis tier on.
    kv_host_cache_gib: float = Field(0.0, ge=0)
    kv_redis: bool = False
    # blake2b catches any corruption; crc32 is ~3x cheaper and the block hash in each
    # value's header already ties it to its key.
    kv_checksum: Literal["blake2b", "crc32"] = "crc32"
    # A request whose gateway has sent no heartbeat for this long is aborted: its client's
    # connection died with the gateway, so the rest of the generation would be wasted.
    # 0 = never (requests then run to their deadline). Not counted while this worker
    # itself is cut off from NATS. Requests without an origin (NATS clients) never are.
    orphan_after_s: float = Field(10.0, ge=0)


class SchedulerConfig(_Strict):
    worker_silent_s: float = Field(3.0, gt=0)
    rebalance_interval_s: float = Field(5.0, gt=0)
    metrics_port: int = Field(9300, ge=0, le=65535)  # 0 = no /metrics server
    # Breakers are sampled and evaluated every tick: a transition acts within one tick.
    tick_interval_s: float = Field(0.5, gt=0)
    # Per-group telemetry windows (metrics, rebalancer): the last N group samples of T seconds;
    # a breaker judges none of its samples older than T either.
    window_samples: int = Field(20, ge=1)
    window_s: float = Field(10.0, gt=0)
    # Leader lease `sched.lease` in the state bucket: renewed every renew_s, stale after ttl_s.
    lease_ttl_s: float = Field(3.0, gt=0)
    lease_renew_s: float = Field(1.0, gt=0)
    # Breaker transitions are POSTed here as JSON (in a thread, never blocking), when set.
    alert_webhook_url: str | None = None

    @field_validator("alert_webhook_url")
    @classmethod
    def _webhook(cls, value: str | None) -> str | None:
        # Checked here, not at the first incident, whose alert it would lose. The value is
        # left out of the message: the URL is often the credential.
        if value == "":
            return None
        if value is not None and not value.lower().startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value

    # Rebalancer: move idle replicas between groups (False = only publish desired replicas).
    move_replicas: bool = True
    move_after_ticks: int = Field(3, ge=1)  # the move condition must hold this many ticks
    move_cooldown_s: float = Field(60.0, ge=0)  # no move out of a group/worker after a move
    default_min_replicas: int = Field(1, ge=0)
    min_replicas: dict[str, int] = Field(default_factory=dict)  # per group, overrides default
    max_replicas: int = Field(64, ge=1)
    # A replica counts as full at this share of its group's max batch (desired replicas).
    target_utilization: float = Field(0.8, gt=0, le=1)
    # Weight of the newest hour in the hour-of-week demand history (EWMA per slot).
    history_alpha: float = Field(0.5, gt=0, le=1)

    @model_validator(mode="after")
    def _renewal_beats_the_lease(self) -> SchedulerConfig:
        # A leader stops acting a margin before its lease expires (scheduler.lease): renewed
        # less often than that, it would skip ticks every cycle while still holding it.
        margin = min(0.5, self.lease_ttl_s / 4)
        if self.lease_renew_s >= self.lease_ttl_s - margin:
            raise ValueError(
                f"scheduler.lease_renew_s ({self.lease_renew_s:g}) must be under lease_ttl_s "
                f"less {margin:g} s ({self.lease_ttl_s - margin:g})"
            )
        return self


class LogConfig(_Strict):
    """Logging of every service (:mod:`common.logging`); flags override these."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"  # json in deployments: QOS_LOG__FORMAT=json
    # Prompts in debug logs: off unless asked for, and even then only at level debug.
    log_prompts: bool = False
    # The gateway's access log: one line per HTTP request (method, path, status, group, …).
    access_log: bool = True

    @field_validator("level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class Config(_Strict):
    """Everything a qosserve service reads, loaded once at start-up and passed down."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    groups: dict[str, GroupConfig] = Field(default_factory=default_groups)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    # Loaded with groups_replace_defaults (the file's or the environment's): the groups are
    # exactly those given, not the defaults plus them. Kept for `qosserve config --changed`.
    _replaces_default_groups: bool = PrivateAttr(False)

    @property
    def replaces_default_groups(self) -> bool:
        return self._replaces_default_groups

    @model_validator(mode="after")
    def _check_groups(self) -> Config:
        if not self.groups:
            raise ValueError("at least one instance group is required")
        for name, group in self.groups.items():
            bare = name.replace("-", "").replace("_", "")
            if not (bare.isascii() and bare.isalnum()):
                # A NATS token, and an HTTP header's value (X-QoS-Group is latin-1).
                raise ValueError(f"group name {name!r} must be ASCII letters, digits, - and _")
            if group.fallback is not None and group.fallback not in self.groups:
                raise ValueError(f"groups.{name}.fallback names unknown group {group.fallback!r}")
            if group.fallback == name:
                raise ValueError(f"groups.{name}.fallback cannot be the group itself")
        known = {d.strip().lower() for d in self.gateway.api_key_sha256}
        if self.gateway.cache_isolation == "api_key" and not known:
            raise ValueError(
                "gateway.cache_isolation is 'api_key' but no keys are configured "
                "(gateway.api_key_sha256): every request would share one namespace"
            )
        for digest, allowed in self.gateway.api_key_groups.items():
            if digest.strip().lower() not in known:
                raise ValueError(
                    f"gateway.api_key_groups: {digest[:12]}… is not in gateway.api_key_sha256"
                )
            unknown = sorted(set(allowed) - set(self.groups))
            if unknown or not allowed:
                raise ValueError(
                    f"gateway.api_key_groups.{digest[:12]}…: "
                    + (f"unknown groups {unknown}" if unknown else "names no group")
                )
        return self

    @model_validator(mode="after")
    def _check_timing(self) -> Config:
        """Intervals that only work together: each service reads the others' beats."""
        beat = self.worker.telemetry_interval_s
        if self.scheduler.worker_silent_s <= 2 * beat:
            raise ValueError(
                f"scheduler.worker_silent_s ({self.scheduler.worker_silent_s:g}) must exceed "
                f"twice worker.telemetry_interval_s ({beat:g}): workers would read as gone "
                "between their reports"
            )
        if self.worker.latency_window_s < beat:
            raise ValueError(
                f"worker.latency_window_s ({self.worker.latency_window_s:g}) must be at least "
                f"worker.telemetry_interval_s ({beat:g}): requests finished between two "
                "reports would reach no p99, and the breakers would not see them"
            )
        orphan, gw_beat = self.worker.orphan_after_s, self.gateway.heartbeat_interval_s
        if 0 < orphan < 3 * gw_beat:
            raise ValueError(
                f"worker.orphan_after_s ({orphan:g}) must be at least three "
                f"gateway.heartbeat_interval_s ({gw_beat:g}), or 0: live gateways' requests "
                "would be aborted as orphaned"
            )
        # A breaker judges samples younger than scheduler.window_s, and a group gets at most
        # one a tick, and with one replica one a report.
        most = self.scheduler.window_s / max(self.scheduler.tick_interval_s, beat)
        for name, group in self.groups.items():
            need = min(group.breaker.min_samples, group.breaker.window_samples)
            if need > most:
                raise ValueError(
                    f"groups.{name}.breaker.min_samples ({need}) can never be reached: "
                    f"scheduler.window_s ({self.scheduler.window_s:g} s) holds at most "
                    f"{most:g} samples at one per max(scheduler.tick_interval_s, "
                    "worker.telemetry_interval_s); the breaker could never open"
                )
        unknown = sorted(set(self.scheduler.min_replicas) - set(self.groups))
        if unknown:
            raise ValueError(f"scheduler.min_replicas names unknown groups {unknown}")
        return self

    def groups_by_rank(self) -> list[tuple[str, GroupConfig]]:
        """Groups from the first choice (lowest rank) to the last."""
        return sorted(self.groups.items(), key=lambda item: (item[1].rank, item[0]))


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``QOS_A__B=v`` → ``{"a": {"b": yaml(v)}}``; ``QOS_CONFIG`` names the file, not a key."""
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == "QOS_CONFIG":
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if any(not part for part in path):
            raise ConfigError(f"environment variable {name}: empty key segment")
        if path[-1] in SECRET_KEYS:
            value: Any = raw  # as given: "#x", "null" or "p: [" are passwords too
        elif _text_field(path):
            # A text setting as given: YAML read QOS_NATS__USER=123 as a number, "no" as
            # false, and refused it; null still unsets an optional one.
            optional = _text_field(path) == "optional"
            value = None if optional and raw.lower() in ("null", "~") else raw
        else:
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                # Not the parser's message: it quotes the value, which may be a secret.
                raise ConfigError(
                    f"environment variable {name}: not a valid YAML value (quote a string "
                    """as '\"...\"', write a list as '[a, b]')"""
                ) from None
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {name}: conflicts with another variable")
        key = path[-1]
        if isinstance(value, dict) and isinstance(node.get(key), dict):
            # A whole section after its keys' variables: merged, whatever the environment's
            # order (assigned, it dropped QOS_GROUPS__BATCH__RANK read before QOS_GROUPS__BATCH).
            node[key] = _deep_merge(value, node[key])
        elif key in node and isinstance(node[key], dict) != isinstance(value, dict):
            raise ConfigError(f"environment variable {name}: conflicts with another variable")
        else:
            node[key] = value
    return tree


def _text_field(path: list[str], model: Any = None) -> str | None:
    """ "text" or "optional" (``str | None``) when the config key at ``path`` holds a string;
    None for anything else or a path that names no field (the model then says so)."""
    model = Config if model is None else model
    fields = getattr(model, "model_fields", None)
    if not path or fields is None or path[0] not in fields:
        return None
    annotation = fields[path[0]].annotation
    if len(path) == 1:
        return "text" if annotation is str else "optional" if annotation == (str | None) else None
    if model is Config and path[0] == "groups":  # groups.<name>.<field>
        return _text_field(path[2:], GroupConfig)
    return _text_field(path[1:], annotation)


def _format_validation(
    exc: ValidationError, source: str, env: Mapping[str, str] | None = None
) -> str:
    """One line: each key, the variable that set it (when one did), what is wrong."""
    set_by = {name.upper(): name for name in env or {}}
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        # Our own checks say what they mean; pydantic prefixes them "Value error, ".
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        var = set_by.get(ENV_PREFIX + "__".join(str(p).upper() for p in err["loc"]))
        if var is not None:
            where += f" (set by {var})"
        problems.append(f"{where}: {msg}" if where else msg)
    return f"invalid configuration ({source}): " + "; ".join(problems)


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Defaults ← YAML file ← ``QOS_*`` environment. Raises :class:`ConfigError` naming the key."""
    env = os.environ if env is None else env
    path = path or env.get("QOS_CONFIG") or None
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: {file}")
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            # The problem and where, not the parser's snippet: that line may hold a secret.
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or "syntax error"
            raise ConfigError(f"config file {file}: not valid YAML{where}: {problem}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file}: the top level must be a mapping")
        data = loaded
        source = str(file)
    overrides = _env_overrides(env)
    if overrides:
        source += " + environment"
    # Groups named in the file or environment start from their defaults when they have them.
    defaults = {name: g.model_dump() for name, g in default_groups().items()}
    for given in (data.get("groups"), overrides.get("groups")):
        if given is not None and not isinstance(given, dict):
            raise ConfigError(
                f"invalid configuration ({source}): groups must be a mapping of group names "
                "to their settings"
            )
    groups_in = _deep_merge(data.get("groups") or {}, overrides.get("groups") or {})
    merged = _deep_merge(data, overrides)
    if "groups" in merged:
        # The flag from the environment too (QOS_GROUPS_REPLACE_DEFAULTS=true).
        base = defaults if not merged.get("groups_replace_defaults") else {}
        merged["groups"] = _deep_merge(base, groups_in)
    replaces = bool(merged.pop("groups_replace_defaults", None))
    try:
        config = Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source, env)) from None
    config._replaces_default_groups = replaces
    return config


def with_settings(config: Config, source: str, **sections: dict[str, Any]) -> Config:
    """``config`` with ``sections`` set (``worker={"device": "cpu"}``), checked as a file's
    values are: a bad command-line flag is one line naming it, not a traceback."""
    data = config.model_dump()
    for section, values in sections.items():
        if values:
            data[section] = {**data[section], **values}
    try:
        updated = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source)) from None
    updated._replaces_default_groups = config.replaces_default_groups
    return updated


def changed_settings(config: Config) -> dict[str, Any]:
    """What a file and the environment set, as a mapping that loads back into ``config``:
    unset keys left out, and a default group only with the keys that differ from its
    defaults (a file naming one of its keys had printed all three groups in full)."""
    dump = config.model_dump(mode="json", exclude_unset=True)
    if "groups" not in dump:
        return dump
    if config.replaces_default_groups:
        return {"groups_replace_defaults": True, **dump}
    defaults = {name: g.model_dump(mode="json") for name, g in default_groups().items()}
    groups = {}
    for name, group in config.groups.items():
        full = group.model_dump(mode="json")
        differs = full if name not in defaults else _differences(full, defaults[name])
        if differs:
            groups[name] = differs
    if groups:
        dump["groups"] = groups
    else:
        del dump["groups"]
    return dump


def _differences(value: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(base.get(key), dict):
            nested = _differences(item, base[key])
            if nested:
                out[key] = nested
        elif base.get(key) != item:
            out[key] = item
    return out
