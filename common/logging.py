"""Log set-up for every service: text for people, JSON lines for machines.

``--log-format text`` (the default, what ``qosserve up`` writes) reads like
``2025-01-01 12:00:01,234 INFO gateway.app: … [req=chatcmpl-… trace=4bf9…]``; ``--log-format json`` (for
deployments, ``QOS_LOG__FORMAT=json``) writes one object a line::

    {"ts": "2025-01-01T12:00:01.234Z", "level": "info", "logger": "qosserve.access",
     "service": "gateway", "msg": "POST /v1/chat/completions 200 12.5ms", "request_id": "chatcmpl-…",
     "trace_id": "4bf9…", "span_id": "00f0…", "status": 200, "duration_ms": 12.5, …}

``request_id`` comes from :func:`bind_request` (the gateway binds it when it names a request,
a worker when it fetches one; a context variable, so it follows the request's task and no
other); ``trace_id``/``span_id`` from the current OpenTelemetry span, or else from the ids
bound with :func:`bind_trace` (our tracer's path, where no span is current). Structured
fields ride
in ``extra={"fields": {...}}``.

Prompts and secrets stay out: nothing here logs a body, credentials in URLs and bearer
tokens are masked in every message, and :func:`prompts_loggable` is true only with
``--log-level debug`` *and* ``--log-prompts`` (``log.log_prompts``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from contextvars import ContextVar, Token
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace

from common.config import LogConfig

# The request a log line is about, in the task handling it (see bind_request).
_REQUEST_ID: ContextVar[str | None] = ContextVar("qos_request_id", default=None)
# A span's (trace id, span id) bound without an OpenTelemetry context (see bind_trace).
_TRACE: ContextVar[tuple[int, int] | None] = ContextVar("qos_trace", default=None)

# Any userinfo: user:password, :password (redis://:pw@h) and a lone token (nats://tok@h).
_URL_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+")
# redis-py also reads a password from the query (redis://h/0?password=...).
_QUERY_SECRET = re.compile(r"(?i)([?&](?:password|passwd|pass|token|secret)=)[^&\s#]*")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Control characters in a text line's message and fields are shown escaped: a value a
# client chose (a percent-decoded path in the access log) could otherwise end the line and
# forge the next one. Tracebacks keep their lines.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160)) if c != 9} | {
    10: "\\n",
    13: "\\r",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def bind_request(request_id: str | None) -> None:
    """Tag the log lines of the current task (and tasks it starts) with ``request_id``."""
    _REQUEST_ID.set(request_id)


def bound_request() -> str | None:
    """The request id :func:`bind_request` set in this context, if any."""
    return _REQUEST_ID.get()


def about(request_id: str, span: tuple[int, int] | None = None) -> dict[str, Any]:
    """``extra=`` of a log line about one request, written outside the task bound to it
    (the engine's output, a tick, a control): its ``request_id`` field all the same, and
    its span's ``trace_id``/``span_id`` when given, so the line joins its trace."""
    fields: dict[str, Any] = {"request_id": request_id}
    if span is not None:
        fields["trace_id"] = format(span[0], "032x")
        fields["span_id"] = format(span[1], "016x")
    return {"fields": fields}


def bind_trace(trace_id: int, span_id: int) -> Token[tuple[int, int] | None]:
    """Tag the current task's log lines with a span that is not an OpenTelemetry one yet (a
    request recorded as plain values: ``gateway.tracing``, ``workers.tracing``); a current
    OpenTelemetry span, where there is one, wins. The token undoes it (:func:`unbind_trace`)."""
    return _TRACE.set((trace_id, span_id))


def unbind_trace(token: Token[tuple[int, int] | None] | None) -> None:
    """Undo a :func:`bind_trace` (None: nothing to undo)."""
    if token is not None:
        _TRACE.reset(token)


def redact_url(url: str) -> str:
    """``nats://user:secret@host`` → ``nats://user:***@host``, ``redis://:pw@h`` →
    ``redis://***@h``: a URL fit for logs and errors; each of a comma-separated list
    (``nats.url``'s cluster seeds: read as one URL, the second's password went through)."""
    if url.count("://") > 1 and "," in url:
        return ",".join(redact_url(part) for part in url.split(","))
    url = _QUERY_SECRET.sub(r"\1***", url)
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    # A lone token (``nats://token@host``) is a secret too.
    shown = userinfo.split(":", 1)[0] + ":***" if ":" in userinfo else "***"
    return urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))


def redact(message: str) -> str:
    """``message`` with URL credentials and bearer tokens masked."""
    if "://" in message:
        message = _URL_CREDENTIALS.sub(r"\1***@", message)
        message = _QUERY_SECRET.sub(r"\1***", message)
    if "bearer" in message.lower():  # the scheme's case is free
        message = _BEARER.sub(r"\1***", message)
    return message


def context_fields() -> dict[str, str]:
    """``request_id``, ``trace_id`` and ``span_id`` of the current context, where known."""
    fields: dict[str, str] = {}
    request_id = _REQUEST_ID.get()
    if request_id:
        fields["request_id"] = request_id
    ctx = trace.get_current_span().get_span_context()
    ids = (ctx.trace_id, ctx.span_id) if ctx.is_valid else _TRACE.get()
    if ids is not None:
        fields["trace_id"] = format(ids[0], "032x")
        fields["span_id"] = format(ids[1], "016x")
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for the keys)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "service": self.service,
            "msg": redact(record.getMessage()),
        }
        out.update(context_fields())
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """The classic line, then ``key=value`` fields and ``[req=… trace=…]`` when known."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_CONTROLS)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = redact(super().format(record))
        extra = getattr(record, "fields", None)
        ctx = context_fields()
        if isinstance(extra, dict) and extra:
            if "request_id" in extra or "trace_id" in extra:  # tags, as a bound request's
                extra = dict(extra)
                for key in ("request_id", "trace_id"):
                    if key in extra:
                        ctx[key] = str(extra.pop(key))
                extra.pop("span_id", None)  # text lines name the trace only
            if extra:
                line += " " + " ".join(
                    f"{k}={str(v).translate(_CONTROLS)}" for k, v in extra.items()
                )
        tags = [f"req={ctx['request_id']}"] if "request_id" in ctx else []
        if "trace_id" in ctx:
            tags.append(f"trace={ctx['trace_id']}")
        return f"{line} [{' '.join(tags)}]" if tags else line


def setup_logging(service: str, config: LogConfig, stream: IO[str] | None = None) -> None:
    """Route every logger (uvicorn's too) through one handler in ``config``'s format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(service) if config.format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def prompts_loggable(config: LogConfig) -> bool:
    """Whether prompts may be logged: only at debug level and only when asked for."""
    return config.log_prompts and config.level.lower() == "debug"


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, ``--log-format`` and ``--log-prompts`` (defaults from ``log.*``)."""
    parser.add_argument(
        "--log-level", type=str.lower, choices=("debug", "info", "warning", "error"),
        help="default log.level (info)",
    )  # fmt: skip
    parser.add_argument("--log-format", choices=("text", "json"), help="default log.format (text)")
    parser.add_argument(
        "--log-prompts", action="store_true", default=None,
        help="with --log-level debug, log prompts (never by default)",
    )  # fmt: skip


def log_config_from(config: LogConfig, args: argparse.Namespace) -> LogConfig:
    """``config`` with the flags that were given applied."""
    update = {
        key: value
        for key, value in (
            ("level", args.log_level),
            ("format", args.log_format),
            ("log_prompts", args.log_prompts),
        )
        if value is not None
    }
    return config.model_copy(update=update) if update else config
