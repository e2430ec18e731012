"""API surfaces: whole HTTP APIs served side by side over the generation service.

A surface (Chat Completions, Completions, Anthropic Messages, OpenAI
Responses, ...) is an object built by a :class:`~musegl_core.plugins.specs.SurfaceSpec`
(hook ``musegl_api_surfaces``) from the :class:`SurfaceContext`. It
subclasses :class:`ApiSurface` and provides:

* **its routes**: Litestar route handlers (:meth:`ApiSurface.routes`). Each
  declares its OpenAPI entry with ``operation_class=musegl_core.http.openapi.operation(
  body=RequestClass, responses={200: ResponseClass, 400: ErrorClass, ...})``, from
  the same attrs classes it structures and writes (**its schemas**), so
  ``/openapi.json`` documents every surface; the routes are tagged with
  :attr:`ApiSurface.title`.
* **its error envelope**: :meth:`ApiSurface.error_body`,
  :meth:`ApiSurface.error_status` and :meth:`ApiSurface.error_headers` turn
  an :class:`~musegl_core.errors.ApiError` into its own wire shape. The app
  applies them to every error raised in the surface's routes (Litestar's own
  included: a body over ``--max-request-bytes``, validation), and to 404s and
  405s under the path prefixes the surface claims (:attr:`ApiSurface.prefixes`).
  Errors after a stream has started are the surface's own business.
* **its credentials**: :meth:`ApiSurface.credential` reads the API key from a
  request (default ``Authorization: Bearer``); with ``--api-key`` the app
  guards every route of the surface with it.

The app mounts every registered surface; paths must not collide (a start-up
error otherwise). The core's own are ``chat`` (Chat Completions, spelled by
the ``--api-dialect``) and ``completions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any

from litestar import Request, Response
from litestar.connection import ASGIConnection

from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError

log = logging.getLogger("musegl.http")


class SurfaceContext:
    """What the core gives a surface (the front's shared state).

    * ``config``: the :class:`~musegl_core.config.ServeConfig`;
    * ``service``: the :class:`~musegl_core.service.service.GenerationService`;
    * ``dialect``: the Chat Completions dialect (``--api-dialect``);
    * ``served_model``: the :class:`~musegl_core.http.dialect.ServedModel`
      (its ``name`` is what responses report as their model);
    * ``ids``: the :class:`~musegl_core.http.model_ids.ModelIds` the model answers to;
    * ``seal``: the server's :class:`~musegl_core.service.reasoning_seal.ReasoningSeal`;
    * :meth:`check_open`: raises 503 ``server_shutting_down`` once shutdown began.

    :class:`musegl_core.http.app.Front` is the implementation.
    """

    config: ServeConfig
    service: Any
    dialect: Any
    ids: Any
    seal: Any

    @property
    def served_model(self) -> Any:
        raise NotImplementedError

    def check_open(self) -> None:
        raise NotImplementedError

    def key_matches(self, token: str | None) -> bool:
        """Whether ``token`` is the configured ``--api-key`` (True when none is set)."""
        key = self.config.api_key
        if key is None:
            return True
        return token is not None and hmac.compare_digest(token.strip().encode(), key.encode())


class ApiSurface:
    """Base class of an API surface (see the module docstring). Override
    :meth:`routes` and, for another error shape, :meth:`error_body`."""

    #: the surface's name (its spec's name)
    name = "surface"
    #: the OpenAPI tag of its routes
    title = "API"
    #: path prefixes whose unmatched routes (404, 405) get this surface's error envelope
    prefixes: tuple[str, ...] = ()

    def __init__(self, context: SurfaceContext):
        self.context = context

    def routes(self) -> list:
        """The surface's Litestar route handlers."""
        raise NotImplementedError

    # -- the error envelope ------------------------------------------------------------
    def error_body(self, error: ApiError) -> Any:
        """The JSON body of an error response (default: the Chat Completions dialect's)."""
        return self.context.dialect.error_body(error)

    def error_status(self, error: ApiError) -> int:
        """The HTTP status of an error response (default: the error's own)."""
        return error.status

    def error_headers(self, error: ApiError) -> dict[str, str]:
        """Headers of an error response (default: ``Retry-After`` when the error has one)."""
        return {"Retry-After": str(error.retry_after)} if error.retry_after is not None else {}

    def error_response(self, error: ApiError) -> Response:
        return Response(self.error_body(error), status_code=self.error_status(error),
                        headers=self.error_headers(error), media_type="application/json")

    # -- credentials -------------------------------------------------------------------
    def credential(self, connection: ASGIConnection) -> str | None:
        """The API key a request carries: ``Authorization: Bearer <key>``."""
        scheme, _, token = connection.headers.get("authorization", "").partition(" ")
        return token if scheme.lower() == "bearer" else None

    def credential_error(self) -> ApiError:
        return ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error",
                        "invalid_api_key")

    def owns(self, path: str) -> bool:
        return any(path == prefix or path.startswith(prefix.rstrip("/") + "/") for prefix in self.prefixes)


async def unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client goes away first.

    On a disconnect ``work`` is cancelled (which cancels the worker request)
    and a 499 ``client_closed`` error ends the handler; nobody reads it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        log.info("client disconnected; request cancelled")
        raise ApiError(499, "the client closed the connection", "invalid_request_error", "client_closed")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the ASGI server reports that the client disconnected."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
