"""The gateway's FastAPI app: OpenAI-compatible routes over NATS.

``create_app(config, tokenizer)`` builds it; its lifespan connects to NATS, makes sure the
request stream, the per-group consumers and the state bucket exist, and starts the
dispatcher (chunks, resume queries) and the workers view (telemetry, breakers).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` and the same under
``/v1/<group>/…``; ``GET /v1/models``; ``GET /health`` (200 while NATS is connected, with
live workers per group); ``GET /metrics``; FastAPI's ``/openapi.json`` and ``/docs``.
Every error is OpenAI's ``{"error": {...}}`` with the status of its :class:`QosError`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from nats.aio.client import Client
from opentelemetry.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import Scope

from common.config import Config
from common.errors import (
    InternalError,
    InvalidRequestError,
    ModelNotFoundError,
    QosError,
    ServiceUnavailableError,
    error_from_code,
)
from common.heartbeat import Heartbeat, new_gateway_id
from common.logging import prompts_loggable
from common.nats import connect, ensure_jetstream
from common.sampling_defaults import SamplingDefaults, load_sampling_defaults
from common.subjects import Subjects
from common.tokenizer import BaseTokenizer
from common.trace_metrics import register_trace_metrics
from common.tracing import tracer_for
from gateway.admission import ADMISSION_WAIT_S, Admission
from gateway.auth import ApiKeys, KeyGrant
from gateway.classifier import GROUP_HEADER, permitted_group
from gateway.generate import ClientGone, Generator
from gateway.metrics import GatewayMetrics
from gateway.observe import ObserveMiddleware, log_unhandled, quiet_server_duplicates
from gateway.openai_api import ChatCompletionRequest, CompletionRequest
from gateway.responses import Kind
from gateway.server import DispatcherRef
from gateway.stream_keeper import StreamKeeper
from gateway.streams import Dispatcher
from gateway.tokenize_api import detokenize, tokenize
from gateway.workers_view import LIVE_WINDOW_S, WorkersView

log = logging.getLogger(__name__)


def model_name(model: str | None) -> str | None:
    """The name a model is served as: a folder's name, or a ``dummy:`` spec as given."""
    if model is None:
        return None
    if model.startswith("dummy:"):
        return model
    return Path(model).name or model


@dataclass
class GatewayState:
    """What the routes reach through ``app.state.gateway``; NATS parts exist while running."""

    config: Config
    keys: ApiKeys
    metrics: GatewayMetrics
    view: WorkersView
    admission: Admission
    served_model: str
    created: int
    aliases: tuple[str, ...] = ()  # other names a request's "model" may use
    dispatch: DispatcherRef = field(default_factory=DispatcherRef)  # for GatewayServer
    nc: Client | None = None
    generator: Generator | None = None
    stream_keeper: StreamKeeper | None = None
    # Loops the gateway needs that died (aborts, deletes, heartbeat, breaker watch): /health
    # answers 503 naming them, for the orchestrator to replace this process.
    failed: list[str] = field(default_factory=list)

    def loop_died(self, what: str) -> None:
        """A loop the gateway needs died (a bug): ``/health`` says "broken", and the server
        (when one runs the app) exits 1, as a worker does, for its supervisor to restart."""
        self.failed.append(what)
        if self.dispatch.on_broken is not None:
            self.dispatch.on_broken(what)


def error_response(exc: QosError) -> JSONResponse:
    return JSONResponse(exc.to_openai(), status_code=exc.http_status, headers=exc.headers())


