"""The HTTP front: a Litestar application over one model worker.

:func:`create_app` mounts every API surface the loaded plugins register
(hook ``musegl_api_surfaces``: the core's Chat Completions and Completions,
plugins' Anthropic Messages, OpenAI Responses, ...) side by side, each in a
router of its own with its own error envelope and credentials
(:mod:`musegl_core.http.surface`), next to the server's own routes (models,
health, metrics, tokenize, sessions: docs/serving.md). It wires the error
mapping (every error, Litestar's own included, leaves in the shape of the
surface it belongs to; the dialect's elsewhere), optional API-key auth, the
request size limit, and the worker's lifetime (started and stopped with the app).

Requests are parsed by hand from the raw body (not through Litestar's
signature model), so malformed JSON and wrong field types are 400s that name
the field, and everything is validated before the worker sees the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from typing import Any, AsyncIterator

import attrs

from litestar import Litestar, Request, Response, Router, get, head
from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath
from litestar.types import Message, Scope

from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError, ConfigError, server_error, shutting_down, unavailable
from musegl_core.http import openapi
from musegl_core.http import schemas as s
from musegl_core.http.dialect import Dialect, ServedModel
from musegl_core.http.front_tokenizer import FrontTokenizer
from musegl_core.http.guards import browser_guard
from musegl_core.http.memory import MemoryTrim
from musegl_core.http.metrics import FrontMetrics, MeteredWorker
from musegl_core.http.model_ids import ModelIds
from musegl_core.http.request_log import CLIENT_CLOSED, CLIENT_GONE, RequestLog
from musegl_core.http.sessions import session_routes
from musegl_core.http.surface import ApiSurface, SurfaceContext, unless_disconnected
from musegl_core.plugins.manager import PluginManager
from musegl_core.service.reasoning_seal import ReasoningSeal
from musegl_core.service.service import GenerationService
from musegl_core.worker.client import WorkerClient

log = logging.getLogger("musegl.http")

_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}


class Front(SurfaceContext):
    """The state the handlers share: settings, plugins' objects, the worker,
    the generation service; what every API surface is built with."""

    def __init__(self, config: ServeConfig, plugins: PluginManager, worker: WorkerClient):
        self.config = config
        self.worker = worker
        self.dialect: Dialect = plugins.get("dialects", config.api_dialect).create()
        self.template = plugins.get("templates", config.template).create()
        self.tool_parser = plugins.get("tool_parsers", config.tool_parser) if config.tool_parser else None
        self.tokenizer = FrontTokenizer()  # loaded at start-up (lifespan)
        self.created = int(time.time())
        self.ids = ModelIds.resolve(config.served_model_name, config.served_model_aliases, None)
        self.metrics = FrontMetrics()
        self.metrics.model_name = self.ids.served
        self.service = GenerationService(config, worker, template=self.template, tool_parser=self.tool_parser,
                                         tokenizer=self.tokenizer, metered=self.metered)
        self.seal = ReasoningSeal.random()
        self.shutting_down = False
        self._deadline: asyncio.TimerHandle | None = None

    async def load(self) -> None:
        """Start-up work off the event loop: the tokenizer and the served id."""
        await self.tokenizer.load(self.config)
        if self.config.served_model_name is None:
            self.ids = await asyncio.to_thread(
                ModelIds.resolve, None, self.config.served_model_aliases, self.config.model
            )
            self.metrics.model_name = self.ids.served

    def metered(self, arrived: float) -> MeteredWorker:
        return MeteredWorker(self.worker, self.metrics, arrived)

    def begin_shutdown(self) -> None:
        """Shutdown started (SIGINT/SIGTERM): refuse new requests; after
        ``--shutdown-timeout`` end those still running with ``server_shutting_down``."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self.worker.begin_shutdown()
        log.info("shutting down: in-flight requests have %g s to finish", self.config.shutdown_timeout)
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.config.shutdown_timeout, self._end_inflight)

    def _end_inflight(self) -> None:
        self.worker.fail_inflight(shutting_down())

    def check_open(self) -> None:
        if self.shutting_down:
            raise shutting_down()

    def model_entry(self, model_id: str) -> Any:
        return self.dialect.model_entry(attrs.evolve(self.served_model, name=model_id))

    @property
    def served_model(self) -> ServedModel:
        info = self.worker.info.model if self.worker.info else None
        return ServedModel(
            name=self.ids.served,
            created=self.created,
            context_length=self.config.max_context,
            demo=self.config.demo or bool(info and info.demo),
            backend=info.backend if info else None,
            tool_calling=self.tool_parser is not None,
            vision=bool(info and info.vision),
        )

    def error_response(self, error: ApiError) -> Response:
        return Response(
            self.dialect.error_body(error),
            status_code=error.status,
            headers=self.dialect.error_headers(error),
            media_type="application/json",
        )


