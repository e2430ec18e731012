"""The OpenAPI document (``GET /openapi.json``), generated from the app.

Litestar lists the routes, their paths, methods and path parameters. The
handlers read their bodies themselves (strict cattrs structuring, so errors
name the field), so Litestar cannot see the body types; each route therefore
declares them with :func:`operation`, and :func:`schema_of` turns the same
attrs classes the handlers structure and unstructure into JSON Schema. The
document describes what the code parses and writes, not a copy kept by hand.

Rules of the translation:

* a request field is required when it has no default; ``X | None`` accepts
  ``null``; unknown keys are allowed (the ``openai`` dialect ignores them),
  except on objects that refuse them (``reasoning``, ``chat_template_kwargs``);
* a response field is always present unless it is omitted while ``None``
  (:func:`musegl_core.http.schemas.omittable`);
* a field may carry a hand-written schema in its metadata
  (:data:`JSON_SCHEMA`) where its Python type is ``Any`` (``messages``).

Range and consistency rules (``temperature`` in [0, 2], ...) are checked by
the handlers and answered with 400; the document describes types and shapes,
and lists the error statuses each route can return. It describes the
``openai`` dialect.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Sequence, Union

import attrs
from litestar import Router
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import (
    Components,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Parameter,
    RequestBody,
    Schema,
    SecurityScheme,
)

from musegl_core import __version__
from musegl_core.http import schemas as s

#: attrs field metadata key: a JSON Schema that replaces the one derived from the type
JSON_SCHEMA = s.JSON_SCHEMA

_ERROR_TEXT = {
    400: "invalid request (the error names the parameter)",
    401: "a valid API key is required",
    404: "unknown model id or session",
    409: "the session is active (a request runs or waits on it)",
    403: "a web page's request: a foreign Origin on a server without an API key, or a foreign Host on a loopback bind",
    413: "request body too large",
    415: "the body is not JSON (Content-Type other than application/json)",
    503: "the model is loading or restarting, or the server is shutting down",
}
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def schema_of(tp: Any, *, response: bool = False) -> dict[str, Any]:
    """The JSON Schema of a type as :data:`musegl_core.http.schemas.converter` reads
    (``response=False``) or writes (``response=True``) it."""
    if tp is Any:
        return {}
    if tp is None or tp is type(None):
        return {"type": "null"}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return {"anyOf": [schema_of(arg, response=response) for arg in typing.get_args(tp)]}
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": schema_of(item, response=response)}
    if origin is dict:
        _, value = typing.get_args(tp)
        return {"type": "object", "additionalProperties": schema_of(value, response=response)}
    if attrs.has(tp):
        return _object_schema(tp, response)
    raise TypeError(f"no JSON Schema for {tp!r}")


def _object_schema(cls: type, response: bool) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties, required = {}, []
    for field in attrs.fields(cls):
        properties[field.name] = field.metadata.get(JSON_SCHEMA) or schema_of(hints[field.name], response=response)
        if response:
            if not field.metadata.get(s.OMIT_NONE):
                required.append(field.name)
        elif field.default is attrs.NOTHING:
            required.append(field.name)
    schema: dict[str, Any] = {"type": "object", "title": cls.__name__, "properties": properties}
    if required:
        schema["required"] = required
    if not response and getattr(cls, s.FORBID_EXTRA, False):
        schema["additionalProperties"] = False
    return schema


def _content(spec: Any) -> dict[str, OpenAPIMediaType]:
    if isinstance(spec, dict) and all(isinstance(key, str) and "/" in key for key in spec):
        return {media: OpenAPIMediaType(schema=_schema(value)) for media, value in spec.items()}  # type: ignore[arg-type]
    return {"application/json": OpenAPIMediaType(schema=_schema(spec))}  # type: ignore[arg-type]


def _schema(spec: Any) -> dict[str, Any]:
    return spec if isinstance(spec, dict) else schema_of(spec, response=True)


#: ``/metrics``: Prometheus text
TEXT = {"text/plain": {"type": "string"}}

#: One server-sent event of a stream (``text/event-stream``): its ``data`` line(s)
#: and, where the API names its events, ``event``.
SSE = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}


def GENERATION(result: type) -> dict[int, Any]:  # noqa: N802 (a table, named like one)
    """A generation route: the object, or an SSE stream when ``stream`` is true."""
    return {
        200: {"application/json": result, "text/event-stream": SSE},
        **{code: s.ErrorBody for code in (400, 401, 403, 413, 415, 503)},
    }


def PLAIN(result: type) -> dict[int, Any]:  # noqa: N802
    return {200: result, **{code: s.ErrorBody for code in (400, 401, 403, 413, 415, 503)}}


#: The header a chat request may name its session with instead of ``session_id``.
SESSION_HEADER = Parameter(
    name="X-Session-Id",
    param_in="header",
    schema=Schema(type="string"),  # type: ignore[arg-type]
    description="names the session, as the body's session_id does (they must agree)",
)


def operation(
    *, body: type | None = None, responses: dict[int, Any] | None = None, headers: tuple[Parameter, ...] = ()
) -> type[Operation]:
    """An ``operation_class`` for a route: its request body, responses and headers."""

    @dataclass
    class Documented(Operation):
        def __post_init__(self) -> None:
            if headers:
                self.parameters = [*(self.parameters or []), *headers]
            if body is not None:
                self.request_body = RequestBody(
                    content={"application/json": OpenAPIMediaType(schema=schema_of(body))},  # type: ignore[arg-type]
                    required=True,
                )
            if responses:
                self.responses = {
                    str(code): OpenAPIResponse(
                        description="OK" if code < 400 else _ERROR_TEXT.get(code, "error"),
                        content=_content(spec),
                    )
                    for code, spec in responses.items()
                }

    return Documented


def config(api_key: bool, guards: Sequence[Any] = ()) -> OpenAPIConfig:
    """``GET /openapi.json``: the document as JSON, and no documentation UI.
    With ``--api-key`` every route but ``/health`` requires the bearer token, the
    document's own route included (``guards``: the key check): it lists what this
    server runs (surfaces, the sessions API), which is nobody else's business."""
    security = {
        "components": Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
        "security": [{"bearer": []}],
    } if api_key else {}
    router = (Router(path="/openapi.json", route_handlers=[], guards=list(guards), include_in_schema=False)
              if guards else None)
    return OpenAPIConfig(title="musegl", version=__version__, path="/openapi.json", openapi_router=router,
                         render_plugins=[JsonRenderPlugin(path="/")], **security)
