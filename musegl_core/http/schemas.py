"""The Chat Completions wire format: attrs classes and their cattrs converter.

Requests are structured from the raw JSON body with :data:`converter`, whose
primitive hooks are *strict* (``"5"`` is not an integer, ``1`` is not a
boolean, a string is not a list), so a wrong field type becomes a 400 that
names the field (:func:`structure_request`). Responses are unstructured with
the same converter; fields declared with :func:`omittable` disappear from the
JSON when they are ``None`` (``reasoning_content``, ``tool_calls``, ...),
while ordinary ``None`` fields are written as ``null`` (the role chunk's
``content``, ``finish_reason`` of a delta chunk).

Shapes follow spec/api.md sections 2, 3, 4, 6 and 7.
"""

from __future__ import annotations

import json
from typing import Any, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory, mapping_structure_factory
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from musegl_core.errors import ApiError, bad_request

_OMIT_NONE = "musegl_omit_none"
_FORBID_EXTRA = "__musegl_forbid_extra_keys__"


def omittable(default: Any = None) -> Any:
    """An attrs field that is left out of the JSON while it is ``None``."""
    return attrs.field(default=default, metadata={_OMIT_NONE: True})


def closed(cls: type) -> type:
    """Mark an attrs request class whose unknown keys are an error (``reasoning``,
    ``chat_template_kwargs``); the 400 names the unknown key."""
    setattr(cls, _FORBID_EXTRA, True)
    return cls


# -- requests --------------------------------------------------------------------------
@attrs.frozen
class StreamOptions:
    include_usage: bool | None = None


@closed
@attrs.frozen
class ReasoningOptions:
    """OpenRouter's ``reasoning`` object as musegl accepts it (spec 2.4)."""

    effort: str | None = None
    exclude: bool | None = None
    enabled: bool | None = None


@closed
@attrs.frozen
class ChatTemplateKwargs:
    """The template variables a client may set (chat-format.md 2.2-2.4)."""

    current_date: str | None = None
    knowledge_cutoff: str | None = None
    reasoning_strength: str | None = None
    tool_namespace_descriptions: dict[str, str] | None = None


@attrs.frozen
class ResponseFormat:
    type: str


StopField = str | list[str] | None


@attrs.frozen
class ChatCompletionRequest:
    """A ``POST /v1/chat/completions`` body after type checks.

    ``messages``, ``tools`` and ``tool_choice`` stay raw JSON here: the chat
    package validates them with its own, more specific errors. Fields on the
    reject list of spec 2.3 are checked on the raw body before structuring
    (:func:`structure_request`). Range and consistency rules live in
    :mod:`musegl_core.http.completions`.
    """

    messages: Any = None
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: StopField = None
    ignore_eos: bool | None = None
    session_id: str | None = None
    reasoning_effort: str | None = None
    reasoning: ReasoningOptions | None = None
    include_reasoning: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None


# Present with a non-null value → 400 unsupported_parameter (spec 2.3).
REJECTED_FIELDS = (
    "thinking_token_budget",
    "grammar",
    "stop_regex",
    "cache_salt",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
)


# -- responses -------------------------------------------------------------------------
@attrs.frozen
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as a string


@attrs.frozen
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@attrs.frozen
class ToolCallDelta:
    """A complete, validated call in a stream (arguments are not streamed piecemeal)."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


@attrs.frozen
class AssistantMessage:
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None = omittable()
    reasoning: str | None = omittable()  # the openrouter dialect's second name
    tool_calls: list[ToolCall] | None = omittable()


@attrs.frozen
class Choice:
    message: AssistantMessage
    finish_reason: str
    index: int = 0


@attrs.frozen
class PromptTokensDetails:
    cached_tokens: int = 0


@attrs.frozen
class CompletionTokensDetails:
    reasoning_tokens: int = 0


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails | None = omittable()


@attrs.frozen
class ChatCompletion:
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


@attrs.frozen
class RoleDelta:
    """The first delta of a stream: ``content`` is present and ``null`` (spec 4.2)."""

    role: str = "assistant"
    content: None = None


@attrs.frozen
class Delta:
    """A later delta: only the fields it carries (``{}`` for the finish chunk)."""

    content: str | None = omittable()
    reasoning_content: str | None = omittable()
    reasoning: str | None = omittable()
    tool_calls: list[ToolCallDelta] | None = omittable()


@attrs.frozen
class ChunkChoice:
    delta: RoleDelta | Delta
    finish_reason: str | None = None
    index: int = 0


@attrs.frozen
class ChatCompletionChunk:
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = omittable()
    object: str = "chat.completion.chunk"


@attrs.frozen
class ModelEntry:
    """One ``/v1/models`` entry. ``context_length`` and ``max_model_len`` are both
    the runtime ``--max-context`` budget (spec 1); ``demo`` marks the built-in
    random-weight demo model."""

    id: str
    created: int
    context_length: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "musegl"
    demo: bool | None = omittable()
    description: str | None = omittable()


@attrs.frozen
class ModelList:
    """``/v1/models``. Entries are written by their own class, so a dialect may
    return a richer entry than :class:`ModelEntry` (the OpenRouter model shape)."""

    data: list[Any]
    object: str = "list"


@attrs.frozen
class HealthStatus:
    status: str = "ok"


@attrs.frozen
class ErrorObject:
    """OpenAI's error object (spec 6.1, openai dialect)."""

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


def _structure_stop(value: Any, _: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    return converter.structure(value, list[str])


converter.register_structure_hook_factory(_is_list, _strict_list)
converter.register_structure_hook_factory(_is_dict, _strict_dict)
converter.register_structure_hook_factory(attrs.has, _strict_attrs)
converter.register_structure_hook_func(lambda t: t is StopField, _structure_stop)


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
    """The request body as a JSON object, or a 400 ``invalid_request_error``."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object")
    return payload


def structure_request(payload: dict[str, Any]) -> ChatCompletionRequest:
    """Type-check ``payload`` into a :class:`ChatCompletionRequest`.

    Rejected fields (spec 2.3) come first; a ``null`` counts as absent
    everywhere. The first offending field is named in the error's ``param``.
    """
    for name in REJECTED_FIELDS:
        if payload.get(name) is not None:
            raise bad_request(
                f"'{name}' is not supported by this server", code="unsupported_parameter", param=name
            )
    try:
        return converter.structure(payload, ChatCompletionRequest)
    except cattrs.BaseValidationError as exc:
        raise _field_error(exc) from exc


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

