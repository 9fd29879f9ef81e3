"""The OTLP span exporter ``init_tracing`` uses: :mod:`common.otlp_encode`'s bytes, sent.

The SDK's OTLP exporters spend most of their time building protobuf objects (issue #7);
this one encodes the batch directly and sends the bytes, over gRPC (a unary call on
``TraceService/Export`` with the request already serialised) or HTTP/protobuf (a POST to
``…/v1/traces``). It reads the ``OTEL_EXPORTER_OTLP_[TRACES_]*`` variables the SDK's
exporters read (endpoint, headers, timeout, compression, insecure, certificate, client
key and certificate) and retries as they do: transient failures (gRPC UNAVAILABLE and
kin, HTTP 429/502/503/504, a refused or broken connection) again after 1, 2, 4 … s with
jitter, or the server's own delay, never past the export timeout. A batch that still
fails is dropped, logged and counted; nothing raises into the batch processor.
"""

from __future__ import annotations

import gzip
import http.client
import logging
import random
import ssl
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

from common.otlp_encode import SpanEncoder

log = logging.getLogger(__name__)

GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
USER_AGENT = "qosserve-otlp-exporter"
MAX_ATTEMPTS = 6
RETRY_HTTP_STATUS = frozenset((429, 502, 503, 504))
RETRY_GRPC_CODES = frozenset(("CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED",
                              "OUT_OF_RANGE", "UNAVAILABLE", "DATA_LOSS"))  # fmt: skip


@dataclass(frozen=True)
class OtlpSettings:
    """Where and how to send spans, from the ``OTEL_EXPORTER_OTLP_*`` variables."""

    protocol: str  # "grpc" or "http/protobuf"
    endpoint: str  # gRPC: the host:port target; HTTP: the full URL
    insecure: bool = False  # gRPC only: plaintext (HTTP follows the URL's scheme)
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0
    compression: str | None = None  # "gzip" (both), "deflate" (HTTP)
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], protocol: str) -> OtlpSettings:
        """The SDK's reading of the variables: ``…_TRACES_X`` before ``…_X``; gRPC
        endpoints are plaintext for ``http://`` unless ``…_INSECURE`` says otherwise; an
        HTTP base endpoint gets ``/v1/traces`` appended, a traces endpoint is used as is;
        the timeout is in seconds (as the Python SDK reads it), or milliseconds (as the spec
        and the other SDKs write it) when over 60."""

        def var(name: str) -> str | None:
            value = env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(
                f"OTEL_EXPORTER_OTLP_{name}"
            )
            return value.strip() if value else None

        signal, base = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        )
        insecure_var = var("INSECURE")
        if protocol == "grpc":
            url = (signal or base or "http://localhost:4317").strip()
            parsed = urlsplit(url)
            if parsed.scheme == "https":
                insecure = False
            elif insecure_var is not None:
                insecure = insecure_var.lower() == "true"
            else:
                insecure = parsed.scheme == "http"
            endpoint = parsed.netloc or url
        else:
            insecure = False
            if signal:
                endpoint = signal.strip()
            else:
                endpoint = (base or "http://localhost:4318").strip().rstrip("/") + "/v1/traces"
            target = urlsplit(endpoint)
            if target.scheme not in ("http", "https") or not target.hostname:
                raise ValueError(f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r}: not an http(s) URL")
        compression = (var("COMPRESSION") or "none").lower()
        if compression not in ("none", "gzip", "deflate") or (
            compression == "deflate" and protocol == "grpc"
        ):
            raise ValueError(f"OTEL_EXPORTER_OTLP_COMPRESSION={compression!r} ({protocol})")
        headers = parse_env_headers(var("HEADERS") or "", liberal=True)
        return cls(
            protocol=protocol,
            endpoint=endpoint,
            insecure=insecure,
            headers=tuple(headers.items()),
            timeout_s=_timeout_s(var("TIMEOUT")),
            compression=None if compression == "none" else compression,
            certificate=var("CERTIFICATE"),
            client_key=var("CLIENT_KEY"),
            client_certificate=var("CLIENT_CERTIFICATE"),
        )


