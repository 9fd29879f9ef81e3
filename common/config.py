"""One typed configuration object for every service.

Defaults come from DESIGN §3 (the field study's instance groups). A YAML file (``--config``
or ``QOS_CONFIG``) overrides them, then ``QOS_*`` environment variables override that:
``QOS_NATS__URL=nats://h:4222`` sets ``nats.url``; ``QOS_GROUPS__SHORT__MAX_BATCH=8`` sets
``groups.short.max_batch``. Values in variables are parsed as YAML (scalars, or flow lists and maps
such as ``[a, b]``). An unknown key
or a bad value fails at start-up with a :class:`ConfigError` naming it.
"""

from __future__ import annotations

import math
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
# deploy/k8s/components/secure/secret.example.yaml's value for every secret: a public
# password, refused wherever a secret is read (else one left in place went unnoticed).
SECRET_PLACEHOLDER = "REPLACE-ME"


def _not_the_placeholder(value: str | None) -> str | None:
    if value is not None and value.strip().upper() == SECRET_PLACEHOLDER:
        # The message leaves the value out, as for any secret.
        raise ValueError(
            "is still the example Secret's placeholder: set a real secret "
            "(deploy/k8s/README.md, Secure mode)"
        )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BreakerConfig(_Strict):
    """Per-group circuit breaker (field study: 10 samples, mean p99 > 500 ms → open, cap 4)."""

    window_samples: int = Field(
        10,
        ge=1,
        description=(
            "How many of the group's latest samples (one per scheduler tick in which it "
            "reported) the breaker averages while closed. Raise it to make the breaker slower "
            "to open and less jumpy on one bad burst."
        ),
    )
    min_samples: int = Field(
        5,
        ge=1,
        description=(
            "The breaker opens on latency only once its window holds at least this many samples "
            "(capped at window_samples). Must be reachable within scheduler.window_s; lower it "
            "to react sooner after a gap or restart."
        ),
    )
    p99_threshold_ms: float = Field(
        500.0,
        gt=0,
        description=(
            "Latency limit in milliseconds: the breaker opens when the mean of the window's "
            "p99s exceeds it. The group's SLO of the watched kind (p99_kind) is used instead "
            "when higher, so this only matters for groups with a lower SLO."
        ),
    )
    error_rate_threshold: float = Field(
        0.2,
        gt=0,
        le=1,
        description=(
            "The breaker also opens when more than this share (0-1) of the window's finished "
            "requests failed. Lower it to trip sooner on errors."
        ),
    )
    open_batch_cap: int = Field(
        4,
        ge=1,
        description=(
            "While the breaker is open or half-open, the group's workers run at most this many "
            "requests per batch (or max_batch if smaller), to bring latency back down."
        ),
    )
    wait_open_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Seconds the breaker stays open before it turns half-open and probes the group with "
            "part of its traffic. Raise it to give a struggling group longer to recover."
        ),
    )
    max_wait_open_s: float = Field(
        120.0,
        gt=0,
        description=(
            "Longest the breaker stays open. Each time it re-opens soon after opening (a "
            "probe failed, or it closed less than this long ago) its wait doubles from "
            "wait_open_s up to this, so a group that only fails at full load is not flipped "
            "every few seconds (and its alerts with it)."
        ),
    )
    max_half_open_s: float = Field(
        180.0,
        gt=0,
        description=(
            "Longest the breaker stays half-open undecided (its probes never came: no "
            "traffic). Then it is judged on every probe of the spell: closed when their "
            "error rate is within error_rate_threshold (none at all counts as healthy), "
            "re-opened otherwise. Keep it over the requests' deadline (120 s by default), "
            "so probes that run to it are counted; never shorter than the workers' latency "
            "window."
        ),
    )
    half_open_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description=(
            "Share (0-1) of the group's traffic the gateways still send it while its breaker is "
            "half-open; the rest goes down the fallback chain."
        ),
    )
    close_after_healthy: int = Field(
        3,
        ge=1,
        description=(
            "Healthy samples in a row (a probe succeeded and p99 was under the threshold) that "
            "close a half-open breaker. Raise it to demand more proof before full traffic "
            "returns."
        ),
    )
    # Which latency the breaker watches; its threshold is never below the group's SLO of
    # that kind (slo_e2e_p99_ms / slo_ttft_ms): a group meeting its SLO is healthy. "e2e"
    # also sees a hung group (requests running, none finishing); with "ttft" a hung group
    # reports no first tokens at all, and only its error rate (deadline errors) trips it.
    p99_kind: Literal["e2e", "ttft"] = Field(
        "e2e",
        description=(
            "Which latency the breaker watches: e2e (whole request, also catches a hung group) "
            "or ttft (time to first token). Its threshold is never below the group's SLO of "
            "that kind."
        ),
    )
    # The error rate is judged only over at least this many finished requests.
    min_requests: int = Field(
        10,
        ge=1,
        description=(
            "The error rate is judged only over at least this many finished requests, so a few "
            "failures at low traffic do not open the breaker."
        ),
    )
    error_window_s: float = Field(
        60.0,
        gt=0,
        description=(
            "How far back the error rate may reach for min_requests finished requests when "
            "the latency window (a few seconds) holds fewer: a group at 1 req/s that fails "
            "every request then opens within about min_requests seconds instead of never."
        ),
    )


