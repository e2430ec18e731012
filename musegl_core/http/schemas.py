"""The schema kit every API surface writes its wire shapes with: the strict
cattrs :data:`converter`, :func:`parse_body`, :func:`structure_body`,
:func:`to_json`, the field helpers (:data:`JSON_SCHEMA`, :func:`closed`,
:func:`omittable`) and the server's own shapes (models, health, errors).

Requests are structured from the raw JSON body with :data:`converter`, whose
primitive hooks are *strict* (``"5"`` is not an integer, ``1`` is not a
boolean, a string is not a list), so a wrong field type becomes a 400 that
names the field (:func:`structure_body`). Responses are unstructured with
the same converter; fields declared with :func:`omittable` disappear from the
JSON when they are ``None`` (``reasoning_content``, ``tool_calls``, ...),
while ordinary ``None`` fields are written as ``null`` (the role chunk's
``content``, ``finish_reason`` of a delta chunk).

The core's OpenAI shapes are in :mod:`musegl_core.openai.schemas`.
"""

from __future__ import annotations

import datetime
import traceback
from typing import Any, NoReturn, TypeVar, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory, mapping_structure_factory
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from musegl_core.errors import ApiError, bad_request
from musegl_core.http.body import load_json_object
from musegl_core.service.rules import MAX_CACHE_SALT

T = TypeVar("T")
_OMIT_NONE = OMIT_NONE = "musegl_omit_none"
_FORBID_EXTRA = FORBID_EXTRA = "__musegl_forbid_extra_keys__"
#: attrs field metadata: the field's JSON Schema where its type says too little (OpenAPI)
JSON_SCHEMA = "musegl_json_schema"

def omittable(default: Any = None) -> Any:
    """An attrs field that is left out of the JSON while it is ``None``."""
    return attrs.field(default=default, metadata={_OMIT_NONE: True})


def closed(cls: type) -> type:
    """Mark an attrs request class whose unknown keys are an error (``reasoning``,
    ``chat_template_kwargs``); the 400 names the unknown key."""
    setattr(cls, _FORBID_EXTRA, True)
    return cls


@attrs.frozen
class ModelEntry:
    """One ``/v1/models`` entry. ``context_length`` and ``max_model_len`` are both
    the runtime ``--max-context`` budget; ``input_modalities`` is
    ``["text", "image"]`` when a vision projector is loaded, else ``["text"]``;
    ``demo`` marks the built-in random-weight demo model. ``type``,
    ``display_name`` and ``created_at`` (RFC 3339) are the fields Anthropic's
    model object has, so both SDKs read the same entry."""

    id: str
    created: int
    context_length: int
    max_model_len: int
    input_modalities: list[str] = attrs.Factory(lambda: ["text"])
    object: str = "model"
    owned_by: str = "musegl"
    type: str = "model"
    display_name: str | None = omittable()
    created_at: str | None = omittable()
    demo: bool | None = omittable()
    description: str | None = omittable()


def rfc3339(seconds: int) -> str:
    """Unix seconds as Anthropic's ``created_at`` (``2026-12-01T20:56:25Z``)."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.frozen
class ModelList:
    """``/v1/models``. Entries are written by their own class, so a dialect may
    return a richer entry than :class:`ModelEntry` (the OpenRouter model shape).
    ``has_more``, ``first_id`` and ``last_id`` are the page fields of
    Anthropic's list (one page: every entry)."""

    data: list[Any]
    object: str = "list"
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


@attrs.frozen
class HealthStatus:
    status: str = "ok"


