"""Logs: JSON lines with request and trace ids, the gateway's access log, no prompts or secrets."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from common.config import Config, LogConfig
from common.logging import (
    JsonFormatter,
    TextFormatter,
    about,
    bind_request,
    bind_trace,
    redact,
    redact_url,
    setup_logging,
)
from common.protocol import GenerateRequest
from gateway import app as gateway_app
from tests.gateway.conftest import serve
from tests.observability.conftest import MODEL, StartWorker, Traced, wait_live
from workers.observe import Watch, about_flight
from workers.outbox import Flight
from workers.sim import SimCost
from workers.tracing import Delivery

SECRET_PROMPT = "SECRET-PROMPT-7f3a"


@pytest.fixture
def access_lines() -> Iterator[io.StringIO]:
    """JSON lines of the ``qosserve.access`` logger, formatted as they are written."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("gateway"))
    logger = logging.getLogger("qosserve.access")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_a_json_line_in_a_request_context_has_the_request_and_trace_ids(traced: Traced) -> None:
    formatter = JsonFormatter("worker")
    tracer = traced.provider.get_tracer("test")

    def in_request() -> dict[str, object]:
        bind_request("chatcmpl-abc")
        with tracer.start_as_current_span("work") as span:
            record = logging.LogRecord("workers.service", logging.INFO, __file__, 1,
                                       "request %s: %d tokens", ("chatcmpl-abc", 7), None)  # fmt: skip
            record.fields = {"group": "short"}
            line = json.loads(formatter.format(record))
            assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
            return line

    line = contextvars.copy_context().run(in_request)  # the request id stays in that context
    assert line["request_id"] == "chatcmpl-abc" and line["group"] == "short"
    assert line["msg"] == "request chatcmpl-abc: 7 tokens"
    assert (line["level"], line["logger"], line["service"]) == ("info", "workers.service", "worker")
    assert line["ts"].endswith("Z")
    outside = logging.LogRecord("x", logging.INFO, __file__, 1, "idle", (), None)
    assert "request_id" not in json.loads(formatter.format(outside))
    assert "trace_id" not in json.loads(formatter.format(outside))