class GroupConfig(_Strict):
    """An instance group: its limits, SLOs, policy and fallback."""

    max_batch: int = Field(
        ge=1,
        description=(
            "Most requests one worker of this group runs at once (its batch size). Larger "
            "raises throughput and latency; an open breaker lowers it to "
            "breaker.open_batch_cap."
        ),
    )
    max_seq_len: int = Field(
        ge=16,
        description=(
            "Longest sequence (prompt plus generated tokens) the group accepts, in tokens. "
            "Requests naming no group go to the lowest-rank group that holds them; workers that "
            "hold less lower the limit."
        ),
    )
    slo_ttft_ms: float = Field(
        gt=0,
        description=(
            "Target p99 time to first token, in milliseconds. With breaker.p99_kind ttft, the "
            "breaker threshold is never below it and the rebalancer adds replicas while the "
            "group misses it with work queued."
        ),
    )
    slo_e2e_p99_ms: float = Field(
        gt=0,
        description=(
            "Target p99 end-to-end request latency, in milliseconds. With breaker.p99_kind e2e "
            "(the default), the breaker threshold is never below it and the rebalancer adds "
            "replicas while the group misses it with work queued."
        ),
    )
    policy: Policy = Field(
        "hybrid",
        description=(
            "How the group's engine batches: static (fixed batches), dynamic (batches wait to "
            "fill), continuous (requests join and leave every step) or hybrid (continuous plus "
            "chunked prefill)."
        ),
    )
    # continuous/hybrid: while requests run, new ones wait up to this many times the last
    # admitting step's duration (10 ms at most) so that they prefill together (EngineArgs;
    # 0 = never wait).
    prefill_delay_factor: float = Field(
        0.0,
        ge=0,
        le=100,
        description=(
            "continuous/hybrid only: while requests run, new ones wait up to this many times "
            "the last admitting step's duration (10 ms at most) so they prefill together. 0 = "
            "admit at once; 1 pays for hybrid on a GPU."
        ),
    )
    priority_preemption: bool = Field(
        True,
        description=(
            "hybrid only: a waiting request more urgent (lower priority value) than running "
            "ones, kept out by max_batch or KV blocks, preempts the least urgent of them. "
            "false = it waits for a free slot, as in vLLM."
        ),
    )
    # 0: strict priority (vLLM's): a steady stream of urgent requests holds less urgent ones
    # back for as long as it lasts.
    priority_aging_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description=(
            "hybrid only: seconds of waiting worth one priority level; a request that arrived "
            "this much earlier than one a level more urgent goes first, so no priority "
            "starves. 0 = strict priority, as in vLLM."
        ),
    )
    # Queued + running requests the gateway admits before it sheds with 429.
    max_pending: int = Field(
        64,
        ge=1,
        description=(
            "Most queued plus running requests of this group that one gateway admits; beyond it "
            "clients get 429 with Retry-After. Scale it with the group's capacity."
        ),
    )
    fallback: str | None = Field(
        None,
        description=(
            "Group that takes this group's requests when its breaker is open (or half-open and "
            "not its turn) or it has no live worker. Unset = none; must name another configured "
            "group."
        ),
    )
    # Lower routes first when the classifier has a choice.
    rank: int = Field(
        0,
        description=(
            "Routing order: a request naming no group goes to the lowest-rank group whose "
            "max_seq_len holds it (batch-size-1 groups only when named explicitly)."
        ),
    )
    breaker: BreakerConfig = Field(
        default_factory=BreakerConfig,
        description=("This group's circuit breaker (groups.<name>.breaker.*)."),
    )


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

    url: str = Field(
        "nats://127.0.0.1:4222",
        description=(
            "NATS server URL (nats://, tls://, ws:// or wss://); several comma-separated for a "
            "cluster's seeds, tried in turn. Credentials in it are never printed."
        ),
    )
    user: str | None = Field(
        None,
        description=("User name for NATS user/password authentication; unset = none."),
    )
    password: str | None = Field(
        None,
        description=(
            "Password of nats.user. A secret: set it by QOS_NATS__PASSWORD rather than in a "
            "file; never printed."
        ),
    )
    token: str | None = Field(
        None,
        description=(
            "NATS authentication token (instead of user/password). A secret; never printed."
        ),
    )
    creds_file: str | None = Field(
        None,
        description=(
            "Path to a NATS .creds file (JWT plus nkey seed) for operator/account authentication."
        ),
    )
    nkey_seed_file: str | None = Field(
        None,
        description=("Path to an nkey seed file for NATS nkey authentication."),
    )
    tls_ca_file: str | None = Field(
        None,
        description=(
            "CA certificate (PEM) that verifies the NATS server's certificate; set it for TLS "
            "with a private CA."
        ),
    )
    tls_cert_file: str | None = Field(
        None,
        description=(
            "Client certificate (PEM) for a NATS server that requires mutual TLS; set together "
            "with tls_key_file."
        ),
    )
    tls_key_file: str | None = Field(
        None,
        description=("Private key (PEM) of nats.tls_cert_file."),
    )
    # TLS before any NATS byte (the server's tls { handshake_first: true }): without it the
    # client upgrades only when the server's INFO asks, which a man in the middle can strip.
    tls_handshake_first: bool = Field(
        False,
        description=(
            "Start TLS before any NATS byte; needs the server's tls { handshake_first: true }. "
            "Turn on over untrusted networks: otherwise TLS starts only when the server asks, "
            "which an attacker can strip."
        ),
    )
    # Where replies to this connection arrive (pulled requests, JetStream API answers).
    # Unset: _INBOX_<service> (gateway, worker, scheduler), so deploy/nats/permissions.conf
    # can keep each service out of the others' replies, which carry prompts.
    inbox_prefix: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$",
        description=(
            "Subject prefix of this connection's replies. Unset = _INBOX_<service> (gateway, "
            "worker, scheduler), as deploy/nats/permissions.conf expects; change only together "
            "with the NATS permissions."
        ),
    )

    _secrets_set = field_validator("password", "token")(_not_the_placeholder)

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

    subject_prefix: str = Field(
        "qos",
        pattern=r"^[A-Za-z0-9_-]+$",
        description=(
            "First token of every qosserve subject (<prefix>.req.<group>, <prefix>.tel.>, ...). "
            "Change it, with stream and kv_bucket, to run several deployments on one NATS."
        ),
    )
    stream: str = Field(
        "QOS_REQ",
        pattern=r"^[A-Za-z0-9_-]+$",
        description=(
            "Name of the JetStream stream that queues requests (a work queue, one subject per "
            "group)."
        ),
    )
    kv_bucket: str = Field(
        "qos_state",
        pattern=r"^[A-Za-z0-9_-]+$",
        description=(
            "Name of the JetStream key-value bucket holding shared state: breaker states, the "
            "scheduler lease, desired replicas, demand history."
        ),
    )
    # Copies JetStream keeps of the request stream and the state bucket when it creates them:
    # 3 on a 3-node cluster survives losing a server (1 = a single server's data). Existing
    # ones keep theirs (a warning says when they differ).
    replicas: int = Field(
        1,
        ge=1,
        le=5,
        description=(
            "Copies JetStream keeps of the request stream and state bucket when it creates "
            "them: 3 on a 3-node cluster survives losing a server. Existing ones keep theirs."
        ),
    )
    ack_wait_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Seconds JetStream waits for a worker's progress signal before redelivering a "
            "request to another replica (workers signal every third of it). Lower = faster "
            "recovery from a dead worker."
        ),
    )
    max_deliver: int = Field(
        5,
        ge=1,
        description=(
            "Deliveries of one request before JetStream gives up on it (each failed delivery is "
            "a worker dying on it); the client then gets an error at once."
        ),
    )
    duplicate_window_s: float = Field(
        120.0,
        gt=0,
        description=(
            "Seconds JetStream remembers request ids, so a publish retried within it is stored "
            "once."
        ),
    )
    max_payload_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description=(
            "Largest NATS message, in bytes, that qosserve sends or accepts (a request with its "
            "prompt tokens, a report); also the stream's message limit. The NATS server's "
            "max_payload (default 1 MiB) must allow big prompts too."
        ),
    )
    connect_timeout_s: float = Field(
        5.0,
        gt=0,
        description=(
            "Seconds to wait for a NATS connection; a service that cannot connect at start-up "
            "within it exits with an error."
        ),
    )
    reconnect_wait_s: float = Field(
        0.5,
        gt=0,
        description=("Seconds between reconnect attempts after the NATS link drops."),
    )
    max_reconnect_attempts: int = Field(  # -1 = forever: services outlive a NATS restart
        -1,
        description=(
            "Reconnect attempts before a service gives up and exits for its supervisor to "
            "restart it; -1 = forever, so services outlive a NATS restart."
        ),
    )
    # A link that dies without a close (a powered-off node, a partition dropping packets)
    # shows only as pongs that stop: declared dead after this many pings unanswered, ~15-20 s
    # (nats-py's defaults, 120 s and 2, kept a gateway answering 200 for four minutes).
    ping_interval_s: float = Field(
        5.0,
        gt=0,
        description=(
            "Seconds between pings to the NATS server. With max_outstanding_pings it sets how "
            "soon a silently dead link (powered-off node, partition) is noticed: about 15-20 s "
            "by default."
        ),
    )
    max_outstanding_pings: int = Field(
        3,
        ge=1,
        description=(
            "Unanswered pings after which the NATS link is declared dead and reconnected."
        ),
    )

    @property
    def servers(self) -> list[str]:
        """``url`` as a server list: a cluster's seeds, comma-separated, tried in turn."""
        return _split_urls(self.url)

    def plain_websocket_tls(self) -> str | None:
        """Why these TLS settings cannot hold (a ws:// URL with nats.tls_* set), or None.

        nats-py never starts TLS on a ws:// link, whatever the server asks: the settings
        would be ignored and credentials sent in clear. Also checked at connect time (a
        ``model_copy(update=...)`` skips the validator)."""
        keys = [key for key in _NATS_TLS_KEYS if getattr(self, key)]
        if keys and any(url.startswith("ws://") for url in self.servers):
            return (
                f"nats.{', nats.'.join(keys)} set with a ws:// URL, which never uses TLS "
                "(credentials would go in clear): use wss:// URLs"
            )
        return None

    @model_validator(mode="after")
    def _tls_needs_wss(self) -> NatsConfig:
        reason = self.plain_websocket_tls()
        if reason is not None:
            raise ValueError(reason)
        return self