def create_app(
    config: Config,
    tokenizer: BaseTokenizer,
    *,
    model: str | None = None,
    admission_wait_s: float = ADMISSION_WAIT_S,
    live_window_s: float | None = None,
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The gateway app for ``config``, serving ``model`` (a path or ``dummy:`` spec).

    The served name is ``gateway.served_model_name``, else the model folder's name;
    requests may also name the model exactly as ``model`` was given. Spans go to
    ``tracer_provider``, else to the process's (:func:`common.tracing.init_tracing`), and
    nowhere when neither is set.
    """
    tracer = tracer_for(tracer_provider, "qosserve.gateway")
    served = config.gateway.served_model_name or model_name(model) or "default"
    aliases = [model] if model else []
    if live_window_s is None:
        # Three reports' worth at least: workers reporting every 5 s read as gone for 2 s of
        # each 5 in a fixed 3 s window (503 "no worker" to requests meanwhile).
        live_window_s = max(LIVE_WINDOW_S, 3 * config.worker.telemetry_interval_s)
    view = WorkersView(config.groups, live_window_s=live_window_s)
    sampling = SamplingDefaults()
    if config.gateway.sampling_defaults == "model":  # a dummy: spec has no folder: none
        sampling = load_sampling_defaults(model)
        if sampling.given():
            log.info("sampling defaults from the model's generation_config.json (fields a "
                     "request leaves out): %s", sampling.given())  # fmt: skip
    metrics = GatewayMetrics(registry)
    state = GatewayState(
        config=config,
        keys=ApiKeys(
            config.gateway.api_key_sha256,
            rate_per_s=config.gateway.api_key_rate_limit_rps,
            burst=config.gateway.api_key_rate_limit_burst,
            groups=config.gateway.api_key_groups,
            min_priority=config.gateway.api_key_min_priority,
            isolate_cache=config.gateway.cache_isolation == "api_key",
            max_in_flight=config.gateway.api_key_max_in_flight,
            names=config.gateway.api_key_names,
            on_refused=metrics.key_refused_for,
        ),
        metrics=metrics,
        view=view,
        admission=Admission(config, view, wait_s=admission_wait_s),
        served_model=served,
        created=int(time.time()),
        aliases=tuple(aliases),
    )
    register_trace_metrics(state.metrics.registry, tracer)
    subjects = Subjects(config.nats.subject_prefix)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.keys.warn_if_open()
        stopping = asyncio.Event()

        def nats_closed() -> None:  # NATS gave up on us: no request can go out any more
            if not stopping.is_set():
                state.loop_died("NATS closed the connection for good")

        nc = await connect(
            config.nats, "qosserve-gateway", service="gateway", on_closed=nats_closed
        )
        js = nc.jetstream()
        _, _, kv = await ensure_jetstream(js, config.nats, config.groups)
        dispatcher = Dispatcher(nc, subjects, config.nats.max_payload_bytes, config.nats.stream)
        await dispatcher.start(on_failure=state.loop_died)
        state.dispatch.dispatcher, state.dispatch.loop = dispatcher, asyncio.get_running_loop()
        await view.start(nc, subjects, kv, on_failure=state.loop_died)
        gateway_id = new_gateway_id()
        heartbeat = Heartbeat(nc, subjects, gateway_id, config.gateway.heartbeat_interval_s)
        await heartbeat.start(on_failure=state.loop_died)
        dispatcher.on_lost_chunks = heartbeat.request_resync
        heartbeat.idle_streams = dispatcher.idle_streams
        keeper = StreamKeeper(
            nc, js, config.nats, list(config.groups), config.gateway.jetstream_check_s,
            held_seq=dispatcher.highest_seq, on_replaced=dispatcher.forget_sequences,
        )  # fmt: skip
        await keeper.start(on_failure=state.loop_died)
        state.stream_keeper = keeper
        state.nc = nc
        state.generator = Generator(
            config=config,
            tokenizer=tokenizer,
            served_model=served,
            model_aliases=aliases,
            js=js,
            dispatcher=dispatcher,
            admission=state.admission,
            metrics=state.metrics,
            tracer=tracer,
            log_prompts=prompts_loggable(config.log),
            origin=gateway_id,
            sampling_defaults=sampling,
        )
        log.info(
            "gateway %s serving %r for groups %s", gateway_id, served, ", ".join(config.groups)
        )
        try:
            yield
        finally:
            stopping.set()
            await keeper.stop()
            await heartbeat.stop()
            await view.stop()
            state.dispatch.dispatcher = None
            await dispatcher.stop()
            await nc.close()
            state.nc = state.generator = state.stream_keeper = None

    # No redirect for a trailing slash: Starlette's answered 307 to whatever Host the client
    # sent, as http://, before any key was checked (and the openai client resends the body
    # there); the 404 says which path is served.
    app = FastAPI(
        title="qosserve gateway", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
        **_no_native_otel(),
    )  # fmt: skip
    app.state.gateway = state
    quiet_server_duplicates()
    if tracer is not None or config.log.access_log:
        app.add_middleware(ObserveMiddleware, tracer=tracer, access_log=config.log.access_log)
    if config.gateway.cors_allow_origins:  # browser clients: answer their preflights
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.gateway.cors_allow_origins,
            allow_methods=["GET", "HEAD", "POST"],
            allow_headers=["*"],
            # What clients read from an answer; x-should-retry: openai-node in a browser read
            # null and retried a deadline or a given-up request as any 5xx.
            expose_headers=[
                "X-Request-Id",
                GROUP_HEADER,
                "X-QoS-Fallback-From",
                "Retry-After",
                "x-should-retry",
            ],
        )
    _add_error_handlers(app)
    _add_routes(app, state)
    _add_openapi(app)
    return app


# OpenAI endpoints a client may try that this gateway does not serve (named, not a bare
# "Not Found": a caller pointing an embeddings or Responses client here learns why).
_UNSERVED_OPENAI = ("embeddings", "responses", "audio", "images", "moderations", "files",
                    "batches", "fine_tuning", "assistants", "threads", "vector_stores",
                    "uploads", "realtime")  # fmt: skip
SERVED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/tokenize",
                "/v1/detokenize")  # fmt: skip


def not_found_message(method: str, path: str) -> str:
    """The 404's message: what was asked, and what is served instead."""
    parts = path.strip("/").split("/")
    unserved = len(parts) >= 2 and parts[0] == "v1" and parts[1] in _UNSERVED_OPENAI
    what = "is not served by qosserve" if unserved else "does not exist here"
    return (
        f"{method} {path[:200]} {what}; this gateway serves {', '.join(SERVED_PATHS)} "
        "(also under /v1/<group>/ for an instance group), /health and /metrics"
    )


class GenerationRoute(Route):
    """A generation endpoint as a plain Starlette route. FastAPI's route solves its
    dependencies on every request (~22 µs of the gateway's CPU here) for an endpoint that
    takes the bare request and parses its body itself. ``scope["route"]`` is set as
    FastAPI sets it: access logs and spans name the route template."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE:
            child["route"] = self
        return match, child


def _generation_endpoint(
    generate: Callable[[Kind, Request, str | None], Awaitable[Response]], kind: Kind
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await generate(kind, request, request.path_params.get("group"))

    return endpoint


async def _documented(request: Request) -> Response:
    raise AssertionError("shadowed by its GenerationRoute")


async def _documented_group(group: str, request: Request) -> Response:
    raise AssertionError("shadowed by its GenerationRoute")


def _no_native_otel() -> dict[str, Any]:
    """FastAPI ≥ 0.16x traces natively through the global provider: its server span and its
    dependency/endpoint spans would double ours (gateway.observe) and cost as much again."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    off = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    return {"telemetry": off}


def _add_routes(app: FastAPI, state: GatewayState) -> None:
    def body_doc(model: type) -> dict[str, Any]:
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

    async def generate(kind: Kind, request: Request, group: str | None) -> Response:
        try:
            grant = state.keys.check(request.headers.get("authorization"))
            if state.generator is None:
                raise ServiceUnavailableError(
                    "the gateway is not connected to NATS yet", retry_after_s=1
                )
        except QosError as exc:  # refused before classification: group "-"
            state.metrics.finished("-", exc.http_status)
            raise
        return await state.generator.handle(kind, request, group, grant)

    # The fixed routes come first: /v1/chat/completions must not read as group "chat".
    generation: list[tuple[str, str, Kind, type]] = [
        ("/v1/completions", "completions", "completion", CompletionRequest),
        ("/v1/chat/completions", "chat_completions", "chat", ChatCompletionRequest),
        ("/v1/{group}/completions", "group_completions", "completion", CompletionRequest),
        ("/v1/{group}/chat/completions", "group_chat_completions", "chat", ChatCompletionRequest),
    ]
    for path, name, kind, body in generation:
        endpoint = _generation_endpoint(generate, kind)
        app.router.routes.append(GenerationRoute(path, endpoint, methods=["POST"], name=name))
        # Never reached (the route above matches first): it documents the body in OpenAPI.
        doc = _documented_group if "{group}" in path else _documented
        app.post(path, openapi_extra=body_doc(body), name=name)(doc)

    def model_card(group: str | None, allowed: Collection[str] | None = None) -> dict[str, Any]:
        if group is not None:  # 404 for an unknown group, 403 for one the key may not use
            permitted_group(state.config, group, None, allowed)
        # What the groups take now: a group's workers may serve less than its config says;
        # of those the caller's key may use (a bound key saw the longest of all groups).
        longest = state.admission.max_model_len(None if group is None else [group], allowed)
        return {
            "id": state.served_model,
            "object": "model",
            "created": state.created,
            "owned_by": "qosserve",
            "max_model_len": longest,
        }

    def generator_for(request: Request) -> tuple[Generator, KeyGrant]:
        grant = state.keys.check(request.headers.get("authorization"))
        if state.generator is None:
            raise ServiceUnavailableError("the gateway is not ready yet", retry_after_s=1)
        return state.generator, grant

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    @app.post("/v1/{group}/tokenize")  # a client whose base_url names a group: its limit
    async def tokenize_route(request: Request) -> Any:
        generator, grant = generator_for(request)
        group = request.path_params.get("group")  # the path's only (not a ?group= query)
        try:
            return await tokenize(generator, request, grant.groups, group)
        except ClientGone:  # hung up while sending the body: a 499, as for a generation
            return Response(status_code=499)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    @app.post("/v1/{group}/detokenize")
    async def detokenize_route(request: Request) -> Any:
        generator, grant = generator_for(request)
        if (group := request.path_params.get("group")) is not None:
            generator.max_model_len(grant.groups, group)  # 404 / 403 as for tokenize
        try:
            return await detokenize(generator, request)
        except ClientGone:
            return Response(status_code=499)

    @app.get("/v1/models")
    @app.get("/v1/{group}/models")  # a client whose base_url names a group lists models too
    @app.head("/v1/models", include_in_schema=False)  # uptime checkers probe with HEAD
    @app.head("/v1/{group}/models", include_in_schema=False)
    async def models(request: Request, group: str | None = None) -> dict[str, Any]:
        grant = state.keys.check(request.headers.get("authorization"), rate_limited=False)
        return {"object": "list", "data": [model_card(group, grant.groups)]}

    @app.get("/v1/models/{model_id:path}")  # client.models.retrieve; ids may hold a "/"
    @app.get("/v1/{group}/models/{model_id:path}")  # the same, under a group's base_url
    async def model(request: Request, model_id: str, group: str | None = None) -> dict[str, Any]:
        grant = state.keys.check(request.headers.get("authorization"), rate_limited=False)
        if model_id not in (state.served_model, *state.aliases):
            raise ModelNotFoundError(
                f"The model '{model_id}' does not exist; this gateway serves "
                f"'{state.served_model}'",
                param="model",
            )
        return model_card(group, grant.groups)

    @app.get("/health")
    async def health() -> JSONResponse:
        connected = state.nc is not None and state.nc.is_connected
        groups = {
            name: {
                "live_workers": state.view.live_workers(name),
                "breaker": state.view.breaker(name),
                "in_flight": state.admission.in_flight(name),
            }
            for name in state.config.groups
        }
        status = "unavailable" if not connected else "broken" if state.failed else "ok"
        body: dict[str, Any] = {"status": status, "nats": connected, "groups": groups}
        if state.failed:
            body["failed"] = state.failed
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.refresh_groups(state.view.live_counts(), state.view.breakers())
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(QosError)
    async def qos_error(request: Request, exc: QosError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only path parameters reach FastAPI's validation (bodies are parsed by hand):
        # answer 400 in OpenAI's shape, never FastAPI's 422.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")]
        param = ".".join(loc) or None
        message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}"
        return error_response(InvalidRequestError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        client_side = 400 <= exc.status_code < 500  # a 405 is the caller's, not ours
        error_type = (
            "invalid_request_error" if client_side else error_from_code(code, "").error_type
        )
        message = str(exc.detail)
        if exc.status_code == 404:
            message = not_found_message(request.method, request.url.path)
        body = {
            "error": {
                "message": message,
                "type": error_type,
                "param": None,
                "code": code,
            }
        }
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log_unhandled(request.scope, exc)
        return error_response(InternalError("internal error in the gateway"))


def _add_openapi(app: FastAPI) -> None:
    """FastAPI's schema plus the request bodies the routes parse themselves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