def test_a_worker_delivery_bound_as_plain_ids_tags_its_lines_unless_a_span_is_current(
    traced: Traced,
) -> None:
    """A worker's delivery is no OpenTelemetry span until the export thread builds it; its
    ids, bound to the task, still reach the log lines (a current span wins)."""
    formatter = JsonFormatter("worker")
    record = logging.LogRecord("workers.service", logging.INFO, __file__, 1, "x", (), None)

    def in_delivery() -> tuple[dict[str, object], dict[str, object]]:
        bind_trace(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7)
        bound = json.loads(formatter.format(record))
        with traced.provider.get_tracer("test").start_as_current_span("work") as span:
            current = json.loads(formatter.format(record))
            assert current["trace_id"] == format(span.get_span_context().trace_id, "032x")
        return bound, current

    bound, current = contextvars.copy_context().run(in_delivery)
    assert bound["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert bound["span_id"] == "00f067aa0ba902b7"
    assert current["span_id"] != bound["span_id"]
    assert "trace_id" not in json.loads(formatter.format(record))  # only in that task


def test_a_worker_without_a_span_for_a_delivery_logs_the_callers_trace_id() -> None:
    """Tracing off in the worker (or the request sampled out): its log lines carried no
    trace id, and logs joined by trace id missed the worker's part of most requests."""
    from common.protocol import RequestParams
    from workers.observe import WorkerObserver
    from workers.outbox import Flight

    observer = WorkerObserver(worker_id="w0", model="m", view=lambda: None, tracer=None,
                              registry=CollectorRegistry(), gpus=False)  # fmt: skip
    parent = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-00"
    msg = types.SimpleNamespace(subject="qos.req.short", headers={"traceparent": parent})
    req = GenerateRequest(id="cmpl-log", group="short", reply="r", prompt_token_ids=[1],
                          params=RequestParams(max_tokens=1))  # fmt: skip
    record = logging.LogRecord("workers.service", logging.INFO, __file__, 1, "x", (), None)

    def fetched() -> dict[str, object]:
        observer.fetched(Flight(req, msg, 1, 1000.0), msg, "short")
        return json.loads(JsonFormatter("worker").format(record))

    line = contextvars.copy_context().run(fetched)
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["request_id"] == "cmpl-log"


def test_a_line_about_a_request_outside_its_task_carries_its_id() -> None:
    """The worker's lines from its engine-output handler, its tick and its controls run in
    no request's task: their JSON had no request_id to search by."""
    logger = logging.getLogger("test.about")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    logger.addHandler(keep)
    try:
        contextvars.Context().run(
            logger.warning, "request %s: publishing a chunk failed", "r-1", extra=about("r-1")
        )
    finally:
        logger.removeHandler(keep)
    (record,) = records
    line = json.loads(JsonFormatter("worker").format(record))
    assert line["request_id"] == "r-1"
    text = TextFormatter().format(record)
    assert text.endswith("[req=r-1]") and "request_id=" not in text


def test_a_line_about_a_sampled_flight_outside_its_task_joins_its_trace() -> None:
    """After admission the worker logs from its output pump and tick, in no request's task:
    those lines (a deadline stuck in the engine, a gateway gone silent) named the request
    but not its trace, so a trace view could not show why its request ended."""
    req = GenerateRequest(id="chatcmpl-9", group="short", reply="qos.r.x")
    st = Flight(req, msg=None, attempt=1, start=0.0)
    assert about_flight(st) == about("chatcmpl-9")  # not observed: the id alone
    delivery = Delivery(req, None, 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7,
                        group="short", attempt=1, subject="qos.req.short", fetched_at=0.0)  # fmt: skip
    st.watch = Watch("short", None, 0.0, span=delivery)  # type: ignore[arg-type]
    record = logging.LogRecord("workers.service", logging.WARNING, __file__, 1,
                               "request %s: gateway silent", ("chatcmpl-9",), None)  # fmt: skip
    record.fields = about_flight(st)["fields"]
    line = contextvars.Context().run(JsonFormatter("worker").format, record)
    fields = json.loads(line)
    assert fields["request_id"] == "chatcmpl-9"
    assert fields["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert fields["span_id"] == "00f067aa0ba902b7"
    text = contextvars.Context().run(TextFormatter().format, record)
    assert text.endswith("[req=chatcmpl-9 trace=4bf92f3577b34da6a3ce929d0e0e4736]"), text
    assert "span_id=" not in text and "trace_id=" not in text


def test_credentials_and_bearer_tokens_are_masked_in_every_format() -> None:
    message = (
        "connect nats://qos:hunter2@nats:4222 failed; header Authorization: Bearer sk-live-123; "
        "redis://:redispw@redis:6379/0 and nats://natstoken@nats:4222"
    )
    masked = redact(message)
    for secret in ("hunter2", "sk-live-123", "redispw", "natstoken"):
        assert secret not in masked, masked
    assert "nats://***@nats:4222" in masked and "Bearer ***" in masked
    assert "redis://***@redis:6379/0" in masked
    assert redact_url("redis://:redispw@redis:6379/0") == "redis://:***@redis:6379/0"
    # redis-py logs in with a password from the query string too
    assert redact_url("redis://redis:6379/0?password=qpw&db=1") == (
        "redis://redis:6379/0?password=***&db=1"
    )
    assert "qpw" not in redact("tier at redis://redis/0?db=1&Password=qpw down")
    assert "sk-up" not in redact("AUTHORIZATION: BEARER sk-up")  # the scheme's case is free
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "%s", (message,), None)
    assert "hunter2" not in JsonFormatter("gw").format(record)
    assert "hunter2" not in TextFormatter().format(record)


def test_a_text_line_cannot_be_ended_by_a_value_a_client_chose() -> None:
    """A percent-decoded path such as ``/x%0a... WARNING gateway.auth ...`` forged a second
    line in the text access log, before any API key check."""
    path = (
        "/v1/models/x\n2026-01-01 00:00:00,000 WARNING gateway.auth: incorrect API key\r\x85\u2028"
    )
    record = logging.LogRecord(
        "qosserve.access", logging.INFO, __file__, 1, "%s %s %d", ("GET", path, 404), None
    )
    record.fields = {"path": path, "status": 404}
    line = TextFormatter().format(record)
    assert "\n" not in line and "\r" not in line and len(line.splitlines()) == 1
    assert "x\\n2026-01-01" in line and "path=/v1/models/x\\n2026" in line
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "Traceback" in TextFormatter().format(failed).splitlines()[1]  # tracebacks keep lines


def test_setup_logging_writes_json_lines_for_every_logger() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out = io.StringIO()
    try:
        setup_logging("scheduler", LogConfig(format="json", level="warning"), stream=out)
        logging.getLogger("scheduler.service").warning("breaker %s opened", "short")
        logging.getLogger("uvicorn.error").info("not at warning level")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["service"], line["msg"]) for line in lines] == [
        ("scheduler", "breaker short opened")
    ]