def _timeout_s(raw: str | None) -> float:
    """``OTEL_EXPORTER_OTLP_TIMEOUT``: seconds for the Python SDK, milliseconds for the spec
    and every other SDK. A config shared with them says 10000 for 10 s, which read as seconds
    let one stalled export hold the export thread for hours, and 1000 (1 s) for 17 minutes:
    above 60 it is milliseconds (no export waits a minute, none is given 60 ms)."""
    try:
        value = float(raw) if raw else 10.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TIMEOUT={raw!r}: must be a positive number")
    return value / 1000 if value > 60 else value


@dataclass(frozen=True)
class Sent:
    """One attempt's outcome: delivered, or why not and whether to try again (after
    ``retry_after`` seconds when the server said so)."""

    ok: bool
    retryable: bool = False
    detail: str = ""
    retry_after: float | None = None


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        log.error("OTLP exporter: cannot read %s: %s", path, exc)
        return None


class GrpcTransport:
    """``TraceService/Export`` with a pre-encoded request: the method is called with no
    serialiser, so the bytes go out as they are; the reply is not decoded."""

    def __init__(self, settings: OtlpSettings) -> None:
        import grpc

        self.settings = settings
        self._grpc = grpc
        self._channel: Any = None
        self._call: Any = None
        self._connect()

    def _connect(self) -> None:
        grpc, s = self._grpc, self.settings
        options = [("grpc.primary_user_agent", USER_AGENT)]
        compression = grpc.Compression.Gzip if s.compression == "gzip" else None
        if s.insecure:
            self._channel = grpc.insecure_channel(s.endpoint, options, compression)
        else:
            credentials = grpc.ssl_channel_credentials(
                _read(s.certificate), _read(s.client_key), _read(s.client_certificate)
            )
            self._channel = grpc.secure_channel(s.endpoint, credentials, options, compression)
        self._call = self._channel.unary_unary(GRPC_METHOD)

    def send(self, body: bytes, timeout: float) -> Sent:
        grpc = self._grpc
        try:
            self._call(body, timeout=timeout, metadata=self.settings.headers or None)
            return Sent(True)
        except grpc.RpcError as error:
            code = error.code()
            if code is grpc.StatusCode.UNAVAILABLE:
                # A fresh channel: the old one may sit in its reconnect backoff (up to
                # minutes), failing every call at once, long after the collector is back.
                self.close()
                self._connect()
            return Sent(
                False, code.name in RETRY_GRPC_CODES, f"{code.name}: {error.details()}",
                _grpc_retry_delay(error),
            )  # fmt: skip

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


def _grpc_retry_delay(error: Any) -> float | None:
    """The delay a server asked for in ``google.rpc.RetryInfo``, if it did."""
    try:
        from google.rpc.error_details_pb2 import RetryInfo

        raw = dict(error.trailing_metadata() or ()).get("google.rpc.retryinfo-bin")
        if raw is None:
            return None
        info = RetryInfo.FromString(raw)
        return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    except Exception:  # a malformed hint is no reason to fail the export
        return None