def create_app(
    config: ServeConfig, plugins: PluginManager, worker: WorkerClient, *, manage_worker: bool = True
) -> Litestar:
    """The musegl HTTP application.

    With ``manage_worker`` (the default) the app starts ``worker`` on startup
    and closes it on shutdown; pass ``False`` when the caller owns it (tests
    that need no model).
    """
    front = Front(config, plugins, worker)

    async def require_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if config.api_key is None:
            return
        scheme, _, token = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error", "invalid_api_key")

    @get(["/v1/models", "/models"], guards=[require_key], sync_to_thread=False,
         operation_class=openapi.operation(responses={200: s.ModelList, 401: s.ErrorBody}))
    def models() -> dict[str, Any]:
        """The served model: its id, then its aliases, with the context budget."""
        listed = front.ids.listed
        return s.to_json(s.ModelList(data=[front.model_entry(i) for i in listed], first_id=listed[0] if listed else None,
                                     last_id=listed[-1] if listed else None))

    @get(["/v1/models/{model_id:str}", "/models/{model_id:str}"], guards=[require_key], sync_to_thread=False,
         operation_class=openapi.operation(responses={200: s.ModelEntry, 401: s.ErrorBody, 404: s.ErrorBody}))
    def model(model_id: FromPath[str]) -> dict[str, Any]:
        """One model by id: the served id, an alias, or ``musegl``; 404 ``model_not_found`` otherwise."""
        if not front.ids.accepts(model_id):
            raise ApiError(404, f"the model {model_id!r} is not served here; see /v1/models",
                           "invalid_request_error", "model_not_found", "model")
        return s.to_json(front.model_entry(model_id))

    @get(["/health", "/v1/health"], sync_to_thread=False, security=[{}],
         operation_class=openapi.operation(responses={200: s.HealthStatus, 503: s.ErrorBody}))
    def health() -> Response:
        """200 once the worker can generate; 503 ``unavailable_error`` before, and from the
        start of a shutdown (SIGTERM: ``server_shutting_down``), so that a router or a load
        balancer stops sending requests while the running ones finish."""
        if front.shutting_down:
            return front.error_response(shutting_down())
        if not worker.ready:
            return front.error_response(truthful(unavailable("the model is loading or restarting",
                                                             code="model_loading"), worker))
        return Response(s.to_json(s.HealthStatus()), media_type="application/json")

    @get("/metrics", guards=[require_key], operation_class=openapi.operation(responses={200: openapi.TEXT, 401: s.ErrorBody}))
    async def metrics() -> Response:
        """Prometheus text: engine counters, worker state, request and token counters, latencies."""
        values: dict = {}
        if worker.ready:
            with contextlib.suppress(ApiError, asyncio.TimeoutError):
                values = await worker.stats()
        body = front.metrics.render(values, ready=worker.ready, restarts=worker.restarts)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @head("/", sync_to_thread=False, security=[{}])
    def root() -> None:
        """``HEAD /``: the server answers (clients probe it before their first request)."""

    surfaces = build_surfaces(front, plugins)

    def count_response(message: Message, scope: Scope) -> None:
        if message["type"] == "http.response.start" and scope["type"] == "http":
            front.metrics.count(scope.get("path_template") or "unmatched", message["status"])

    def respond(request: Request, error: ApiError) -> Response:
        """The error in the shape of the surface whose prefix the path has, else the dialect's."""
        owner = next((surface for surface in surfaces if surface.owns(request.url.path)), None)
        error = truthful(error, worker)
        return owner.error_response(error) if owner is not None else front.error_response(error)

    def on_api_error(request: Request, error: ApiError) -> Response:
        return respond(request, error)

    def on_http_error(request: Request, exc: HTTPException) -> Response:
        return respond(request, http_error(request, exc, config))

    def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return respond(request, server_error(f"internal error: {type(exc).__name__}"))

    @contextlib.asynccontextmanager
    async def worker_lifespan(_: Litestar) -> AsyncIterator[None]:
        if manage_worker:  # the worker loads the model while the front loads its tokenizer
            await worker.start()
        try:
            await front.load()
            yield
        finally:
            if front._deadline is not None:
                front._deadline.cancel()
            if manage_worker:
                await worker.close()

    cors = CORSConfig(allow_origins=list(config.cors_allow_origins)) if config.cors_allow_origins else None
    app = Litestar(
        route_handlers=[models, model, health, metrics, root,
                        *(session_routes(worker, [require_key]) if config.sessions_api else []),
                        *(mount(surface) for surface in surfaces)],
        exception_handlers={
            ApiError: on_api_error,
            HTTPException: on_http_error,
            Exception: on_unexpected,
        },
        guards=[browser_guard(config)],  # web pages: content type, Origin, Host (http/guards.py)
        lifespan=[worker_lifespan],
        before_send=[count_response],
        cors_config=cors,
        request_max_body_size=config.max_request_bytes,
        openapi_config=openapi.config(config.api_key is not None, [require_key] if config.api_key else ()),
        logging_config=None,  # musegl_core.logs configures logging once, for every library
        state={"front": front},
    )
    # Around everything Litestar answers (unmatched paths and errors too): X-Request-Id, the summary
    # line, and freed memory given back after a large body (http/memory.py).
    app.asgi_handler = RequestLog(app.asgi_handler, trim=MemoryTrim())
    return app