_NATS_TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_handshake_first")


def _split_urls(value: str) -> list[str]:
    return [url.strip() for url in value.split(",") if url.strip()]


# What a Redis URL may hold: both the tier's clients read these and nothing else.
_REDIS_URL_PARTS = {"host", "port", "db", "username", "password", "path", "connection_class"}


class RedisConfig(_Strict):
    """The shared cold KV tier."""

    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description=(
            "Redis server of the shared KV cache tier: redis://, rediss:// (TLS) or unix://, "
            "database number in the path. Credentials in it are never printed; URL query "
            "options are refused (use the redis.* keys)."
        ),
    )
    username: str | None = Field(
        None,
        description=("Redis ACL user name; unset = the default user."),
    )
    password: str | None = Field(
        None,
        description=(
            "Redis password (AUTH). A secret: set it by QOS_REDIS__PASSWORD rather than in a "
            "file; never printed."
        ),
    )
    tls_ca_file: str | None = Field(
        None,
        description=("CA certificate (PEM) that verifies the Redis server; needs a rediss:// URL."),
    )
    # A client certificate, for a server that asks for one (redis-server's TLS default,
    # tls-auth-clients yes, refuses every client without); both or neither.
    tls_cert_file: str | None = Field(
        None,
        description=(
            "Client certificate (PEM) for a Redis server that requires one (tls-auth-clients "
            "yes); set together with tls_key_file, needs a rediss:// URL."
        ),
    )
    tls_key_file: str | None = Field(
        None,
        description=("Private key (PEM) of redis.tls_cert_file."),
    )
    max_connections: int = Field(
        16,
        ge=1,
        description=(
            "Most connections each worker opens to Redis, split between lookups, loads and "
            "stores (3 at least; the KV tier uses 7 at most: 4 loading, 2 storing, 1 looking "
            "up). Size Redis's maxclients from it times the workers."
        ),
    )
    ttl_s: int = Field(
        3600,
        ge=1,
        description=(
            "Seconds a KV block stays in Redis after it was last written or hit. Raise it to "
            "keep prefixes warm through quiet hours; lower it to save Redis memory."
        ),
    )
    socket_timeout_s: float = Field(
        0.5,
        gt=0,
        description=(
            "Seconds a Redis connect or command may take before it counts as failed (the KV is "
            "then recomputed). Raise it on slow or remote links."
        ),
    )
    # A prefix load from Redis slower than this (GB/s, plus one socket timeout) is given up:
    # the engine's batch waits for it, and recomputing is faster (loopback: ~2 GB/s).
    load_min_gbps: float = Field(
        0.25,
        gt=0,
        description=(
            "A prefix load from Redis slower than this rate (GB/s, plus one socket timeout) is "
            "given up and recomputed, since the batch waits for it. Lower it on slow networks "
            "where loading still beats recomputing."
        ),
    )
    # A secret every worker shares: KV values in Redis are then authenticated (a keyed
    # blake2b), so one who can write to Redis but lacks it cannot plant KV under a prompt's
    # key. Set it wherever Redis is not private to the workers.
    kv_mac_secret: str | None = Field(  # empty: a mistake, not "off"
        None,
        min_length=16,
        description=(
            "Shared secret (16+ characters) with which workers authenticate KV values in Redis, "
            "so whoever can write to Redis cannot plant KV for a prompt. Set it wherever Redis "
            "is not private to the workers; never printed."
        ),
    )

    _password_set = field_validator("password", "kv_mac_secret")(_not_the_placeholder)

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
    host: str = Field(
        "127.0.0.1",
        description=(
            "Address the gateway's HTTP server listens on; 0.0.0.0 accepts connections from "
            "other machines."
        ),
    )
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description=("TCP port of the gateway's HTTP (OpenAI-compatible) API."),
    )
    # sha256 hex digests of accepted API keys; empty = open (a warning is logged at start).
    api_key_sha256: list[str] = Field(
        default_factory=list,
        description=(
            "SHA-256 hex digests of the accepted API keys (never the keys themselves). Empty = "
            "anyone may call the API (a warning is logged at start-up)."
        ),
    )
    # Per key (its digest): the name its requests, tokens and refusals are counted under in
    # the qos_gateway_key_* metrics (a team's, for chargeback); unnamed keys are counted
    # under their digest's first 8 hex digits.
    api_key_names: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Per key digest: the name the qos_gateway_key_* metrics count its requests, tokens "
            "and refusals under (1-64 of A-Z a-z 0-9 . _ -). Unnamed keys: their digest's "
            "first 8 hex digits. Each digest must be in api_key_sha256."
        ),
    )
    # Per key (its digest): the instance groups it may use, by name or by length routing,
    # fallbacks included (another team's key kept off realtime, say). A key not listed may
    # use every group.
    api_key_groups: dict[str, list[str]] = Field(
        default_factory=dict,
        description=(
            "Per key digest: the instance groups that key may use, fallbacks included (e.g. "
            "keep a team's key off realtime). Keys not listed may use every group; each digest "
            "must be in api_key_sha256."
        ),
    )
    # Per key (its digest): the most urgent priority its requests may ask for (lower is
    # served first, and a running request of a less urgent one is the preemption victim).
    # A key not listed may ask for any.
    api_key_min_priority: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "Per key digest: the most urgent (lowest) priority that key's requests may ask for; "
            "one asking for less gets 403 priority_not_allowed. Keys not listed may ask for any "
            "priority; each digest must be in api_key_sha256."
        ),
    )
    # Per API key: sustained requests/s and burst (a token bucket each); 0 = unlimited.
    # A key over its rate gets 429 rate_limit_exceeded with Retry-After.
    api_key_rate_limit_rps: float = Field(
        0.0,
        ge=0,
        description=(
            "Sustained requests per second each API key may send to one gateway process; beyond "
            "it, 429 with Retry-After. 0 = unlimited."
        ),
    )
    api_key_rate_limit_burst: int = Field(  # 0 = one second's worth (at least 1)
        0,
        ge=0,
        description=(
            "Requests an API key may send at once above its rate (its token bucket's size); 0 = "
            "one second's worth, at least 1."
        ),
    )
    # Per API key: requests (a response's choices and prompts each count) it may have in
    # flight through one gateway at once; 0 = no cap. The rate limit bounds arrivals
    # only: one key's long streams, or a batch of 64 prompts x n=4, filled a group's
    # max_pending and every other team got 429s until they finished.
    api_key_max_in_flight: int = Field(
        0,
        ge=0,
        description=(
            "Requests (each choice and prompt of a response counts) one API key may have in "
            "flight through one gateway process at once; beyond it, 429 with Retry-After. "
            "0 = no cap."
        ),
    )
    # OpenAI pads every streamed chunk by default; vLLM does not. A chunk per decode step
    # tells a passive observer of the TLS traffic each token's length without it.
    stream_obfuscation: bool = Field(
        False,
        description=(
            "Pad streamed chunks with a random 'obfuscation' field (OpenAI's "
            "stream_options.include_obfuscation) when a request does not say: hides token "
            "lengths from whoever sees the encrypted traffic, for ~64 bytes a chunk."
        ),
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description=(
            "Largest HTTP request body the gateway accepts, in bytes; a larger one is refused (413)."
        ),
    )
    max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        description=(
            "Largest HTTP request head (request line and headers) the gateway reads, in bytes; "
            "a larger one gets 431 and the connection is closed, before the API key is checked."
        ),
    )
    header_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Seconds a connection may take to send a request's headers (from its opening, or "
            "from its previous response's end); past it, 408 and the connection is closed."
        ),
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "Seconds a request's body may take to arrive (at most the request's deadline); past "
            "it, 408. Bounds clients that trickle a body to hold a handler."
        ),
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description=(
            "Open HTTP connections (streams included) one gateway process serves at once; a "
            "request arriving beyond it gets 503. Raise with the process's file limit."
        ),
    )
    default_deadline_ms: int = Field(
        120_000,
        ge=100,
        # The request stream keeps a message 25 h (max_age): a longer deadline outlived it.
        le=24 * 3600 * 1000,
        description=(
            "Deadline in milliseconds for a request that sets none; the request is stopped when "
            "it passes. Raise it for long generations."
        ),
    )
    default_max_tokens: int = Field(
        256,
        ge=1,
        description=(
            "Tokens to generate for a request that sets no max_tokens; routing also counts it "
            "when choosing a group whose max_seq_len fits."
        ),
    )
    # Sampling fields a request leaves out: "model" takes the model folder's
    # generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty),
    # as transformers and vLLM do; "openai": OpenAI's neutral ones (1.0, 1.0, off...).
    sampling_defaults: Literal["model", "openai"] = Field(
        "model",
        description=(
            "Sampling values for fields a request leaves out: model takes the model folder's "
            "generation_config.json (as transformers and vLLM do); openai takes OpenAI's "
            "neutral ones (temperature 1, top_p 1, ...)."
        ),
    )
    # Refuse (400) chat messages whose text holds a special token's text (<|eot_id|>...):
    # tokenized as the token, as transformers does, it lets a user close their turn and
    # write a system one. Off by default, as in transformers and vLLM.
    reject_control_tokens: bool = Field(
        False,
        description=(
            "Refuse (400) chat messages whose text contains a special token's text such as "
            "<|eot_id|>, which lets a user fake a turn. Off, as in transformers and vLLM; turn "
            "on for untrusted users."
        ),
    )
    # How a chat answer's tool calls are read: "hermes" (<tool_call>{json}</tool_call>, the
    # format of Qwen 2.5/3 and Hermes models), "llama3_json" (Llama 3.1-3.3's JSON answer),
    # "mistral" ([TOOL_CALLS] and a JSON list), "auto" (the one the chat template writes),
    # "none" (tools refused with a 400).
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "none"] = Field(
        "auto",
        description=(
            "How tool calls are read from chat answers: auto = the format the model's chat "
            "template writes (hermes for <tool_call> tags: Qwen 2.5/3, Hermes; llama3_json "
            "for <|python_tag|>: Llama 3.1-3.3; mistral for [TOOL_CALLS]: Mistral 7B v0.3, "
            "Nemo), else tools are refused; hermes, llama3_json or mistral = that one; "
            "none = tools are refused (400)."
        ),
    )
    # How a chat answer's thinking is told from its content (gateway/reasoning.py).
    reasoning_parser: Literal["auto", "deepseek_r1", "qwen3", "none"] = Field(
        "auto",
        description=(
            "How a chat answer's <think>...</think> is returned apart from its content, as "
            "message.reasoning_content (streamed: delta.reasoning_content): auto = when the "
            "model's chat template knows </think> (DeepSeek-R1 and its distills, Qwen3), the "
            "prompt's end saying whether the answer starts inside its thinking; qwen3 = "
            "always so; deepseek_r1 = always, every answer starting inside its thinking; "
            "none = the answer is content as written."
        ),
    )
    # "shared": every request may reuse every cached prompt prefix (system prompts, RAG
    # documents: the cheap path). "api_key": each key's requests reuse only their own key's
    # prefixes, on the workers and in the Redis tier, so no team can tell from a fast first
    # token what another team sent. A request's cache_salt narrows either further.
    cache_isolation: Literal["shared", "api_key"] = Field(
        "shared",
        description=(
            "Who may reuse cached prompt prefixes: shared = every request (cheapest); api_key = "
            "only the same key's requests, on workers and in Redis, so no team learns another's "
            "prompts from timing. api_key needs api_key_sha256."
        ),
    )
    # On SIGTERM: streams still open this long after are ended with a 503 / an error event
    # the client can act on (a second before the server would cut them); the long group's
    # documents take their time, so give its SLO. Kubernetes' grace period must exceed it.
    shutdown_grace_s: float = Field(
        30.0,
        ge=1.0,
        description=(
            "Seconds after SIGTERM that open streams may still run before they are ended with a "
            "503 or an error event. Give it the long group's SLO; Kubernetes' termination grace "
            "period must exceed it."
        ),
    )
    # Origins browsers may call the API from (CORS; ["*"] for any); empty = no CORS headers.
    cors_allow_origins: list[str] = Field(
        default_factory=list,
        description=(
            "Origins browsers may call the API from (CORS), e.g. https://app.example.com, or * "
            "for any. Empty = no CORS headers."
        ),
    )
    served_model_name: str | None = Field(
        None,
        description=(
            "Model name clients send and /v1/models reports; unset = the model folder's name."
        ),
    )
    # Published on qos.gw.<gateway id> so workers can tell a dead gateway's requests
    # (nobody will read their answers) from live ones; see worker.orphan_after_s.
    heartbeat_interval_s: float = Field(
        1.0,
        gt=0,
        description=(
            "Seconds between the gateway's heartbeats on NATS, by which workers tell a dead "
            "gateway's requests from live ones (see worker.orphan_after_s)."
        ),
    )
    # How often the gateway checks that the request stream and the group consumers still
    # exist, and recreates them if not (gateway/stream_keeper.py).
    jetstream_check_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Seconds between the gateway's checks that the request stream and the group "
            "consumers exist; missing ones are recreated."
        ),
    )

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
    model: str = Field(
        "demo",
        description=(
            "Model to serve: a Hugging Face model folder, dummy:<shape> (random weights of a "
            "known shape) or demo (the bundled tiny model)."
        ),
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description=(
            "Where the engine runs: auto (a GPU if there is one, else the CPU), cpu, cuda or "
            "cuda:N."
        ),
    )
    dtype: Literal["auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16"] = Field(
        "auto",
        description=(
            "Weight and compute dtype. auto = the checkpoint's 16-bit dtype on a GPU (fp32 "
            "checkpoints in bf16) and fp32 on a CPU."
        ),
    )
    # KV cache size. None = sized for the device: 0.5 GiB on a CPU; on a GPU what is left of
    # this worker's share of the GPU (gpu_memory_utilization) once a profile forward has
    # measured the weights and activations, as vLLM does.
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description=(
            "KV cache size in GiB. Unset = sized for the device: 0.5 GiB on a CPU; on a GPU "
            "what the weights and a profile run leave of gpu_memory_utilization. Set it to pin "
            "the size."
        ),
    )
    # This worker's share of its GPU's memory (weights, activations and KV), vLLM's
    # per-instance meaning: workers sharing one GPU each take a part (`qosserve up` divides
    # 0.9 among the workers it starts on one device).
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "Share (0-1) of its GPU's memory this worker may use for weights, activations and "
            "KV cache. Workers sharing one GPU must split it (qosserve up does)."
        ),
    )
    # KV cache storage: auto = the model dtype; int8 / fp8_e4m3 halve KV memory (one scale per
    # token per KV head). On the demo model int8 changes 2-4 % of greedy golden answers and
    # fp8 8-10 % (bench/kvquant.py; README "Status"): prefer int8 where memory binds.
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = Field(
        "auto",
        description=(
            "How the KV cache is stored: auto = the model dtype; int8 or fp8_e4m3 halve KV "
            "memory at some accuracy cost (int8 is the gentler). Use int8 where memory binds."
        ),
    )
    telemetry_interval_s: float = Field(
        1.0,
        ge=0.01,  # under it, a busy loop of reports
        description=(
            "Seconds between the worker's telemetry reports (load, latency, batch cap) to the "
            "scheduler and gateways. scheduler.worker_silent_s must exceed twice it."
        ),
    )
    # Latency percentiles in telemetry cover requests finished in the last this-many seconds.
    latency_window_s: float = Field(
        3.0,
        gt=0,
        description=(
            "Latency percentiles in telemetry cover requests finished in the last this-many "
            "seconds; at least telemetry_interval_s."
        ),
    )
    coalesce_ms: float = Field(
        5.0,
        ge=0,
        description=(
            "Streaming: after the first token, chunks go out at most every this-many "
            "milliseconds. Higher = fewer messages, burstier streams; 0 = every token at once."
        ),
    )
    metrics_port: int = Field(  # 0 = pick a free one
        0,
        ge=0,
        le=65535,
        description=("Port of the worker's Prometheus /metrics server; 0 = a free port (logged)."),
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description=(
            "Address the worker's /metrics and /livez server listens on; 0.0.0.0 lets "
            "Prometheus and probes on other machines reach it (compose and the Kubernetes "
            "config set it)."
        ),
    )
    # KV tiers below the device cache (DESIGN §5): host memory (G2) and the shared Redis
    # (G3, at redis.url). Off by default so a lone worker never waits on a Redis that is
    # not there; `qosserve up`, compose and Kubernetes switch the Redis tier on.
    kv_host_cache_gib: float = Field(
        0.0,
        ge=0,
        description=(
            "Size in GiB of the host-memory KV tier (G2) below the device cache; 0 = off. Set "
            "it so prefixes evicted from the device are copied back instead of recomputed."
        ),
    )
    kv_redis: bool = Field(
        False,
        description=(
            "Use the shared Redis KV tier (G3, at redis.url) so workers reuse each other's "
            "prompt prefixes. Off so a lone worker never waits on a missing Redis; qosserve up, "
            "compose and Kubernetes turn it on."
        ),
    )
    # blake2b catches any corruption; crc32 is ~3x cheaper and the block hash in each
    # value's header already ties it to its key.
    kv_checksum: Literal["blake2b", "crc32"] = Field(
        "crc32",
        description=(
            "Checksum on KV values in the tiers: crc32 (about 3x cheaper) or blake2b (catches "
            "any corruption)."
        ),
    )
    # A request whose gateway has sent no heartbeat for this long is aborted: its client's
    # connection died with the gateway, so the rest of the generation would be wasted.
    # 0 = never (requests then run to their deadline). Not counted while this worker
    # itself is cut off from NATS. Requests without an origin (NATS clients) never are.
    orphan_after_s: float = Field(
        10.0,
        ge=0,
        description=(
            "Abort a request whose gateway has sent no heartbeat for this many seconds (its "
            "client is gone with it). 0 = never; otherwise at least three "
            "gateway.heartbeat_interval_s."
        ),
    )