class HttpTransport:
    """A POST of ``application/x-protobuf`` on one kept-alive connection (reopened after
    any error)."""

    def __init__(self, settings: OtlpSettings) -> None:
        self.settings = settings
        url = urlsplit(settings.endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"OTLP/HTTP endpoint {settings.endpoint!r}: not an http(s) URL")
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._context: ssl.SSLContext | None = None
        if self._https:
            self._context = ssl.create_default_context(cafile=settings.certificate)
            if settings.client_certificate:
                self._context.load_cert_chain(settings.client_certificate, settings.client_key)
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": USER_AGENT,
            **dict(settings.headers),
        }
        if settings.compression:
            self._headers["Content-Encoding"] = settings.compression
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=timeout, context=self._context
                )
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        self._conn.timeout = timeout
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout)
        return self._conn

    def send(self, body: bytes, timeout: float) -> Sent:
        if self.settings.compression == "gzip":
            body = gzip.compress(body)
        elif self.settings.compression == "deflate":
            body = zlib.compress(body)
        try:
            conn = self._connection(timeout)
            conn.request("POST", self._path, body, self._headers)
            response = conn.getresponse()
            reply = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return Sent(False, True, f"{type(exc).__name__}: {exc}")
        if 200 <= response.status < 300:
            return Sent(True)
        if response.will_close:
            self.close()
        retry_after = response.getheader("Retry-After")
        return Sent(
            False,
            response.status in RETRY_HTTP_STATUS,
            f"HTTP {response.status}: {reply[:200]!r}",
            float(retry_after) if retry_after and retry_after.isdigit() else None,
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class OtlpSpanExporter(SpanExporter):
    """A ``SpanExporter`` for the batch processor: encodes with :class:`SpanEncoder`,
    sends with the protocol's transport, retries transient failures within the timeout.

    ``exported_spans``, ``failed_spans``, ``failed_batches`` and ``retries`` count what
    happened (read by tests and logs; the processor only sees success or failure)."""

    reads_phases = True  # the encoder writes a recorded span's phases (SpanBatch asks)

    def __init__(self, settings: OtlpSettings, *, backoff_s: float = 1.0) -> None:
        self.settings = settings
        self.backoff_s = backoff_s
        self._transport: GrpcTransport | HttpTransport = (
            GrpcTransport(settings) if settings.protocol == "grpc" else HttpTransport(settings)
        )
        self._encoder = SpanEncoder()
        self._lock = threading.Lock()  # the processor exports from one thread at a time
        self._closed = threading.Event()
        self.exported_spans = self.failed_spans = self.failed_batches = self.retries = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed.is_set() or not spans:
            return SpanExportResult.FAILURE if spans else SpanExportResult.SUCCESS
        with self._lock:
            try:
                body = self._encoder.encode(spans)
                sent = self._send(body)
            except Exception as exc:  # an exporter's bug must not reach the processor
                log.exception("OTLP export failed")
                sent = Sent(False, detail=repr(exc))
            if sent.ok:
                self.exported_spans += len(spans)
                return SpanExportResult.SUCCESS
            self.failed_spans += len(spans)
            self.failed_batches += 1
        log.error(
            "OTLP export to %s failed, %d spans dropped: %s",
            self.settings.endpoint, len(spans), sent.detail,
        )  # fmt: skip
        return SpanExportResult.FAILURE

    def _send(self, body: bytes) -> Sent:
        """Send ``body``, retrying transient failures with exponential backoff and jitter
        until ``MAX_ATTEMPTS`` or the timeout, whichever comes first (or shutdown)."""
        deadline = time.monotonic() + self.settings.timeout_s
        sent = Sent(False, detail="timed out")
        if self._closed.is_set():
            return Sent(False, detail="the exporter is shutting down")
        for attempt in range(MAX_ATTEMPTS):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sent = self._transport.send(body, left)
            if sent.ok or not sent.retryable or attempt + 1 == MAX_ATTEMPTS:
                break
            delay = sent.retry_after
            if delay is None:
                delay = self.backoff_s * 2**attempt * random.uniform(0.8, 1.2)
            if time.monotonic() + delay >= deadline:
                break
            log.warning(
                "OTLP export to %s: %s; retrying in %.2f s",
                self.settings.endpoint, sent.detail, delay,
            )  # fmt: skip
            self.retries += 1
            if self._closed.wait(delay):
                break
        return sent

    def stop_retrying(self) -> None:
        """From now on nothing is sent (the send in flight ends within its timeout):
        the processor's shutdown ran out of time."""
        self._closed.set()

    def shutdown(self) -> None:
        self._closed.set()
        with self._lock:
            self._transport.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered here: the processor holds the queue