async def test_the_access_log_has_method_path_status_group_duration_and_request_id(
    config: Config, start_worker: StartWorker, traced: Traced, access_lines: io.StringIO
) -> None:
    await start_worker("w-log")
    async with (
        serve(config, tracer_provider=traced.provider) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await wait_live(http, "short")
        ok = await http.post(
            "/v1/short/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        bad = await http.post("/v1/short/completions", json={"model": MODEL, "top_p": 7})
        # The client's trace, sampled out (flag 00): nothing recorded, the trace id logged.
        unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        out = await http.post(
            "/v1/short/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"traceparent": unsampled},
        )  # fmt: skip
    lines = [json.loads(line) for line in access_lines.getvalue().splitlines()]
    posts = [line for line in lines if line["method"] == "POST"]
    assert [line["status"] for line in posts] == [ok.status_code, bad.status_code, 200] == [
        200, 400, out.status_code
    ]  # fmt: skip
    assert posts[2]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    first = posts[0]
    assert first["path"] == "/v1/short/completions" and first["group"] == "short"
    assert first["request_id"] == ok.headers["x-request-id"]
    assert first["duration_ms"] > 0
    assert len(first["trace_id"]) == 32  # the server span's, so logs and traces join
    assert posts[1]["group"] == "-" and posts[1]["request_id"] == "-"  # refused before routing
    assert not [line for line in lines if line["path"] == "/health"]  # probes: debug only


async def test_a_request_the_client_left_before_its_first_token_is_logged_with_its_id(
    config: Config, start_worker: StartWorker, access_lines: io.StringIO
) -> None:
    """Its 499 carried no X-Request-Id and the access line wrote "-" over the id the
    request was bound to: the one line an operator greps for a hang-up named no request."""
    await start_worker("w-hangup", cost=SimCost(base_s=5.0, prefill_s_per_token=0.0,
                                                decode_s_per_seq=0.0))  # fmt: skip
    async with serve(config) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await wait_live(http, "short")
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(base_url=gw.url, timeout=0.5) as quick:
                await quick.post(
                    "/v1/short/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not (lines := [json.loads(x) for x in access_lines.getvalue().splitlines()
                             if '"status":499' in x]):  # fmt: skip
            assert loop.time() < deadline, access_lines.getvalue()
            await asyncio.sleep(0.05)
    (line,) = lines
    assert line["request_id"].startswith("cmpl-") and line["group"] == "short"


async def test_an_unhandled_error_is_logged_once_under_the_requests_trace(
    config: Config, traced: Traced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's 500 handler runs outside the middleware that binds the trace id: the
    traceback, the line that matters most, was the one line a trace could not find."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("gateway"))
    root = logging.getLogger()
    root.addHandler(handler)

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway_app, "tokenize", broken)
    try:
        async with (
            serve(config, tracer_provider=traced.provider) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            answer = await http.post("/v1/tokenize", json={"model": MODEL, "prompt": "hi"})
    finally:
        root.removeHandler(handler)
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "internal error in the gateway"
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    errors = [x for x in lines if "unhandled error" in x["msg"]]
    assert len(errors) == 1, errors
    # uvicorn's own copy of the same traceback is dropped: one bug, one traceback.
    assert [x["msg"] for x in lines if "exc" in x] == [errors[0]["msg"]]
    assert "RuntimeError: a bug" in errors[0]["exc"]
    (server,) = [s for s in traced.spans() if s.name.endswith("/v1/tokenize")]
    assert errors[0]["trace_id"] == format(server.context.trace_id, "032x")


@pytest.mark.parametrize(("level", "log_prompts", "logged"), [
    ("debug", False, False), ("info", True, False), ("debug", True, True),
])  # fmt: skip
async def test_prompts_are_logged_only_at_debug_level_when_asked_for(
    config: Config,
    start_worker: StartWorker,
    caplog: pytest.LogCaptureFixture,
    level: str,
    log_prompts: bool,
    logged: bool,
) -> None:
    config = config.model_copy(update={"log": LogConfig(level=level, log_prompts=log_prompts)})
    await start_worker("w-prompts")
    with caplog.at_level(logging.DEBUG):
        async with (
            serve(config) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            await wait_live(http, "short")
            body = {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 2}
            assert (await http.post("/v1/short/completions", json=body)).status_code == 200
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert (SECRET_PROMPT in text) is logged