class SchedulerConfig(_Strict):
    worker_silent_s: float = Field(
        3.0,
        gt=0,
        description=(
            "Seconds without a report after which a worker counts as gone. Must exceed twice "
            "worker.telemetry_interval_s."
        ),
    )
    rebalance_interval_s: float = Field(
        5.0,
        gt=0,
        description=(
            "Seconds between rebalancer runs (desired replicas, replica moves, demand history)."
        ),
    )
    metrics_port: int = Field(  # 0 = no /metrics server
        9300,
        ge=0,
        le=65535,
        description=("Port of the scheduler's Prometheus /metrics server; 0 = none."),
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description=(
            "Address the scheduler's /metrics and /livez server listens on; 0.0.0.0 lets "
            "Prometheus and probes on other machines reach it (compose and the Kubernetes "
            "config set it)."
        ),
    )
    # Breakers are sampled and evaluated every tick: a transition acts within one tick.
    tick_interval_s: float = Field(
        0.5,
        ge=0.01,  # under it, a busy loop of breaker judgements
        description=(
            "Seconds between scheduler ticks. Breakers are sampled and judged every tick, so a "
            "transition acts within one."
        ),
    )
    # Per-group telemetry windows (metrics, rebalancer): the last N group samples of T seconds;
    # a breaker judges none of its samples older than T either.
    window_samples: int = Field(
        20,
        ge=1,
        description=(
            "Per-group telemetry window (metrics, rebalancer): the last this-many group samples."
        ),
    )
    window_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Per-group telemetry window: samples older than this many seconds are dropped, by "
            "the breakers too."
        ),
    )
    # Leader lease `sched.lease` in the state bucket: renewed every renew_s, stale after ttl_s.
    lease_ttl_s: float = Field(
        3.0,
        gt=0,
        description=(
            "Seconds the leader's lease stays valid; a standby scheduler takes over this long "
            "after the leader stops renewing it."
        ),
    )
    lease_renew_s: float = Field(
        1.0,
        gt=0,
        description=(
            "Seconds between the leader's lease renewals; under lease_ttl_s less a margin (a "
            "quarter of the TTL, at most 0.5 s)."
        ),
    )
    # Breaker transitions are POSTed here as JSON (in a thread, never blocking), when set.
    alert_webhook_url: str | None = Field(
        None,
        description=(
            "http(s) URL that breaker transitions are POSTed to as JSON (e.g. a chat or "
            "Alertmanager webhook); unset = no alerts. Treated as a secret; never printed."
        ),
    )

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
    move_replicas: bool = Field(
        True,
        description=(
            "Let the rebalancer move idle replicas between groups. false = only publish desired "
            "replicas (for an autoscaler)."
        ),
    )
    move_after_ticks: int = Field(  # the move condition must hold this many ticks
        3,
        ge=1,
        description=(
            "Rebalancer runs in a row the same move must win before it is made, so flapping "
            "load moves nothing."
        ),
    )
    move_cooldown_s: float = Field(  # no move out of a group/worker after a move
        60.0,
        ge=0,
        description=(
            "Seconds after a replica move during which neither group gives up a replica and the "
            "moved worker stays put. Raise it if replicas ping-pong between groups."
        ),
    )
    default_min_replicas: int = Field(
        1,
        ge=0,
        description=(
            "Fewest replicas the rebalancer keeps in each group, unless min_replicas names the "
            "group."
        ),
    )
    min_replicas: dict[str, int] = Field(  # per group, overrides default
        default_factory=dict,
        description=(
            "Per-group minimum replicas, overriding default_min_replicas (e.g. {realtime: 2})."
        ),
    )
    max_replicas: int = Field(
        64,
        ge=1,
        description=("Most replicas the rebalancer asks for in one group (caps desired replicas)."),
    )
    # A replica counts as full at this share of its group's max batch (desired replicas).
    target_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description=(
            "Share (0-1) of max_batch at which a replica counts as full when sizing desired "
            "replicas. Lower = more headroom, more replicas."
        ),
    )
    # Weight of the newest hour in the hour-of-week demand history (EWMA per slot).
    history_alpha: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "Weight (0-1) of the latest week when the hour-of-week demand history updates a "
            "slot (an EWMA). Higher = adapts faster, forgets older weeks sooner."
        ),
    )

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

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description=("Log level of every service: debug, info, warning or error."),
    )
    format: Literal["text", "json"] = Field(  # json in deployments: QOS_LOG__FORMAT=json
        "text",
        description=(
            "Log line format: text for people, json for log collectors (use json in deployments)."
        ),
    )
    # Prompts in debug logs: off unless asked for, and even then only at level debug.
    log_prompts: bool = Field(
        False,
        description=(
            "Include prompts in logs, at level debug only. Off: prompts may hold private data."
        ),
    )
    # The gateway's access log: one line per HTTP request (method, path, status, group, …).
    access_log: bool = Field(
        True,
        description=(
            "The gateway's access log: one line per HTTP request (method, path, status, group, "
            "...)."
        ),
    )

    @field_validator("level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class Config(_Strict):
    """Everything a qosserve service reads, loaded once at start-up and passed down."""

    nats: NatsConfig = Field(
        default_factory=NatsConfig,
        description=("NATS: connection, credentials and TLS, JetStream names and limits."),
    )
    redis: RedisConfig = Field(
        default_factory=RedisConfig,
        description=("The shared Redis KV cache tier (used by workers with worker.kv_redis)."),
    )
    groups: dict[str, GroupConfig] = Field(
        default_factory=default_groups,
        description=(
            "Instance groups by name, each with its limits, SLOs, batching policy, fallback and "
            "breaker. Groups a file names merge into the defaults unless "
            "groups_replace_defaults: true."
        ),
    )
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig,
        description=("The HTTP gateway: listening address, API keys, request limits and defaults."),
    )
    worker: WorkerConfig = Field(
        default_factory=WorkerConfig,
        description=("Each worker replica: model, device, KV cache and its tiers, telemetry."),
    )
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description=(
            "The scheduler: breaker ticks, telemetry windows, rebalancing, leader lease, alerts."
        ),
    )
    log: LogConfig = Field(
        default_factory=LogConfig,
        description=("Logging of every service; command-line flags override these."),
    )
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
            if not (bare.isascii() and bare.isalnum()) or len(name) > 128:
                # A NATS token, and an HTTP header's value (X-QoS-Group is latin-1).
                raise ValueError(
                    f"group name {name[:40]!r} must be 1-128 ASCII letters, digits, - and _"
                )
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
        for digest in self.gateway.api_key_min_priority:
            if digest.strip().lower() not in known:
                raise ValueError(
                    f"gateway.api_key_min_priority: {digest[:12]}… is not in gateway.api_key_sha256"
                )
        names = self.gateway.api_key_names
        for digest, name in names.items():
            if digest.strip().lower() not in known:
                raise ValueError(
                    f"gateway.api_key_names: {digest[:12]}… is not in gateway.api_key_sha256"
                )
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(
                    f"gateway.api_key_names.{digest[:12]}…: {name[:40]!r} must be 1-64 of "
                    "A-Z a-z 0-9 . _ -"
                )
        # Unnamed keys go by their digest's first 8 hex digits: no two labels may meet.
        named = {d.strip().lower() for d in names}
        labels = [*names.values(), *(d[:8] for d in known - named)]
        if len(set(labels)) < len(labels):
            raise ValueError(
                "gateway.api_key_names: two keys would share a label in the metrics (a name "
                "given twice, or equal to an unnamed key's first 8 hex digits)"
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
        # A breaker judges samples younger than scheduler.window_s. A group gets at most one
        # a tick, and none sooner than 0.9 reports after the last (scheduler.windows): so
        # one every whole number of ticks that spans 0.9 reports (ticks of 0.7 s and
        # reports of 1 s give one every 1.4 s, not every 1 s).
        tick = self.scheduler.tick_interval_s
        most = self.scheduler.window_s / (tick * max(1, math.ceil(0.9 * beat / tick - 1e-9)))
        for name, group in self.groups.items():
            need = min(group.breaker.min_samples, group.breaker.window_samples)
            if need > most:
                raise ValueError(
                    f"groups.{name}.breaker.min_samples ({need}) can never be reached: "
                    f"scheduler.window_s ({self.scheduler.window_s:g} s) holds at most "
                    f"{most:g} samples at one per the whole number of "
                    "scheduler.tick_interval_s that spans 0.9 worker.telemetry_interval_s; "
                    "the breaker could never open"
                )
        unknown = sorted(set(self.scheduler.min_replicas) - set(self.groups))
        if unknown:
            raise ValueError(f"scheduler.min_replicas names unknown groups {unknown}")
        negative = {g: n for g, n in self.scheduler.min_replicas.items() if n < 0}
        if negative:
            raise ValueError(f"scheduler.min_replicas must be 0 or more: {negative}")
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
        if file.exists() and not file.is_file():
            raise ConfigError(f"config file {file}: not a file")
        if not file.is_file():
            raise ConfigError(f"config file not found: {file}")
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:  # unreadable, or UTF-16 from PowerShell
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise ConfigError(
                f"config file {file}: cannot read it ({reason}); it must be UTF-8 YAML"
            ) from None
        try:
            loaded = yaml.safe_load(text) or {}
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
    flag = merged.get("groups_replace_defaults")
    if flag is not None and not isinstance(flag, bool):  # "false" is truthy: it replaced them
        raise ConfigError(
            f"invalid configuration ({source}): groups_replace_defaults must be true or "
            f"false, not {flag!r}"[:300]
        )
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