_unless_disconnected = unless_disconnected  # the name callers of this module used


#: 503 codes that mean "the worker is not ready": their Retry-After is the worker's estimate
WORKER_NOT_READY = frozenset({"model_loading", "worker_restarting", "worker_unavailable"})


def truthful(error: ApiError, worker: Any) -> ApiError:
    """A 503 saying the worker is not ready carries the worker's own estimate of when it
    will be (:meth:`WorkerClient.retry_after`: from the last start's duration), or no
    ``Retry-After`` when nothing is known yet; every other error is left as it is."""
    if error.status != 503 or error.code not in WORKER_NOT_READY or worker is None:
        return error
    return attrs.evolve(error, retry_after=worker.retry_after())


def http_error(request: Request, exc: HTTPException, config: ServeConfig) -> ApiError:
    """One of Litestar's own errors (404, 405, 413, ...) as an :class:`ApiError`."""
    status = exc.status_code
    message = exc.detail or "request failed"
    if status == 500 and request.scope.get("state", {}).get(CLIENT_GONE):
        # the client hung up while sending its body: nobody to answer, and not the server's failure
        return ApiError(CLIENT_CLOSED, "the client closed the connection before its request arrived whole",
                        "invalid_request_error", "client_closed_request")
    if status == 404:
        message = "no such endpoint; see /v1/models and /v1/chat/completions"
        if not config.sessions_api and request.url.path.removeprefix("/v1").startswith("/sessions"):
            message = "the sessions API is turned off on this server (--sessions-api off)"
    elif status == 413:
        message = f"the request body exceeds --max-request-bytes ({config.max_request_bytes} bytes)"
    code = "request_too_large" if status == 413 else None
    error_type = _HTTP_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ApiError(status, message, error_type, code)


def build_surfaces(front: Front, plugins: PluginManager) -> list[ApiSurface]:
    """Every registered API surface, built with the front as its context (its
    route handlers in ``surface.handlers``); two surfaces serving the same
    method and path are a start-up error."""
    surfaces = []
    claimed: dict[tuple[str, str], str] = {}
    for name, (plugin, spec) in sorted(plugins.provided("api_surfaces").items()):
        surface = spec.create(front)
        surface.handlers = surface.routes()
        for handler in surface.handlers:
            for path in handler.paths:
                for method in handler.http_methods:
                    other = claimed.setdefault((method, path), name)
                    if other != name:
                        raise ConfigError(f"API surfaces {other!r} and {name!r} (plugin {plugin!r}) both serve "
                                          f"{method} {path}")
        surfaces.append(surface)
    return surfaces


def mount(surface: ApiSurface) -> Router:
    """A router for ``surface``'s routes: its credentials guard (with
    ``--api-key``), its error envelope for everything raised in them, its OpenAPI tag."""
    context = surface.context

    async def require_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if not context.key_matches(surface.credential(connection)):
            raise surface.credential_error()

    def on_api_error(_: Request, error: ApiError) -> Response:
        return surface.error_response(truthful(error, getattr(context, "worker", None)))

    def on_http_error(request: Request, exc: HTTPException) -> Response:
        return surface.error_response(http_error(request, exc, context.config))

    def on_unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return surface.error_response(server_error(f"internal error: {type(exc).__name__}"))

    return Router(
        path="/",
        route_handlers=surface.handlers,
        guards=[require_key] if context.config.api_key is not None else [],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_unexpected},
        tags=[surface.title],
    )