@attrs.frozen
class ErrorObject:
    """OpenAI's error object (the openai dialect)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


@attrs.frozen
class ErrorBody:
    error: ErrorObject


# -- the converter ---------------------------------------------------------------------
converter = cattrs.Converter()


def _strict(kind: type, accepts: Any, expected: str) -> None:
    def hook(value: Any, _: Any) -> Any:
        if not accepts(value):
            raise TypeError(f"expected {expected}")
        return float(value) if kind is float else value

    converter.register_structure_hook(kind, hook)


_strict(bool, lambda v: isinstance(v, bool), "a boolean")
_strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
_strict(float, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
_strict(str, lambda v: isinstance(v, str), "a string")


def _is_list(t: Any) -> bool:
    return get_origin(t) is list


def _strict_list(t: Any, conv: cattrs.Converter) -> Any:
    inner = list_structure_factory(t, conv)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, list):
            raise TypeError("expected an array")
        return inner(value, t)

    return hook


def _is_dict(t: Any) -> bool:
    return get_origin(t) is dict


def _strict_dict(t: Any, conv: cattrs.Converter) -> Any:
    inner = mapping_structure_factory(t, conv)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError("expected an object")
        return inner(value, t)

    return hook


def _strict_attrs(cls: type, conv: cattrs.Converter) -> Any:
    inner = make_dict_structure_fn(
        cls, conv, _cattrs_forbid_extra_keys=getattr(cls, _FORBID_EXTRA, False)
    )

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError("expected an object")
        return inner(value, cls)

    return hook


converter.register_structure_hook_factory(_is_list, _strict_list)
converter.register_structure_hook_factory(_is_dict, _strict_dict)
converter.register_structure_hook_factory(attrs.has, _strict_attrs)


def _omitting_unstructure(cls: type, conv: cattrs.Converter) -> Any:
    base = make_dict_unstructure_fn(cls, conv)
    optional = [f.name for f in attrs.fields(cls) if f.metadata.get(_OMIT_NONE)]
    if not optional:
        return base

    def hook(obj: Any) -> dict[str, Any]:
        payload = base(obj)
        for name in optional:
            if payload.get(name) is None:
                payload.pop(name, None)
        return payload

    return hook


converter.register_unstructure_hook_factory(attrs.has, _omitting_unstructure)


# -- entry points ----------------------------------------------------------------------
def parse_body(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 ``invalid_request_error``
    (malformed JSON, nesting past ``MAX_JSON_DEPTH``, a lone surrogate:
    :mod:`musegl_core.http.body`)."""
    return load_json_object(body)


def structure_body(payload: dict[str, Any], cls: type[T]) -> T:
    """Type-check ``payload`` into ``cls``; the first bad field is named (400)."""
    try:
        return converter.structure(payload, cls)
    except cattrs.BaseValidationError as exc:
        _refuse(exc)


def _refuse(exc: cattrs.BaseValidationError) -> NoReturn:
    """Raise the 400 for a structuring failure (:func:`_field_error`) so that the request's
    body is freed as soon as the error is handled, not at the next garbage collection:
    cattrs' generated functions keep their failures in a local list, a cycle through the
    tracebacks whose frames hold the body, so those frames are cleared first; and this
    frame drops the error before it propagates (a frame holding the error its own traceback
    holds would be a cycle too)."""
    error = _field_error(exc)
    pending = [exc]
    while pending:
        failure = pending.pop()
        pending.extend(getattr(failure, "exceptions", ()))
        if failure.__traceback__ is not None:
            traceback.clear_frames(failure.__traceback__)
            failure.__traceback__ = None
    try:
        raise error from None
    finally:
        del error


def json_literal(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def _field_error(exc: cattrs.BaseValidationError) -> ApiError:
    """The first structuring failure as a 400 naming its field (``stop[1]``,
    ``stream_options.include_usage``); unknown keys of a closed object are
    ``unsupported_parameter``."""
    unknown = _find_unknown_keys(exc)
    if unknown is not None:
        where, key = unknown
        param = f"{where}.{key}" if where else key
        return bad_request(
            f"'{param}' is not a supported parameter", code="unsupported_parameter", param=param
        )
    first = cattrs.transform_error(exc, path="$")[0]
    reason, _, path = first.rpartition(" @ ")
    param = path.removeprefix("$").lstrip(".") or None
    expected = reason.rpartition("expected ")[2] or "a valid value"
    return bad_request(f"'{param}' has the wrong type: expected {_readable(expected)}", param=param)


def _find_unknown_keys(exc: BaseException, where: str = "") -> tuple[str, str] | None:
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return where, sorted(exc.extra_fields)[0]
    if isinstance(exc, cattrs.BaseValidationError):
        for sub in exc.exceptions:
            name = next(
                (getattr(n, "name", None) for n in getattr(sub, "__notes__", ()) if hasattr(n, "name")),
                None,
            )
            found = _find_unknown_keys(sub, f"{where}.{name}".lstrip(".") if name else where)
            if found is not None:
                return found
    return None


def _readable(expected: str) -> str:
    """``int | None`` → ``an integer`` for error messages."""
    names = {
        "int": "an integer",
        "float": "a number",
        "str": "a string",
        "bool": "a boolean",
        "list": "an array",
        "dict": "an object",
    }
    kinds = [k.strip() for k in expected.split("|") if k.strip() != "None"]
    words = [names.get(k.split("[")[0], "an object" if "." in k else k) for k in kinds]
    return " or ".join(dict.fromkeys(words)) or expected


def to_json(obj: Any) -> dict[str, Any]:
    """Unstructure a response object for the wire."""
    return converter.unstructure(obj)


def cache_salt_field() -> Any:
    """``cache_salt`` (vLLM's field): requests share cached KV only with requests
    of the same salt; absent is the shared unsalted space (docs/serving.md)."""
    return attrs.field(default=None, metadata={JSON_SCHEMA: {
        "anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT}, {"type": "null"}],
        "description": "prefix-cache isolation: KV is reused only between requests with the same salt",
    }})
